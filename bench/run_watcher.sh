#!/usr/bin/env bash
# run_watcher.sh: what `lightfoot run`'s watcher lets a program hold while it runs (issue 30:
# "a stated, measured bound on the watcher path"). Static C programs (gcc -static: no preload
# can enter them) go through a file of SIZE (default 1G) in 1 MiB steps:
#   read    read(2), the file position moves (the watcher keeps a window around it);
#   pread   pread(2), the position stays at 0 (no window: blocks go after two ticks);
#   mmap    reads every page of a mapping (mapped pages cannot be dropped until unmapped);
#   write   write(2) of a new file, then fsync.
# Each bare and under `lightfoot run --watch always` (and `--max-cache 0` for write), ROUNDS (3)
# alternating rounds: the time and the peak of the file's page cache (cachestat every 10 ms).
# Root (fanotify, drop_caches).
#
# Usage: bench/run_watcher.sh [DIR]   (DIR default /work/tmp/bench-watcher)
set -euo pipefail
export LC_ALL=C
HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
DIR=${1:-/work/tmp/bench-watcher}
SIZE=${SIZE:-1G}
ROUNDS=${ROUNDS:-3}
LF=${LIGHTFOOT:-$HERE/../target/release/lightfoot}
[[ $EUID -eq 0 ]] || { echo "run_watcher.sh: run as root" >&2; exit 1; }
[[ -x $LF ]] || { echo "run_watcher.sh: $LF: not built (cargo build --release)" >&2; exit 1; }
mkdir -p "$DIR"
cd "$DIR"
# shellcheck source=bench/data_file.sh
. "$HERE/data_file.sh"
want=$(data_file data "$SIZE")
cat >prog.c <<'C'
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
static char buf[1 << 20];
int main(int argc, char **argv) {
    const char *mode = argv[1];
    struct stat st;
    if (strcmp(mode, "write") == 0) {
        long long n = atoll(argv[3]);
        int fd = open(argv[2], O_WRONLY | O_CREAT | O_TRUNC, 0644);
        memset(buf, 7, sizeof buf);
        for (long long d = 0; d < n; d += sizeof buf)
            if (write(fd, buf, sizeof buf) != sizeof buf) return 3;
        return fsync(fd) || close(fd);
    }
    int fd = open(argv[2], O_RDONLY);
    if (fd < 0 || fstat(fd, &st)) return 2;
    unsigned long sum = 0;
    if (strcmp(mode, "mmap") == 0) {
        unsigned char *p = mmap(0, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) return 4;
        for (off_t o = 0; o < st.st_size; o += 4096) sum += p[o];
        munmap(p, st.st_size);
    } else {
        for (off_t o = 0; o < st.st_size; o += sizeof buf) {
            ssize_t n = strcmp(mode, "pread") == 0 ? pread(fd, buf, sizeof buf, o) : read(fd, buf, sizeof buf);
            if (n <= 0) return 5;
            sum += (unsigned char)buf[0];
        }
    }
    return sum == 42 ? 6 : 0;
}
C
gcc -O2 -static -o prog prog.c
cat >sampler.py <<'PY'
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
class R(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]
class S(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recent")]
peak = -1
while True:
    try:
        fd = os.open(sys.argv[2], os.O_RDONLY)
        s = S()
        libc.syscall(451, fd, ctypes.byref(R(0, 0)), ctypes.byref(s), 0)
        os.close(fd)
        n = s.cache * 4096
    except OSError:
        n = 0
    if n > peak:
        peak = n
        with open(sys.argv[1], "w") as f:
            f.write(f"{peak}\n")
    time.sleep(0.01)
PY
echo "mode,variant,round,seconds,peak_bytes" >results.csv
for ((r = 1; r <= ROUNDS; r++)); do
	for mode in read pread mmap write; do
		vs="bare watcher"
		[[ $mode != write ]] || vs="bare watcher watcher-max0"
		((r % 2)) || vs=$(tr ' ' '\n' <<<"$vs" | tac | tr '\n' ' ')
		for v in $vs; do
			target=data
			args=("$mode" data)
			if [[ $mode == write ]]; then
				rm -f out
				target=out
				args=(write out "$want")
			fi
			sync
			echo 3 >/proc/sys/vm/drop_caches
			rm -f peak
			/usr/bin/python3 sampler.py peak "$target" &
			s=$!
			until [[ -s peak ]]; do sleep 0.01; done
			t0=$EPOCHREALTIME
			case $v in
			bare) ./prog "${args[@]}" ;;
			watcher) "$LF" run --watch always -- ./prog "${args[@]}" ;;
			watcher-max0) "$LF" run --watch always --max-cache 0 -- ./prog "${args[@]}" ;;
			esac
			t1=$EPOCHREALTIME
			kill "$s"
			wait "$s" 2>/dev/null || true
			secs=$(python3 -c "print(f'{$t1 - $t0:.3f}')")
			echo "$mode,$v,$r,$secs,$(<peak)" >>results.csv
			echo "== round $r $mode $v: $secs s, peak $(($(<peak) >> 20)) MiB" >&2
		done
	done
done
python3 - results.csv <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print("| program | variant | s (median) | peak MiB (median) |")
print("|---|---|---|---|")
for m in dict.fromkeys(r["mode"] for r in rows):
    for v in dict.fromkeys(r["variant"] for r in rows if r["mode"] == m):
        rs = [r for r in rows if r["mode"] == m and r["variant"] == v]
        print(f"| {m} | {v} | {statistics.median(float(r['seconds']) for r in rs):.2f} | {statistics.median(int(r['peak_bytes']) for r in rs) / 2**20:.0f} |")
PY
echo "raw: $DIR/results.csv" >&2
