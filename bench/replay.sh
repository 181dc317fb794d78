#!/usr/bin/env bash
# replay.sh: a guest's reads without the guest. Replays the read requests a guest made (recorded
# by bench/guest.sh's `nbdkit-trace` config) against NBD servers, cold, in their order, and
# times them: the I/O a workload asks of a server, without the seconds of CPU emulation that
# make guest.sh's rounds spread by several seconds (issue 44).
#
# What it leaves out: the guest's own time between requests (read-ahead gets none here to
# work in) and, at QD=1, the guest's concurrency (its readahead keeps up to 16 requests in
# flight). So it ranks servers by what each request costs them, not by a guest's time.
#
# Each run: sync and drop the host's caches; start the server on a Unix socket; replay
# (bench/replay.py, libnbd); read the server's bytes read from storage (/proc/PID/io, less
# what it had read when it listened) and the image's pages left in the page cache; stop it.
# The servers alternate within each round, in an order that turns by one each round.
#
#   config          server
#   lightfoot       lightfoot serve $LIGHTFOOT_ARGS IMG
#   lightfoot-old   the same with the binary $LIGHTFOOT_OLD (an A/B)
#   nbdkit          nbdkit file IMG (the host page cache and its readahead)
#   qemu-none       qemu-nbd --cache=none IMG (O_DIRECT)
#   cached          nbdkit file of a copy of IMG in /dev/shm
#
# Usage (as root: it drops caches):
#     bench/replay.sh TRACE IMG [DIR]
#     ROUNDS=1 CONFIGS="lightfoot nbdkit" bench/replay.sh DIR/logs/r1-scan-nbdkit-trace.trace DIR/read.img
#
# TRACE: an nbdkit log filter's log of the guest's requests; IMG: the image it was recorded
# on (guest.sh's DIR/read.img). Environment: ROUNDS (default 5), CONFIGS (default "lightfoot
# nbdkit qemu-none cached"), QD (requests in flight, default 1), THINK_MS (depth 1: before
# each read wait as long as the guest did after the read before, up to THINK_MS; the time
# waited is left out of the seconds; default 0, no waits), BUSY (processes spinning on a
# CPU during each replay, as a TCG guest's vCPU thread does; default 0), LIGHTFOOT (default
# ../target/release/lightfoot), LIGHTFOOT_ARGS, LIGHTFOOT_OLD, DIR (default: the third
# argument, else /work/tmp/bench-replay).
#
# Output: every run in DIR/replay.csv; a table of medians with each config's ratio to nbdkit
# file's on stdout.
set -euo pipefail
export LC_ALL=C

die() { echo "replay.sh: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }

HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
[[ $EUID -eq 0 ]] || die "run as root (it drops caches)"
(($# >= 2)) || die "usage: replay.sh TRACE IMG [DIR]"
TRACE=$(realpath -- "$1")
IMG=$(realpath -- "$2")
[[ -f $TRACE ]] || die "no trace at $1"
[[ -f $IMG ]] || die "no image at $2"
ROUNDS=${ROUNDS:-5}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS: not a positive integer"
QD=${QD:-1}
[[ $QD =~ ^[1-9][0-9]*$ ]] || die "QD=$QD: not a positive integer"
THINK_MS=${THINK_MS:-0}
[[ $THINK_MS =~ ^[0-9]+$ ]] || die "THINK_MS=$THINK_MS: not a whole number of milliseconds"
((THINK_MS == 0 || QD == 1)) || die "THINK_MS needs QD=1"
BUSY=${BUSY:-0}
[[ $BUSY =~ ^[0-9]+$ ]] || die "BUSY=$BUSY: not a whole number"
CONFIGS=${CONFIGS:-lightfoot nbdkit qemu-none cached}
LIGHTFOOT=$(realpath -- "${LIGHTFOOT:-$HERE/../target/release/lightfoot}")
LIGHTFOOT_ARGS=${LIGHTFOOT_ARGS:-}
DIR=${3:-${DIR:-/work/tmp/bench-replay}}
[[ -x $LIGHTFOOT ]] || die "no lightfoot binary at $LIGHTFOOT"
read -r -a KEYS <<<"$CONFIGS"
for c in "${KEYS[@]}"; do
	case $c in
	lightfoot | nbdkit | qemu-none | cached) ;;
	lightfoot-old) [[ -x ${LIGHTFOOT_OLD:-} ]] || die "lightfoot-old needs LIGHTFOOT_OLD, a binary" ;;
	*) die "CONFIGS: unknown $c" ;;
	esac
done
for t in nbdkit qemu-nbd; do command -v "$t" >/dev/null || die "$t is missing (scripts/install-deps.sh)"; done
/usr/bin/python3 -c 'import nbd' 2>/dev/null || die "python3-libnbd is missing (scripts/install-deps.sh)"
mkdir -p -- "$DIR/logs"
DIR=$(realpath -- "$DIR")
SOCK=$DIR/nbd.sock
PIDF=$DIR/server.pid
CSV=$DIR/replay.csv
SHM=/dev/shm/lightfoot-replay.img
BUSY_PIDS=()
stop_busy() {
	((${#BUSY_PIDS[@]} == 0)) || kill -KILL "${BUSY_PIDS[@]}" 2>/dev/null || true
	BUSY_PIDS=()
}
cleanup() {
	stop_busy
	[[ -z ${SERVER_PID:-} ]] || kill -KILL "$SERVER_PID" 2>/dev/null || true
	rm -f -- "$SHM" "$SOCK" "$PIDF"
}
trap cleanup EXIT
if [[ " ${KEYS[*]} " == *" cached "* ]]; then
	avail=$(($(stat -f -c '%a * %S' /dev/shm)))
	(($(stat -c %s "$IMG") < avail)) || die "no room for a copy of $IMG in /dev/shm"
	cp -- "$IMG" "$SHM"
fi

# shellcheck source=bench/servers.sh
. "$HERE/servers.sh"

# start_server KEY LOG: the server on $SOCK; waits for its pid file.
start_server() {
	local cmd
	case $1 in
	lightfoot | lightfoot-old)
		local bin=$LIGHTFOOT
		[[ $1 == lightfoot ]] || bin=$LIGHTFOOT_OLD
		cmd=("$bin" serve --unix "$SOCK" --pid-file "$PIDF" $LIGHTFOOT_ARGS "$IMG")
		;;
	nbdkit) cmd=(nbdkit -f -U "$SOCK" -P "$PIDF" file "$IMG") ;;
	cached) cmd=(nbdkit -f -U "$SOCK" -P "$PIDF" file "$SHM") ;;
	qemu-none) cmd=(qemu-nbd -f raw -t -k "$SOCK" --pid-file="$PIDF" --cache=none "$IMG") ;;
	esac
	launch "$2" "${cmd[@]}"
}

HEADER="round,config,qd,think_ms,busy,status,seconds,reads,bytes,server_read_bytes,cache_left_bytes"
[[ -f $CSV ]] || echo "$HEADER" >"$CSV"
[[ $(head -n 1 "$CSV") == "$HEADER" ]] || die "$CSV has other columns: move it away"

say "$ROUNDS round(s) of $TRACE at depth $QD, think $THINK_MS ms, $BUSY busy: ${KEYS[*]}"
for ((r = 1; r <= ROUNDS; r++)); do
	n=${#KEYS[@]}
	for ((i = 0; i < n; i++)); do
		c=${KEYS[$(((i + r - 1) % n))]}
		sync
		echo 3 >/proc/sys/vm/drop_caches
		log=$DIR/logs/r$r-$c
		status=ok out="- - -" rb="-" left=-
		if start_server "$c" "$log.server"; then
			read -r rb0 _ <<<"$(server_usage "$SERVER_PID")"
			for ((b = 0; b < BUSY; b++)); do
				bash -c 'while :; do :; done' &
				BUSY_PIDS+=($!)
			done
			out=$(/usr/bin/python3 "$HERE/replay.py" "$SOCK" "$TRACE" "$QD" "$THINK_MS" 2>>"$log.server") || status=replay-failed
			stop_busy
			read -r rb1 _ <<<"$(server_usage "$SERVER_PID")"
			[[ $rb0 == - || $rb1 == - ]] || rb=$((rb1 - rb0))
			[[ $c == cached ]] || left=$(cached_bytes "$IMG")
			kill -TERM "$SERVER_PID" 2>/dev/null || true
			wait "$SERVER_PID" 2>/dev/null || true
		else
			status=server-failed
		fi
		SERVER_PID=""
		read -r reads bytes secs <<<"$out"
		echo "$r,$c,$QD,$THINK_MS,$BUSY,$status,$secs,$reads,$bytes,$rb,$left" >>"$CSV"
		say "round $r $c: $secs s ($status)"
	done
done

python3 - "$CSV" "$QD" "$THINK_MS" "$BUSY" <<'EOF'
import csv, statistics, sys
rows = [r for r in csv.DictReader(open(sys.argv[1]))
        if (r["qd"], r["think_ms"], r["busy"]) == tuple(sys.argv[2:5])]
configs = list(dict.fromkeys(r["config"] for r in rows))
med = lambda xs: statistics.median(xs) if xs else None
def num(v):
    try:
        return float(v)
    except ValueError:
        return None
stats = {}
for c in configs:
    ok = [r for r in rows if r["config"] == c and r["status"] == "ok"]
    stats[c] = dict(n=f"{len(ok)}/{sum(r['config'] == c for r in rows)}",
                    s=med([num(r["seconds"]) for r in ok]),
                    amp=med([num(r["server_read_bytes"]) / num(r["bytes"]) for r in ok
                             if num(r["server_read_bytes"]) is not None and num(r["bytes"])]),
                    left=med([num(r["cache_left_bytes"]) for r in ok if num(r["cache_left_bytes"]) is not None]))
base = stats.get("nbdkit", {}).get("s")
f = lambda v, spec=".2f": "-" if v is None else format(v, spec)
print(f"| server | runs ok | seconds | rel. nbdkit file | server read / replayed | cache left MiB |")
print("|---|---|---|---|---|---|")
for c, s in stats.items():
    rel = s["s"] / base if s["s"] is not None and base else None
    print(f"| {c} | {s['n']} | {f(s['s'], '.3f')} | {f(rel)} | {f(s['amp'])} | "
          f"{f(s['left'] / 2**20 if s['left'] is not None else None, '.1f')} |")
print(f"\nMedians; depth {sys.argv[2]}, think up to {sys.argv[3]} ms (left out of the seconds), "
      f"{sys.argv[4]} busy CPU(s); rounds with the servers alternating.")
EOF
