#!/usr/bin/env bash
# run_opens.sh: what `lightfoot run`'s watcher costs an open (issue 30). While CMD runs, every
# open on a watched file system waits for the watcher (FAN_OPEN_PERM): for a process outside
# CMD's tree, one look at its parent chain; inside, a first sight or a message to the scanner.
# A Python loop opens and closes one file N times (default 20000) on the file system of DIR,
# ROUNDS (5) alternating rounds, median µs per open+close:
#   none      no lightfoot run anywhere;
#   outside   while `lightfoot run --watch always -- sleep …` runs, from a process outside it;
#   inside    the loop itself under `lightfoot run --watch always` (its tree).
# Root (fanotify).
#
# Usage: bench/run_opens.sh [DIR]   (DIR default /work/tmp/bench-opens)
set -euo pipefail
export LC_ALL=C
HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
DIR=${1:-/work/tmp/bench-opens}
N=${N:-20000}
ROUNDS=${ROUNDS:-5}
LF=${LIGHTFOOT:-$HERE/../target/release/lightfoot}
[[ $EUID -eq 0 ]] || { echo "run_opens.sh: run as root (fanotify)" >&2; exit 1; }
[[ -x $LF ]] || { echo "run_opens.sh: $LF: not built (cargo build --release)" >&2; exit 1; }
mkdir -p "$DIR"
cd "$DIR"
echo hello >f
cat >opens.py <<'PY'
import os, sys, time
n = int(sys.argv[1])
t = time.perf_counter()
for _ in range(n):
    os.close(os.open("f", os.O_RDONLY))
print(f"{(time.perf_counter() - t) / n * 1e6:.2f}")
PY
echo "variant,round,us_per_open" >results.csv
for ((r = 1; r <= ROUNDS; r++)); do
	vs="none outside inside"
	((r % 2)) || vs="inside outside none"
	for v in $vs; do
		case $v in
		none) m=$(/usr/bin/python3 opens.py "$N") ;;
		outside)
			"$LF" run --watch always -- sleep 60 &
			bg=$!
			sleep 1
			m=$(/usr/bin/python3 opens.py "$N")
			kill -TERM "$bg"
			wait "$bg" || true
			;;
		inside) m=$("$LF" run --watch always -- /usr/bin/python3 opens.py "$N" 2>/dev/null) ;;
		esac
		echo "$v,$r,$m" >>results.csv
	done
done
python3 - results.csv <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
med = {v: statistics.median(float(r["us_per_open"]) for r in rows if r["variant"] == v) for v in ("none", "outside", "inside")}
print("| no watcher | outside CMD's tree | inside it |")
print("|---|---|---|")
print(f"| {med['none']:.2f} µs | {med['outside']:.2f} µs | {med['inside']:.2f} µs |")
PY
echo "raw: $DIR/results.csv" >&2
