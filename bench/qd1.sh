#!/usr/bin/env bash
# qd1.sh: a guest's simplest pattern without a guest: one stream of 128 KiB sequential reads at
# queue depth 1, cold (fio's nbd engine), from a local file and from object storage (issue 44).
#
# The data: SIZE bytes of random data (DIR/src.img, made once), of which fio reads the first
# READ bytes. Before each run: sync, drop the host's caches, start the server on a Unix socket;
# then `fio --ioengine=nbd --rw=read --bs=128k --iodepth=1 --size=READ`; stop the server. The
# servers alternate within each round, in an order that turns by one each round.
#
#   config              server
#   lightfoot           lightfoot serve FILE (neutral: O_DIRECT or DONTCACHE reads; its own
#                       read-ahead on by default since issue 44, none before)
#   lightfoot-prefetch  lightfoot serve --prefetch FILE
#   lightfoot-plain     lightfoot serve --no-prefetch FILE (no read-ahead; a binary from before
#                       issue 44 takes no such flag)
#   nbdkit              nbdkit file FILE (the host page cache and its readahead)
#   qemu-none           qemu-nbd --cache=none FILE (O_DIRECT)
#   lightfoot-s3        lightfoot serve -r $LIGHTFOOT_S3_ARGS s3://bench/qd1.img (default
#                       --prefetch): FILE uploaded once as
#                       one object to a SeaweedFS on loopback (bench/store.sh), no added latency
#   lightfoot-s3-old    the same with the binary $LIGHTFOOT_OLD (an A/B over object storage)
#
# Usage (as root: it drops caches):
#     bench/qd1.sh [DIR]
#     ROUNDS=1 CONFIGS="lightfoot nbdkit" bench/qd1.sh       # smoke test
#
# Environment: ROUNDS (default 5), SIZE (default 512M), READ (default 256M), CONFIGS (default
# all above but lightfoot-s3-old), LIGHTFOOT_S3_ARGS, LIGHTFOOT (default
# ../target/release/lightfoot), LIGHTFOOT_OLD (for lightfoot-s3-old), DIR (default: the argument, else
# /work/tmp/bench-qd1).
#
# Output: MiB/s per run in DIR/qd1.csv (lightfoot's `--stats --json` in DIR/logs/*.server); a table of medians with each config's ratio to nbdkit
# file's, and lightfoot-s3's to the local rate: the median of the lightfoot and
# lightfoot-prefetch runs together (one server since read-ahead became the default), on stdout.
set -euo pipefail
export LC_ALL=C

die() { echo "qd1.sh: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }

HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
[[ $EUID -eq 0 ]] || die "run as root (it drops caches)"
ROUNDS=${ROUNDS:-5}
SIZE=${SIZE:-512M}
READ=${READ:-256M}
CONFIGS=${CONFIGS:-lightfoot lightfoot-prefetch nbdkit qemu-none lightfoot-s3}
LIGHTFOOT_S3_ARGS=${LIGHTFOOT_S3_ARGS---prefetch}
LIGHTFOOT=$(realpath -- "${LIGHTFOOT:-$HERE/../target/release/lightfoot}")
DIR=${1:-${DIR:-/work/tmp/bench-qd1}}
[[ -x $LIGHTFOOT ]] || die "no lightfoot binary at $LIGHTFOOT"
for t in fio nbdkit qemu-nbd; do command -v "$t" >/dev/null || die "$t is missing (scripts/install-deps.sh)"; done
mkdir -p -- "$DIR/logs"
DIR=$(realpath -- "$DIR")
SRC=$DIR/src.img
SOCK=$DIR/nbd.sock
PIDF=$DIR/server.pid
CSV=$DIR/qd1.csv
BUCKET=bench
UTIL=(/usr/bin/python3 "$HERE/s3_util.py")
read -r -a KEYS <<<"$CONFIGS"

if [[ ! -f $SRC || $(stat -c %s "$SRC") != $(numfmt --from=iec "$SIZE") ]]; then
	say "writing $SRC: $SIZE of random data"
	head -c "$(numfmt --from=iec "$SIZE")" /dev/urandom >"$SRC"
fi

SERVER_PID=""
STORE=0
[[ " ${KEYS[*]} " == *" lightfoot-s3"* ]] && STORE=1
[[ " ${KEYS[*]} " != *" lightfoot-s3-old "* || -x ${LIGHTFOOT_OLD:-} ]] ||
	die "lightfoot-s3-old needs LIGHTFOOT_OLD, a binary"
cleanup() {
	[[ -z $SERVER_PID ]] || kill -KILL "$SERVER_PID" 2>/dev/null || true
	((STORE == 0)) || store_stop
	rm -f -- "$SOCK" "$PIDF"
}
trap cleanup EXIT
if ((STORE)); then
	# shellcheck source=bench/store.sh
	. "$HERE/store.sh"
	store_start 0
	store_latency 0
	"$LIGHTFOOT" copy "$SRC" "s3://$BUCKET/qd1.img" >"$DIR/logs/upload.log" 2>&1 || die "upload failed"
fi

start() { # KEY LOG
	local lf=("$LIGHTFOOT" serve --unix "$SOCK" --pid-file "$PIDF" --stats --json)
	local cmd
	case $1 in
	lightfoot) cmd=("${lf[@]}" "$SRC") ;;
	lightfoot-prefetch) cmd=("${lf[@]}" --prefetch "$SRC") ;;
	lightfoot-plain) cmd=("${lf[@]}" --no-prefetch "$SRC") ;;
	nbdkit) cmd=(nbdkit -f -U "$SOCK" -P "$PIDF" file "$SRC") ;;
	qemu-none) cmd=(qemu-nbd -f raw -t -k "$SOCK" --pid-file="$PIDF" --cache=none "$SRC") ;;
	lightfoot-s3) cmd=("${lf[@]}" -r $LIGHTFOOT_S3_ARGS "s3://$BUCKET/qd1.img") ;;
	lightfoot-s3-old) cmd=("$LIGHTFOOT_OLD" "${lf[@]:1}" -r $LIGHTFOOT_S3_ARGS "s3://$BUCKET/qd1.img") ;;
	*) die "CONFIGS: unknown $1" ;;
	esac
	rm -f -- "$SOCK" "$PIDF"
	echo "+ ${cmd[*]}" >"$2"
	"${cmd[@]}" >>"$2" 2>&1 &
	SERVER_PID=$!
	local i
	for ((i = 0; i < 200; i++)); do
		[[ -S $SOCK && -s $PIDF ]] && return 0
		sleep 0.05
	done
	die "$1 did not start (see $2)"
}

[[ -f $CSV ]] || echo "round,config,mib_s" >"$CSV"
for ((r = 1; r <= ROUNDS; r++)); do
	n=${#KEYS[@]}
	for ((i = 0; i < n; i++)); do
		c=${KEYS[$(((i + r - 1) % n))]}
		sync
		echo 3 >/proc/sys/vm/drop_caches
		start "$c" "$DIR/logs/r$r-$c.server"
		fio --name=qd1 --ioengine=nbd --uri="nbd+unix:///?socket=$SOCK" --rw=read --bs=128k --iodepth=1 \
			--size="$READ" --output-format=json --output="$DIR/logs/r$r-$c.json" >/dev/null
		kill -TERM "$SERVER_PID"
		wait "$SERVER_PID" 2>/dev/null || true
		SERVER_PID=""
		rate=$("${UTIL[@]}" fio "$DIR/logs/r$r-$c.json" read | cut -d' ' -f2)
		echo "$r,$c,$rate" >>"$CSV"
		printf '   round %d  %-20s %8.1f MiB/s\n' "$r" "$c" "$rate" >&2
	done
done

python3 - "$CSV" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
by = {}
for r in rows:
    by.setdefault(r["config"], []).append(float(r["mib_s"]))
med = {c: statistics.median(v) for c, v in by.items()}
# The default server and --prefetch are one server since read-ahead became the default: their
# runs together are the local rate (the order within a round moved each one's median by 20 %).
local = by.get("lightfoot", []) + by.get("lightfoot-prefetch", [])
if local:
    med["local"] = statistics.median(local)
print("| server | runs | MiB/s (median) | min-max | rel. nbdkit file | rel. local lightfoot (default and --prefetch pooled) |")
print("|---|---|---|---|---|---|")
for c, v in by.items():
    rel = lambda b: f"{med[c] / med[b]:.2f}" if b in med else "-"
    print(f"| {c} | {len(v)} | {med[c]:.1f} | {min(v):.0f}-{max(v):.0f} | {rel('nbdkit')} | "
          f"{rel('local') if c.startswith('lightfoot-s3') else '-'} |")
if local:
    print(f"\nlocal rate: {med['local']:.1f} MiB/s, the median of {len(local)} runs of lightfoot and lightfoot-prefetch")
EOF
