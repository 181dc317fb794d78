#!/usr/bin/env bash
# incremental.sh: incremental copies from a QEMU dirty bitmap (issue 45). A fully allocated
# qcow2 image of random data; for each share of it changed (PCTS, in 64 KiB pieces at random
# aligned offsets, written with qemu-io after a bitmap b0 started recording), three jobs bring
# a copy of the image up to date:
#
#   job        what
#   lightfoot  lightfoot copy --bitmap b0 -- [ qemu-nbd $QEMU_NBD_ARGS -B b0 IMG ] PREV.raw
#   loop       bench/incremental_loop.py: a libnbd loop as virtnbdbackup reads an incremental
#              (one connection, a synchronous pread per dirty extent, written into PREV.raw at
#              its offset, fsync at the end), from the same qemu-nbd
#   nbdcopy    nbdcopy --flush -- [ qemu-nbd $QEMU_NBD_ARGS IMG ] FULL.raw: a full copy
#
# QEMU_NBD_ARGS (default "-r -f qcow2 --cache=none"): the same server for all three; with
# qemu-nbd's default cache mode the image's pages it reads stay cached whoever the client is.
#
# Before each job: sync and drop the host's caches. The jobs alternate within each round, in an
# order that turns by one each round. After the first round of each share, the lightfoot and
# loop copies are checked against the image (qemu-img compare). Page cache left: the image's
# and the destination's cached bytes right after the job.
#
# Usage (as root: it drops caches):
#     bench/incremental.sh [DIR]
#     SIZE=512M ROUNDS=1 bench/incremental.sh /work/tmp/inc-smoke     # a quick look
#
# Environment: SIZE (default 4G), ROUNDS (default 5), PCTS (default "1 10"), QEMU_NBD_ARGS, LIGHTFOOT
# (default ../target/release/lightfoot), DIR (default: the argument, else
# /work/tmp/bench-incremental). Needs 4× SIZE of room in DIR.
#
# Output: every run in DIR/incremental.csv; a table of medians with lightfoot's ratios to the
# others on stdout.
set -euo pipefail
export LC_ALL=C

die() { echo "incremental.sh: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }

HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
[[ $EUID -eq 0 ]] || die "run as root (it drops caches)"
SIZE=${SIZE:-4G}
BYTES=$(numfmt --from=iec "$SIZE") || die "SIZE=$SIZE: not a size"
((BYTES % 65536 == 0)) || die "SIZE=$SIZE: not a multiple of 64K"
ROUNDS=${ROUNDS:-5}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS: not a positive integer"
PCTS=${PCTS:-1 10}
QEMU_NBD_ARGS=${QEMU_NBD_ARGS:--r -f qcow2 --cache=none}
read -r -a QN <<<"$QEMU_NBD_ARGS"
LIGHTFOOT=$(realpath -- "${LIGHTFOOT:-$HERE/../target/release/lightfoot}")
[[ -x $LIGHTFOOT ]] || die "no lightfoot binary at $LIGHTFOOT"
DIR=${1:-${DIR:-/work/tmp/bench-incremental}}
for t in qemu-img qemu-io qemu-nbd nbdcopy; do command -v "$t" >/dev/null || die "$t is missing (scripts/install-deps.sh)"; done
/usr/bin/python3 -c 'import nbd' 2>/dev/null || die "python3-libnbd is missing (scripts/install-deps.sh)"
mkdir -p -- "$DIR"
DIR=$(realpath -- "$DIR")
IMG=$DIR/img.qcow2
CSV=$DIR/incremental.csv
JOBS=(lightfoot loop nbdcopy)

# shellcheck source=bench/servers.sh
. "$HERE/servers.sh"

if [[ ! -f $IMG ]]; then
	say "making $IMG: $SIZE of random data, every cluster allocated"
	/usr/bin/python3 - "$DIR/img.raw" "$BYTES" <<'EOF'
import os, sys
with open(sys.argv[1], "wb") as f:
    left = int(sys.argv[2])
    while left:
        n = min(left, 16 << 20)
        f.write(os.urandom(n))
        left -= n
EOF
	qemu-img convert -q -f raw -O qcow2 "$DIR/img.raw" "$IMG"
	rm -f -- "$DIR/img.raw"
fi

HEADER="pct,round,job,status,seconds,img_cached,dst_cached"
[[ -f $CSV ]] || echo "$HEADER" >"$CSV"
[[ $(head -n 1 "$CSV") == "$HEADER" ]] || die "$CSV has other columns: move it away"

# change PCT: a new bitmap b0, then PCT % of the image rewritten in 64 KiB pieces at random
# aligned offsets (distinct; seeded by PCT).
change() {
	qemu-img bitmap --remove "$IMG" b0 2>/dev/null || true
	qemu-img bitmap --add --enable "$IMG" b0
	/usr/bin/python3 - "$BYTES" "$1" <<'EOF' | xargs -d '\n' -n 400 sh -c 'qemu-io -f qcow2 "$@" "$0" >/dev/null' "$IMG"
import random, sys
size, pct = int(sys.argv[1]), float(sys.argv[2])
blocks = size // 65536
rng = random.Random(int(pct * 1000))
for i, b in enumerate(sorted(rng.sample(range(blocks), max(1, int(blocks * pct / 100))))):
    print("-c")
    print(f"write -P {1 + i % 250} {b * 65536} 65536")
EOF
}

run_job() { # JOB PCT: runs it, prints seconds
	local t0 t1
	t0=$(date +%s.%N)
	case $1 in
	lightfoot) "$LIGHTFOOT" copy --bitmap b0 -- [ qemu-nbd "${QN[@]}" -B b0 "$IMG" ] "$DIR/prev-lightfoot.raw" >"$DIR/logs/$1-$2.out" 2>&1 ;;
	loop) /usr/bin/python3 "$HERE/incremental_loop.py" "$IMG" b0 "$DIR/prev-loop.raw" "${QN[@]}" >"$DIR/logs/$1-$2.out" 2>&1 ;;
	nbdcopy) nbdcopy --flush -- [ qemu-nbd "${QN[@]}" "$IMG" ] "$DIR/full-nbdcopy.raw" >"$DIR/logs/$1-$2.out" 2>&1 ;;
	esac
	t1=$(date +%s.%N)
	echo "$t0 $t1" | awk '{ printf "%.3f", $2 - $1 }'
}

dst_of() { case $1 in lightfoot) echo "$DIR/prev-lightfoot.raw" ;; loop) echo "$DIR/prev-loop.raw" ;; nbdcopy) echo "$DIR/full-nbdcopy.raw" ;; esac; }

mkdir -p "$DIR/logs"
for pct in $PCTS; do
	say "$pct %: the previous copies, then the changes"
	qemu-img bitmap --remove "$IMG" b0 2>/dev/null || true
	qemu-img convert -q -f qcow2 -O raw "$IMG" "$DIR/prev-lightfoot.raw"
	cp --reflink=never -- "$DIR/prev-lightfoot.raw" "$DIR/prev-loop.raw"
	truncate -s "$BYTES" "$DIR/full-nbdcopy.raw"
	change "$pct"
	for ((r = 1; r <= ROUNDS; r++)); do
		n=${#JOBS[@]}
		for ((i = 0; i < n; i++)); do
			j=${JOBS[$(((i + r - 1) % n))]}
			sync
			echo 3 >/proc/sys/vm/drop_caches
			status=ok
			secs=$(run_job "$j" "$pct") || status=failed
			[[ -n $secs ]] || secs=-
			ic=$(cached_bytes "$IMG")
			dc=$(cached_bytes "$(dst_of "$j")")
			echo "$pct,$r,$j,$status,$secs,$ic,$dc" >>"$CSV"
			say "$pct % round $r $j: $secs s ($status), cached: image $ic, destination $dc"
		done
		if ((r == 1)); then
			for j in lightfoot loop; do
				qemu-img compare -q -f qcow2 -F raw "$IMG" "$(dst_of "$j")" || die "$j's copy differs from the image ($pct %)"
			done
			say "$pct %: the lightfoot and loop copies equal the image"
		fi
	done
done

python3 - "$CSV" "$PCTS" <<'EOF'
import csv, statistics, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["status"] == "ok"]
med = lambda xs: statistics.median(xs) if xs else None
print("| changed | job | runs | seconds (median) | lightfoot / job | image cached after, MiB | destination cached after, MiB |")
print("|---|---|---|---|---|---|---|")
for pct in sys.argv[2].split():
    s = {}
    for j in ("lightfoot", "loop", "nbdcopy"):
        rs = [r for r in rows if r["pct"] == pct and r["job"] == j]
        s[j] = (len(rs), med([float(r["seconds"]) for r in rs]),
                med([float(r["img_cached"]) for r in rs if r["img_cached"] != "-"]),
                med([float(r["dst_cached"]) for r in rs if r["dst_cached"] != "-"]))
    for j, (n, secs, ic, dc) in s.items():
        lf = s["lightfoot"][1]
        ratio = f"{lf / secs:.3f}" if lf and secs else "-"
        mib = lambda v: "-" if v is None else f"{v / 2**20:.1f}"
        print(f"| {pct} % | {j} | {n} | {secs:.3f} | {ratio} | {mib(ic)} | {mib(dc)} |")
print("\nMedians; jobs alternating in each round; caches dropped before each job.")
EOF
