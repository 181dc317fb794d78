#!/usr/bin/python3
"""replay.py SOCKET TRACE [QD]: sends the reads an nbdkit log-filter TRACE recorded, in their
order, to the NBD server on the Unix SOCKET; QD requests in flight (default 1: each waits for
the one before, as a guest's dependent reads do). Prints "READS BYTES SECONDS".

Debian's /usr/bin/python3 (python3-libnbd). Used by bench/replay.sh.
"""
import re
import sys
import time

import nbd

READ = re.compile(r" Read id=\d+ offset=0x([0-9a-f]+) count=0x([0-9a-f]+) \.\.\.$")


def reads(path):
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            m = READ.search(line)
            if m:
                out.append((int(m.group(1), 16), int(m.group(2), 16)))
    return out


def main():
    sock, trace = sys.argv[1], sys.argv[2]
    qd = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    todo = reads(trace)
    if not todo:
        sys.exit(f"replay.py: no reads in {trace} (an nbdkit --filter=log file?)")
    h = nbd.NBD()
    h.connect_unix(sock)
    t0 = time.monotonic()
    if qd == 1:
        for off, n in todo:
            h.pread(n, off)
    else:
        i, flying = 0, []
        while i < len(todo) or flying:
            while i < len(todo) and len(flying) < qd:
                off, n = todo[i]
                flying.append(h.aio_pread(nbd.Buffer(n), off))
                i += 1
            h.poll(-1)
            # aio_command_completed raises the read's error, if it failed.
            flying = [c for c in flying if not h.aio_command_completed(c)]
    t = time.monotonic() - t0
    h.shutdown()
    print(len(todo), sum(n for _, n in todo), f"{t:.3f}")


if __name__ == "__main__":
    main()
