#!/usr/bin/env bash
# tracking.sh: what `serve --dirty-bitmap` costs on the write path (issue 45). fio's nbd engine
# writes through `lightfoot serve` without a bitmap ("plain") and with one ("tracked": a fresh
# bitmap file each run, every block clean, made with `lightfoot bitmap add --granularity GRAIN`), the two alternating within each round, in an
# order that turns each round:
#
#   workload  what
#   rand4k    random 4 KiB writes over the file, each block once (fio's random map), an
#             eighth of the file's blocks, iodepth 16, fsync at the end: with the bitmap's
#             granularity at 4K (GRAIN) every write is the first touch of its bit
#   seq1m     sequential 1 MiB writes over the whole file, iodepth 4, fsync at the end
#
# Every run overwrites one file of SIZE, written in full once at the start (so no run pays
# for allocation: a fresh fallocate'd file split into 4 KiB extents by rand4k took minutes
# to delete), after sync and a drop of the host's caches. The server stops cleanly after each
# run (so a tracked one saves its bitmap; that is outside fio's time).
#
# Usage (as root: it drops caches):
#     bench/tracking.sh [DIR]
#     SIZE=512M ROUNDS=1 bench/tracking.sh /work/tmp/tracking-smoke
#
# Environment: SIZE (default 4G), ROUNDS (default 5), WORKLOADS (default "rand4k seq1m"), GRAIN
# (the tracked bitmap's granularity, default 4K; serve makes 64K ones),
# LIGHTFOOT (default ../target/release/lightfoot). Needs SIZE of room in DIR (default
# /work/tmp/bench-tracking).
#
# Output: every run in DIR/tracking.csv; medians and tracked/plain ratios on stdout.
set -euo pipefail
export LC_ALL=C

die() { echo "tracking.sh: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }

HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
[[ $EUID -eq 0 ]] || die "run as root (it drops caches)"
SIZE=${SIZE:-4G}
BYTES=$(numfmt --from=iec "$SIZE") || die "SIZE=$SIZE: not a size"
((BYTES % 1048576 == 0)) || die "SIZE=$SIZE: not a multiple of 1M"
ROUNDS=${ROUNDS:-5}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS: not a positive integer"
WORKLOADS=${WORKLOADS:-rand4k seq1m}
GRAIN=${GRAIN:-4K}
LIGHTFOOT=$(realpath -- "${LIGHTFOOT:-$HERE/../target/release/lightfoot}")
[[ -x $LIGHTFOOT ]] || die "no lightfoot binary at $LIGHTFOOT"
command -v fio >/dev/null || die "fio is missing (scripts/install-deps.sh)"
DIR=${1:-/work/tmp/bench-tracking}
mkdir -p -- "$DIR/logs"
DIR=$(realpath -- "$DIR")
IMG=$DIR/disk.img
SOCK=$DIR/s.sock
PIDF=$DIR/server.pid
CSV=$DIR/tracking.csv
CONFIGS=(plain tracked)

# shellcheck source=bench/servers.sh
. "$HERE/servers.sh"

fio_cmd() { # WORKLOAD JSON
	local uri="nbd+unix:///?socket=$SOCK"
	local base=(fio --name="$1" --ioengine=nbd --uri="$uri" --group_reporting --eta=never
		--end_fsync=1 --output-format=json --output="$2")
	case $1 in
	rand4k) echo "${base[@]}" --rw=randwrite --bs=4k --iodepth=16 --size="$BYTES" --io_size=$((BYTES / 8)) ;;
	seq1m) echo "${base[@]}" --rw=write --bs=1m --iodepth=4 --size="$BYTES" ;;
	*) die "unknown workload $1" ;;
	esac
}

say "writing $IMG ($SIZE)"
rm -f -- "$IMG" "$IMG.bitmaps"
dd if=/dev/zero of="$IMG" bs=1M count=$((BYTES / 1048576)) oflag=direct status=none
echo "round,workload,config,iops,mib_s,changed" >"$CSV"
for ((r = 1; r <= ROUNDS; r++)); do
	for w in $WORKLOADS; do
		for ((k = 0; k < ${#CONFIGS[@]}; k++)); do
			c=${CONFIGS[$(((k + r) % ${#CONFIGS[@]}))]}
			rm -f -- "$IMG.bitmaps"
			sync
			echo 3 >/proc/sys/vm/drop_caches
			extra=()
			if [[ $c == tracked ]]; then
				"$LIGHTFOOT" bitmap add --granularity "$GRAIN" "$IMG" b >/dev/null
				extra=(--dirty-bitmap b)
			fi
			log=$DIR/logs/$w-$c-$r
			launch "$log.server" "$LIGHTFOOT" serve --unix "$SOCK" --pid-file "$PIDF" "${extra[@]}" "$IMG" ||
				die "the server did not start: $(cat "$log.server")"
			read -r -a cmd <<<"$(fio_cmd "$w" "$log.json")"
			"${cmd[@]}" >"$log.fio" 2>&1 || die "fio failed: $(cat "$log.fio")"
			kill "$SERVER_PID"
			wait "$SERVER_PID" || die "the server failed: $(cat "$log.server")"
			changed=-
			[[ $c == tracked ]] && changed=$("$LIGHTFOOT" bitmap list --json "$IMG" |
				python3 -c 'import json,sys; print(json.load(sys.stdin)["bitmaps"][0]["changed"])')
			read -r iops mibs < <(python3 -c '
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]["write"]
print(round(j["iops"]), round(j["bw_bytes"] / 1048576, 1))' "$log.json")
			echo "$r,$w,$c,$iops,$mibs,$changed" >>"$CSV"
			say "round $r $w $c: $iops IOPS, $mibs MiB/s, changed $changed"
		done
	done
done
rm -f -- "$IMG" "$IMG.bitmaps"

python3 - "$CSV" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print(f"{'workload':<8} {'config':<8} {'IOPS':>8} {'MiB/s':>8}  tracked/plain (medians; per-round median)")
for w in dict.fromkeys(r["workload"] for r in rows):
    med = {}
    for c in ("plain", "tracked"):
        xs = [float(r["iops"]) for r in rows if r["workload"] == w and r["config"] == c]
        bw = [float(r["mib_s"]) for r in rows if r["workload"] == w and r["config"] == c]
        med[c] = statistics.median(xs)
        print(f"{w:<8} {c:<8} {med[c]:>8.0f} {statistics.median(bw):>8.1f}")
    per = [float(t["iops"]) / float(p["iops"]) for p in rows for t in rows
           if p["workload"] == t["workload"] == w and p["round"] == t["round"]
           and p["config"] == "plain" and t["config"] == "tracked"]
    print(f"{w:<8} ratio    {med['tracked'] / med['plain']:>8.3f} {statistics.median(per):>8.3f}")
EOF
