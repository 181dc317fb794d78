#!/usr/bin/env bash
# run_mechanism.sh: which mechanism `lightfoot run`'s library should use for a program's large
# reads (issue 30: "mechanism per call, chosen by measurement"). A cold sequential read of one
# file (SIZE, default 1G) in calls of each SIZES (default 128K and 1M), three ways, alternating,
# ROUNDS (5) rounds, median MB/s:
#   buffered    plain readv(2), bare: what the program does on its own (leaves it all cached);
#   dontcache   preadv2(2) with RWF_DONTCACHE (0x80) at the file position: what the library
#               would turn a large read into;
#   lightfoot   plain readv(2) under `lightfoot run --watch never`: buffered reads with the
#               library's evict-behind per 2 MiB block (what it does now).
# Each read is preceded by `lightfoot cache evict FILE`. Needs Debian's python3 (its
# os.preadv takes flags); no root.
#
# Usage: bench/run_mechanism.sh [DIR]   (DIR default /work/tmp/bench-mechanism)
set -euo pipefail
export LC_ALL=C
HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
DIR=${1:-/work/tmp/bench-mechanism}
SIZE=${SIZE:-1G}
SIZES=${SIZES:-128K 1M}
ROUNDS=${ROUNDS:-5}
LF=${LIGHTFOOT:-$HERE/../target/release/lightfoot}
[[ -x $LF ]] || { echo "run_mechanism.sh: $LF: not built (cargo build --release)" >&2; exit 1; }
mkdir -p "$DIR"
cd "$DIR"
# shellcheck source=bench/data_file.sh
. "$HERE/data_file.sh"
data_file data "$SIZE" >/dev/null
cat >reader.py <<'PY'
import os, sys, time
size, mode = int(sys.argv[1]), sys.argv[2]
fd = os.open("data", os.O_RDONLY)
buf = bytearray(size)
t = time.monotonic()
n = 0
while True:
    r = os.preadv(fd, [buf], -1, 0x80) if mode == "dontcache" else os.readv(fd, [buf])
    if r <= 0:
        break
    n += r
print(f"{n / (time.monotonic() - t) / 1e6:.0f}")
PY
echo "calls,variant,round,MB_s" >results.csv
for s in $SIZES; do
	b=$(numfmt --from=iec "$s")
	for ((r = 1; r <= ROUNDS; r++)); do
		vs="buffered dontcache lightfoot"
		((r % 2)) || vs="lightfoot dontcache buffered"
		for v in $vs; do
			"$LF" cache evict data >/dev/null
			sleep 0.3
			case $v in
			lightfoot) m=$("$LF" run --watch never -- /usr/bin/python3 reader.py "$b" buffered) ;;
			*) m=$(/usr/bin/python3 reader.py "$b" "$v") ;;
			esac
			echo "$s,$v,$r,$m" >>results.csv
		done
	done
done
python3 - results.csv <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print("| calls | buffered (bare) | dontcache | lightfoot run (evict-behind) |")
print("|---|---|---|---|")
for s in dict.fromkeys(r["calls"] for r in rows):
    med = {v: statistics.median(int(r["MB_s"]) for r in rows if r["calls"] == s and r["variant"] == v)
           for v in ("buffered", "dontcache", "lightfoot")}
    print(f"| {s} | {med['buffered']:.0f} MB/s | {med['dontcache']:.0f} MB/s | {med['lightfoot']:.0f} MB/s |")
PY
echo "raw: $DIR/results.csv" >&2
