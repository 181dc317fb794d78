#!/usr/bin/python3
"""incremental_loop.py IMG BITMAP DST [QEMU_NBD_ARGS...]: what virtnbdbackup does for an
incremental, as a peer for bench/incremental.sh: one libnbd connection to a captive
`qemu-nbd QEMU_NBD_ARGS -B BITMAP IMG` (default arguments: -r -f qcow2), the
dirty extents of qemu:dirty-bitmap:BITMAP from BLOCK_STATUS, then one synchronous pread per
dirty extent (in pieces of at most 32 MiB, qemu-nbd's limit), each written to DST (a raw file
holding the previous copy) at its offset; fsync at the end, as lightfoot flushes. Prints
"EXTENTS BYTES".

Debian's /usr/bin/python3 (python3-libnbd).
"""
import os
import sys

import nbd

PIECE = 32 << 20


def main():
    img, bitmap, dst = sys.argv[1:4]
    server_args = sys.argv[4:] or ["-r", "-f", "qcow2"]
    context = "qemu:dirty-bitmap:" + bitmap
    h = nbd.NBD()
    h.add_meta_context(context)
    h.connect_systemd_socket_activation(["qemu-nbd", *server_args, "-B", bitmap, img])
    if not h.can_meta_context(context):
        sys.exit(f"incremental_loop.py: the server has no {context}")
    size = h.get_size()
    dirty = []

    def collect(meta, offset, entries, err):
        if meta != context:
            return 0
        at = offset
        for i in range(0, len(entries), 2):
            n, flags = entries[i], entries[i + 1]
            if flags & 1:
                dirty.append((at, n))
            at += n
        seen[0] = at
        return 0

    at = 0
    seen = [0]
    while at < size:
        seen[0] = at
        h.block_status(min(size - at, 1 << 30), at, collect)
        if seen[0] <= at:
            sys.exit(f"incremental_loop.py: no extents from {at}")
        at = seen[0]
    fd = os.open(dst, os.O_WRONLY)
    total = 0
    try:
        for off, n in dirty:
            n = min(n, size - off)
            done = 0
            while done < n:
                k = min(PIECE, n - done)
                buf = h.pread(k, off + done)
                os.pwrite(fd, buf, off + done)
                done += k
            total += n
        os.fsync(fd)
    finally:
        os.close(fd)
    h.shutdown()
    print(len(dirty), total)


if __name__ == "__main__":
    main()
