#!/usr/bin/env bash
# nbd.sh: lightfoot copy against nbdcopy --flush, to and from the same NBD server.
#
# Four transfers, each run by both tools, alternating which goes first:
#   pull-half  NBD -> file, source half data half holes (alternating PIECE of each)
#   pull-rand  NBD -> file, source all random data
#   push-half  file -> NBD, the same half-hole source, into a new sparse file the server exports
#   push-rand  file -> NBD, the random source
# The server is started afresh for each run (before the clock starts) and stopped after it;
# caches are dropped before each run. Right after each run, the page-cache footprint of the
# source and destination files is read with `lightfoot cache stat`.
#
# Usage (as root: it drops caches):
#     bench/nbd.sh [DIR]
#     SIZE=256M RUNS=1 bench/nbd.sh          # smoke test
#
# Environment:
#     SIZE       size of each source (default 4G)
#     RUNS       rounds (default 5); each round runs every transfer with both tools
#     TRANSFERS  which transfers (default: "pull-half pull-rand push-half push-rand")
#     TOOLS      which tools (default: "lightfoot nbdcopy"; "lightfoot" alone for an A/B of two
#                lightfoot binaries, bench/ab.sh)
#     PIECE      data/hole alternation of the half source (default 1M)
#     SERVER     qemu (default): qemu-nbd -f raw --cache=none --aio=native --discard=unmap,
#                read-only exports with -e 8 (so it advertises multi-conn);
#                lightfoot: lightfoot serve (neutral cache mode), -r for sources
#     VERIFY     first (default): compare DST with SRC in the first round; all; none
#     LIGHTFOOT  the binary to test (default ../target/release/lightfoot beside this script)
#     LIGHTFOOT_ARGS  more options for `lightfoot copy`, e.g. "--request-size 512K"
#     DIR        sources, destinations, results (default: the argument, else /work/tmp/bench-nbd);
#                needs about 3.5 x SIZE free
#
#     QUIET      steal limit in percent (default 10): the summary adds a table of the rounds in
#                which the host took less than this share of the machine's CPU time during both
#                tools' runs of a transfer (see "steal" below)
#
# Output: a table of medians on stdout and in DIR/table-nbd.md, every run in DIR/nbd.csv.
# Only ratios within one run mean anything on these VMs. Each run also records the share of
# CPU time the host stole from this VM while it ran (/proc/stat "steal"): on these machines it
# swings from 0 to over 30 % within minutes, and a run that lost a third of its CPU says more
# about the host than about the tool.
set -euo pipefail
export LC_ALL=C

die() { echo "nbd.sh: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }

HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
[[ $EUID -eq 0 ]] || die "run as root (it writes /proc/sys/vm/drop_caches)"
(($# <= 1)) || die "usage: nbd.sh [DIR]"

SIZE=${SIZE:-4G}
RUNS=${RUNS:-5}
PIECE=${PIECE:-1M}
SERVER=${SERVER:-qemu}
VERIFY=${VERIFY:-first}
QUIET=${QUIET:-10}
TRANSFERS=${TRANSFERS:-pull-half pull-rand push-half push-rand}
TOOLS=${TOOLS:-lightfoot nbdcopy}
DIR=${DIR:-${1:-/work/tmp/bench-nbd}}
LIGHTFOOT=${LIGHTFOOT:-$HERE/../target/release/lightfoot}
LIGHTFOOT_ARGS=${LIGHTFOOT_ARGS:-}

to_bytes() { numfmt --from=iec -- "$1" 2>/dev/null || die "$2=$1: not a size"; }
SIZE_BYTES=$(to_bytes "$SIZE" SIZE)
PIECE_BYTES=$(to_bytes "$PIECE" PIECE)
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || die "RUNS=$RUNS: not a positive integer"
[[ $SERVER == qemu || $SERVER == lightfoot ]] || die "SERVER=$SERVER: qemu or lightfoot"
[[ $VERIFY == first || $VERIFY == all || $VERIFY == none ]] || die "VERIFY=$VERIFY: first, all or none"
[[ $QUIET =~ ^[0-9]+$ ]] || die "QUIET=$QUIET: a percentage"
read -r -a TRANSFER_KEYS <<<"${TRANSFERS//,/ }"
((${#TRANSFER_KEYS[@]})) || die "TRANSFERS: empty"
for t in "${TRANSFER_KEYS[@]}"; do
	[[ $t =~ ^(pull|push)-(half|rand)$ ]] || die "TRANSFERS: unknown $t (pull-half, pull-rand, push-half, push-rand)"
done
read -r -a TOOL_KEYS <<<"${TOOLS//,/ }"
((${#TOOL_KEYS[@]})) || die "TOOLS: empty"
for t in "${TOOL_KEYS[@]}"; do
	[[ $t == lightfoot || $t == nbdcopy ]] || die "TOOLS: unknown $t (lightfoot, nbdcopy)"
done
[[ -x $LIGHTFOOT ]] || die "no lightfoot binary at $LIGHTFOOT (cargo build --release, or set LIGHTFOOT=)"
LIGHTFOOT=$(realpath -- "$LIGHTFOOT")
for t in nbdcopy qemu-nbd python3 /usr/bin/time; do
	command -v "$t" >/dev/null || die "$t is needed (make deps)"
done

mkdir -p -- "$DIR"
DIR=$(realpath -- "$DIR")
exec 9>"$DIR/.lock"
flock -n 9 || die "another nbd.sh is running in $DIR"
SOCK=$DIR/server.sock
OUT=$DIR/out.img
CSV=$DIR/nbd.csv
LOG=$DIR/nbd.log
: >"$LOG"

# --- sources: made once, reused while the layout stays the same ---------------------------

make_source() { # NAME HOLES
	local f=$DIR/$1.img layout="size=$SIZE_BYTES piece=$PIECE_BYTES holes=$2"
	if [[ -f $f && -f $f.layout && $(<"$f.layout") == "$layout" ]]; then
		say "reusing $f ($layout)"
		return
	fi
	say "writing $f ($layout)"
	python3 - "$f" "$SIZE_BYTES" "$PIECE_BYTES" "$2" <<'EOF'
import os, sys
path, size, piece, holes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.ftruncate(fd, size)
stride = 2 * piece if holes else piece
for off in range(0, size, stride):
    n = min(piece, size - off)
    os.pwrite(fd, os.urandom(n), off)
os.fsync(fd)
EOF
	echo "$layout" >"$f.layout"
}
make_source half 1
make_source rand 0

# --- one run -------------------------------------------------------------------------------

SERVER_PID=
start_server() { # FILE ro|rw
	rm -f -- "$SOCK"
	if [[ $SERVER == qemu ]]; then
		local ro=()
		[[ $2 == ro ]] && ro=(-r -e 8)
		qemu-nbd "${ro[@]}" -t -f raw --cache=none --aio=native --discard=unmap -k "$SOCK" "$1" >>"$LOG" 2>&1 &
	else
		local ro=()
		[[ $2 == ro ]] && ro=(-r)
		"$LIGHTFOOT" serve "${ro[@]}" --unix "$SOCK" "$1" >>"$LOG" 2>&1 &
	fi
	SERVER_PID=$!
	for _ in $(seq 200); do
		[[ -S $SOCK ]] && return
		sleep 0.05
	done
	die "the server did not start (see $LOG)"
}
stop_server() {
	kill "$SERVER_PID" 2>/dev/null || true
	wait "$SERVER_PID" 2>/dev/null || true
}
trap stop_server EXIT

cached() { "$LIGHTFOOT" cache stat --json "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["cached_bytes"])'; }

URI="nbd+unix:///?socket=$SOCK"
echo "round,transfer,tool,seconds,rss_kib,src_cached,dst_cached,verified,steal_pct" >"$CSV"

# shellcheck source=steal.sh
. "$HERE/steal.sh"

run() { # ROUND TRANSFER TOOL
	local round=$1 transfer=$2 tool=$3 data=${2#*-} src dst from to
	src=$DIR/$data.img
	rm -f -- "$OUT"
	if [[ $transfer == pull-* ]]; then
		start_server "$src" ro
		from=$URI to=$OUT dst=$OUT
	else
		truncate -s "$SIZE_BYTES" -- "$OUT"
		start_server "$OUT" rw
		from=$src to=$URI dst=$OUT
	fi
	sync
	echo 3 >/proc/sys/vm/drop_caches
	local cmd
	case $tool in
	# shellcheck disable=SC2086 # LIGHTFOOT_ARGS: words
	lightfoot) cmd=("$LIGHTFOOT" copy $LIGHTFOOT_ARGS "$from" "$to") ;;
	nbdcopy) cmd=(nbdcopy --flush "$from" "$to") ;;
	esac
	echo "--- $round $transfer $tool: ${cmd[*]}" >>"$LOG"
	local t0 t1 mark
	mark=$(steal_mark)
	t0=$EPOCHREALTIME
	/usr/bin/time -f "%M" -o "$DIR/time.out" "${cmd[@]}" >>"$LOG" 2>&1 || die "$tool failed on $transfer (see $LOG)"
	t1=$EPOCHREALTIME
	local steal
	steal=$(steal_pct "$mark")
	stop_server
	local sc dc
	sc=$(cached "$src")
	dc=$(cached "$dst")
	local verified=-
	if [[ $VERIFY == all || ($VERIFY == first && $round == 1) ]]; then
		cmp -s -- "$src" "$dst" && verified=yes || die "$tool: $transfer: destination differs from the source"
	fi
	local secs
	secs=$(python3 -c "print(f'{$t1 - $t0:.3f}')")
	echo "$round,$transfer,$tool,$secs,$(tail -1 "$DIR/time.out"),$sc,$dc,$verified,$steal" >>"$CSV"
	say "round $round $transfer $tool: $secs s, cached src $((sc >> 20)) MiB dst $((dc >> 20)) MiB, host steal $steal %"
}

for ((r = 1; r <= RUNS; r++)); do
	for transfer in "${TRANSFER_KEYS[@]}"; do
		# The tools in order in odd rounds, in reverse order in even ones.
		for ((i = 0; i < ${#TOOL_KEYS[@]}; i++)); do
			j=$((r % 2 ? i : ${#TOOL_KEYS[@]} - 1 - i))
			run "$r" "$transfer" "${TOOL_KEYS[$j]}"
		done
	done
done
rm -f -- "$OUT"

python3 "$HERE/summarize_nbd.py" "$CSV" "$SIZE_BYTES" "$SERVER" "$QUIET" | tee "$DIR/table-nbd.md"
