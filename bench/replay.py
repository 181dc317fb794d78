#!/usr/bin/python3
"""replay.py SOCKET TRACE [QD [THINK_MS]]: sends the reads an nbdkit log-filter TRACE recorded,
in their order, to the NBD server on the Unix SOCKET; QD requests in flight (default 1: each
waits for the one before, as a guest's dependent reads do). With THINK_MS > 0 (depth 1 only)
each read waits first as long as the guest did between its previous read's reply and it, up to
THINK_MS: the time a server's read-ahead has to work in. Prints "READS BYTES SECONDS", SECONDS
less the time spent waiting.

Debian's /usr/bin/python3 (python3-libnbd). Used by bench/replay.sh.
"""
import re
import sys
import time

import nbd

READ = re.compile(r" Read id=(\d+) offset=0x([0-9a-f]+) count=0x([0-9a-f]+) \.\.\.$")
DONE = re.compile(r" \.\.\.Read id=(\d+) return")


def stamp(line):
    """Seconds since midnight of the log line's time stamp ("YYYY-MM-DD HH:MM:SS.ffffff")."""
    h, m, s = line.split()[1].split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def reads(path):
    """(offset, count, gap) per read, gap: seconds from the previous read's reply to it."""
    out, started, last_done = [], {}, None
    with open(path, errors="replace") as f:
        for line in f:
            m = READ.search(line)
            if m:
                t = stamp(line)
                gap = max(0.0, t - last_done) if last_done is not None else 0.0
                started[m.group(1)] = len(out)
                out.append((int(m.group(2), 16), int(m.group(3), 16), gap))
                continue
            m = DONE.search(line)
            if m and m.group(1) in started:
                last_done = stamp(line)
    return out


def main():
    sock, trace = sys.argv[1], sys.argv[2]
    qd = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    think = float(sys.argv[4]) / 1000 if len(sys.argv) > 4 else 0.0
    if think > 0 and qd != 1:
        sys.exit("replay.py: THINK_MS needs depth 1")
    todo = reads(trace)
    if not todo:
        sys.exit(f"replay.py: no reads in {trace} (an nbdkit --filter=log file?)")
    h = nbd.NBD()
    h.connect_unix(sock)
    t0, waited = time.monotonic(), 0.0
    if qd == 1:
        for off, n, gap in todo:
            if think > 0 and gap > 0:
                w0 = time.monotonic()
                time.sleep(min(gap, think))
                waited += time.monotonic() - w0
            h.pread(n, off)
    else:
        i, flying = 0, []
        while i < len(todo) or flying:
            while i < len(todo) and len(flying) < qd:
                off, n, _ = todo[i]
                flying.append(h.aio_pread(nbd.Buffer(n), off))
                i += 1
            h.poll(-1)
            # aio_command_completed raises the read's error, if it failed.
            flying = [c for c in flying if not h.aio_command_completed(c)]
    t = time.monotonic() - t0 - waited
    h.shutdown()
    print(len(todo), sum(r[1] for r in todo), f"{t:.3f}")


if __name__ == "__main__":
    main()
