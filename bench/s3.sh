#!/usr/bin/env bash
# s3.sh: lightfoot on object storage against its peers, on one store, in the same run
# (issue 29): `lightfoot serve s3://…` against nbdkit's S3 plugin, and `lightfoot copy` to and
# from s3:// against `rclone copyto` and `aws s3 cp`.
#
# The store is SeaweedFS (`weed server -s3`: master, volume, filer and S3 gateway in one
# process; scripts/build-seaweedfs.sh) on loopback ports of its own, in DIR/weed, started
# afresh by this script and killed at its exit. Latency is added by Toxiproxy
# (scripts/build-toxiproxy.sh), a userspace TCP proxy on loopback (this kernel has no netem):
# a "latency" toxic on the downstream (every response is held LATENCY ms, jitter 0). At
# latency 0 the clients talk to the store directly, without the proxy. Before each latency's
# jobs, in every round, HEADS HEAD requests (curl, a new connection each) on a 1-byte object
# check it: the median through the endpoint in use and directly is printed and recorded.
#
# The image: SIZE bytes of random data (DIR/src.img, made once and reused), written into the
# store before the rounds (directly, by `lightfoot copy`) as block objects of 64 KiB, the
# largest object nbdkit's plugin takes, at s3://bench/data-64K, and of lightfoot's own object
# size BEST at s3://bench/data-BEST. Both servers read and write the same objects: the layout
# is nbdkit's (KEY/%016x); lightfoot's manifest KEY/lightfoot.json is invisible to nbdkit.
# For nbdcopy also as one object (the other layout, read-only for both servers), at
# s3://bench/data-one (written by `lightfoot copy` without --object-size: a multipart upload).
#
# The jobs (JOBS), each run by every configuration below, one after the other:
#   nbdcopy    `nbdcopy URI null:`: the whole image read sequentially (nbdcopy's defaults:
#              multi-conn, 256 KiB requests). Read-only servers (-r). Figure: MiB/s.
#   seqread    4 KiB sequential readers: fio, nbd engine, 4 jobs x iodepth 1, each reading its
#              quarter of the image, RUNTIME seconds (time_based). Read-only servers. MiB/s.
#   randwrite  random 4 KiB writes over the whole image: fio, 4 jobs x iodepth 1, a FLUSH every
#              64 writes per job and at the end (--fsync=64 --end_fsync=1), RUNTIME seconds,
#              into the image of random data (so a partial write of an object is a
#              read-modify-write for both servers). Figure: IOPS, and the store's GETs and PUTs
#              per client write.
#   trim       one TRIM of the whole device (libnbd, then FLUSH) on a fully written image:
#              s3://bench/trim-64K (or trim-BEST) is written afresh by `lightfoot copy` before
#              each run, untimed. Figure: seconds; the block objects left are counted (0 is
#              right).
#   copy       `lightfoot copy src.img s3://bench/up-lightfoot` and back into DIR/dst.img,
#              against `rclone copyto` and `aws s3 cp`, each timed (GNU time: peak RSS, CPU),
#              with the page cache the local file is left with measured right after
#              (`lightfoot cache stat`), after evicting it before each run
#              (`lightfoot cache evict`). Uploads first (the destination object deleted
#              before each, untimed), then downloads (dst.img removed before each). Figure:
#              MiB/s. Downloads of rclone and aws-cli end with `sync dst.img` inside the
#              timing (they do not flush; lightfoot's copy is durable by itself), as
#              bench/copy.sh does for cp.
#
# Configurations:
#   lightfoot 64K [--prefetch|--coalesce]
#                  lightfoot serve --stats --json s3://bench/data-64K --object-size 64K
#                  --size SIZE (defaults otherwise: 4 threads per connection); --prefetch in
#                  seqread, --coalesce in randwrite, each also without
#   lightfoot BEST [--prefetch|--coalesce]
#                  the same at lightfoot's own object size BEST (s3://bench/data-BEST)
#   lightfoot one object
#                  nbdcopy only: lightfoot serve -r --stats --json s3://bench/data-one (one
#                  object: range GETs pinned to its ETag)
#   nbdkit S3      nbdkit -f S3 endpoint-url=… access-key=… secret-key=… bucket=bench key=…
#                  size=SIZE object-size=64K (nbdkit 1.32's defaults: 16 threads); in seqread
#                  and randwrite with --filter=blocksize in front: the plugin advertises its
#                  object size as the minimum block size, so a libnbd client cannot send 4 KiB
#                  requests without it (the filter turns them into 64 KiB reads and
#                  read-modify-writes, as nbdkit's users run it). nbdcopy and trim need no filter.
#   nbdkit S3 one object
#                  nbdcopy only: the same plugin without size= and object-size=, key=data-one
#                  (one object: a range GET per request)
#   lightfoot copy lightfoot copy --json SRC s3://bench/up-lightfoot: one object (a multipart
#                  upload), as the peers write; back: lightfoot copy --json
#                  s3://bench/up-lightfoot dst.img. ONE_OBJECT=0 uploads block objects instead
#                  (--object-size COPY_OBJECT_SIZE, 8M: for a binary older than lightfoot's
#                  multipart upload), and the downloads then also have "lightfoot (one
#                  object)": lightfoot reading the object aws-cli (else rclone) uploaded.
#   rclone         rclone copyto src.img s3bench:bench/up-rclone and back; an s3 remote from the
#                  environment (RCLONE_CONFIG_S3BENCH_*: provider Other, endpoint, path style,
#                  keys), rclone's defaults: one PUT below 200 MiB (--s3-upload-cutoff), else
#                  multipart in 5 MiB parts (--s3-chunk-size), 4 at once
#                  (--s3-upload-concurrency); downloads above 250 MiB in 4 streams
#                  (--multi-thread-cutoff, --multi-thread-streams). Debian's rclone.
#   aws s3 cp      /usr/bin/aws --endpoint-url ENDPOINT s3 cp --no-progress src.img
#                  s3://bench/up-aws and back: Debian's aws-cli 2 (it ignores
#                  AWS_ENDPOINT_URL), default transfer settings (multipart above 8 MiB in 8 MiB
#                  parts, 10 requests at once).
#
# Same run, alternating: rounds are the outer loop; each round runs, for each latency, every
# job with every configuration, in order in odd rounds and in reverse order in even ones (for
# copy: among the uploads, then among the downloads). A fresh server per NBD run, started
# before the clock and stopped after it.
#
# Requests: SeaweedFS's own counters (its Prometheus endpoint, -metricsPort) are read before
# and after each run (after the server stopped), for every tool alike: GET (the store counts
# HEAD as GET), PUT (a multipart part is a PUT), DELETE (a multi-object delete is one), LIST.
# They include, for a writable lightfoot, its lease (KEY/lightfoot.lease): a PUT every 10 s to
# renew it and a DELETE at exit to release it.
# lightfoot's own counts come from `serve --stats --json` (field "s3") and `copy --json`
# ("requests"), printed as n/a by a binary without them.
#
# Usage (not as a measurement while anything else runs: 2 cores are easily disturbed):
#     bench/s3.sh [DIR]
#     SIZE=32M ROUNDS=1 RUNTIME=3 bench/s3.sh                 # smoke test, a few minutes
#     JOBS="seqread randwrite" LATENCIES=10 bench/s3.sh        # a subset
#
# Environment:
#     SIZE        the image (default 1G; K, M, G): a multiple of 64K and of BEST
#     ROUNDS      rounds (default 5)
#     LATENCIES   added response latencies in ms (default "0 10"; 0: direct, no proxy; 0p:
#                 through Toxiproxy with nothing added, which measures the proxy hop itself)
#     JOBS        subset of "nbdcopy seqread randwrite trim copy" (the default: all)
#     RUNTIME     seconds per fio run (default 30)
#     BEST        lightfoot's own object size for the lightfoot BEST configurations
#                 (default 1M; empty or 64K: none)
#     COPY_OBJECT_SIZE  lightfoot copy's --object-size for uploads with ONE_OBJECT=0 (default 8M)
#     ONE_OBJECT  1 (default): lightfoot copy uploads one object; 0: block objects of
#                 COPY_OBJECT_SIZE
#     HEADS       HEAD requests per latency check (default 30)
#     VERIFY      first (default): cmp every download with the source in round 1; all; none
#     DIR         work directory (default: the argument, else /work/tmp/bench-s3); needs
#                 about 12 x SIZE free: the source, the download, the images and uploads in
#                 the store (about 7 x SIZE), and what one run leaves as garbage in the store's
#                 volumes (up to about 3 x SIZE: the overwritten objects of randwrite), which
#                 is vacuumed after every run, untimed
#     LIGHTFOOT   the binary (default ../target/release/lightfoot beside this script)
#     WEED, TOXIPROXY  binaries to use instead of the cached builds
#
# Output: per latency and job, a table of medians (figure, lightfoot / peer per round and its
# median, requests, RSS, CPU, page cache, host steal) on stdout and in DIR/table-s3.md
# (bench/summarize_s3.py redoes it from DIR/s3.csv), every run in DIR/s3.csv, logs in
# DIR/logs/. As everywhere here, only ratios within one run mean anything. Exit status 1 if a
# run failed (marked !!! and left out of the medians).
set -euo pipefail
export LC_ALL=C

die() { echo "s3.sh: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }

HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
(($# <= 1)) || die "usage: s3.sh [DIR]"

SIZE=${SIZE:-1G}
ROUNDS=${ROUNDS:-5}
LATENCIES=${LATENCIES:-0 10}
JOBS=${JOBS:-nbdcopy seqread randwrite trim copy}
RUNTIME=${RUNTIME:-30}
BEST=${BEST-1M}
COPY_OBJECT_SIZE=${COPY_OBJECT_SIZE:-8M}
ONE_OBJECT=${ONE_OBJECT:-1}
HEADS=${HEADS:-30}
VERIFY=${VERIFY:-first}
DIR=${DIR:-${1:-/work/tmp/bench-s3}}
LIGHTFOOT=${LIGHTFOOT:-$HERE/../target/release/lightfoot}

PEER_OBJECT=64K   # nbdkit's S3 plugin: at most 64 KiB objects
FIO_JOBS=4
FSYNC=64
BUCKET=bench
SYSPY=/usr/bin/python3   # Debian's: libnbd's and boto3's Python modules
UTIL=("$SYSPY" "$HERE/s3_util.py")
AWS=/usr/bin/aws         # Debian's aws-cli 2 (a pyenv shim may come first in PATH)

to_bytes() { numfmt --from=iec -- "$1" 2>/dev/null || die "$2=$1: not a size"; }
SIZE_BYTES=$(to_bytes "$SIZE" SIZE)
PEER_BYTES=$(to_bytes "$PEER_OBJECT" PEER_OBJECT)
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS: not a positive integer"
[[ $RUNTIME =~ ^[1-9][0-9]*$ ]] || die "RUNTIME=$RUNTIME: not a positive integer"
[[ $HEADS =~ ^[1-9][0-9]*$ ]] || die "HEADS=$HEADS: not a positive integer"
[[ $ONE_OBJECT == 0 || $ONE_OBJECT == 1 ]] || die "ONE_OBJECT=$ONE_OBJECT: 0 or 1"
[[ $VERIFY == first || $VERIFY == all || $VERIFY == none ]] || die "VERIFY=$VERIFY: first, all or none"
((SIZE_BYTES % PEER_BYTES == 0)) || die "SIZE=$SIZE: not a multiple of $PEER_OBJECT"
((SIZE_BYTES % (FIO_JOBS * 4096) == 0)) || die "SIZE=$SIZE: not a multiple of $((FIO_JOBS * 4))K"
BEST_BYTES=""
if [[ -n $BEST ]]; then
	BEST_BYTES=$(to_bytes "$BEST" BEST)
	((SIZE_BYTES % BEST_BYTES == 0)) || die "SIZE=$SIZE: not a multiple of BEST=$BEST"
	((BEST_BYTES != PEER_BYTES)) || BEST_BYTES=""
fi
read -r -a LATENCY_LIST <<<"${LATENCIES//,/ }"
((${#LATENCY_LIST[@]})) || die "LATENCIES: empty"
for l in "${LATENCY_LIST[@]}"; do [[ $l =~ ^[0-9]+p?$ ]] || die "LATENCIES: $l is not a number of ms (or 0p)"; done
read -r -a JOB_LIST <<<"${JOBS//,/ }"
((${#JOB_LIST[@]})) || die "JOBS: empty"
for j in "${JOB_LIST[@]}"; do
	[[ $j =~ ^(nbdcopy|seqread|randwrite|trim|copy)$ ]] || die "JOBS: unknown $j (nbdcopy seqread randwrite trim copy)"
done

[[ -x $LIGHTFOOT ]] || die "no lightfoot binary at $LIGHTFOOT (cargo build --release, or set LIGHTFOOT=)"
LIGHTFOOT=$(realpath -- "$LIGHTFOOT")
for t in fio nbdcopy nbdkit curl python3 numfmt /usr/bin/time "$SYSPY"; do
	command -v "$t" >/dev/null || die "$t is needed (make deps)"
done
nbdkit S3 --version >/dev/null 2>&1 || die "nbdkit's S3 plugin is needed (nbdkit-plugin-python, python3-boto3)"
"$SYSPY" -c 'import nbd, boto3' 2>/dev/null || die "$SYSPY needs python3-libnbd and python3-boto3"
MISSING=()
command -v rclone >/dev/null || MISSING+=(rclone)
[[ -x $AWS ]] || MISSING+=(aws)
for m in "${MISSING[@]}"; do say "MISSING: $m (its copy runs are skipped)"; done
have() { [[ " ${MISSING[*]} " != *" $1 "* ]]; }

NEED_PROXY=0
for l in "${LATENCY_LIST[@]}"; do [[ $l == 0 ]] || NEED_PROXY=1; done
# shellcheck source=bench/store.sh
. "$HERE/store.sh"

mkdir -p -- "$DIR/logs"
DIR=$(realpath -- "$DIR")
exec 9>"$DIR/.lock"
flock -n 9 || die "another s3.sh is running in $DIR"
SRC=$DIR/src.img
DST=$DIR/dst.img
SOCK=$DIR/nbd.sock
PIDF=$DIR/server.pid
CSV=$DIR/s3.csv
URI="nbd+unix:///?socket=$SOCK"
((${#SOCK} < 100)) || die "$SOCK: too long for a Unix socket path"
rm -f -- "$DIR"/logs/*
need=$((12 * SIZE_BYTES))
avail=$(($(df --output=avail -B1 -- "$DIR" | tail -n 1)))
((avail > need)) || die "$DIR: $((avail >> 20)) MiB free, needs about $((need >> 20)) MiB"

# rclone's remote (the AWS keys are store.sh's); its endpoint is set per latency.
export RCLONE_CONFIG=/dev/null RCLONE_CONFIG_S3BENCH_TYPE=s3 RCLONE_CONFIG_S3BENCH_PROVIDER=Other
export RCLONE_CONFIG_S3BENCH_ACCESS_KEY_ID=$AWS_ACCESS_KEY_ID
export RCLONE_CONFIG_S3BENCH_SECRET_ACCESS_KEY=$AWS_SECRET_ACCESS_KEY
export RCLONE_CONFIG_S3BENCH_REGION=$AWS_REGION RCLONE_CONFIG_S3BENCH_FORCE_PATH_STYLE=true

# --- the store and the proxy ------------------------------------------------------------------

SERVER_PID="" REAL_PID=""
stop_pid() { # PID SECONDS: SIGTERM, then SIGKILL after SECONDS
	local pid=$1 i
	[[ -n $pid ]] || return 0
	kill -TERM "$pid" 2>/dev/null || true
	for ((i = 0; i < $2 * 10; i++)); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	kill -KILL "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
}
# shellcheck disable=SC2317 # the EXIT trap
cleanup() {
	[[ -z $REAL_PID ]] || kill -KILL "$REAL_PID" 2>/dev/null || true
	[[ -z $SERVER_PID ]] || stop_pid "$SERVER_PID" 5
	store_stop
	rm -rf -- "$SOCK" "$PIDF"
}
trap cleanup EXIT

store_start "$NEED_PROXY"
set_latency() { # MS (0: directly; 0p: through the proxy, nothing added)
	store_latency "$1"
	export RCLONE_CONFIG_S3BENCH_ENDPOINT=$ENDPOINT
}
set_latency 0

head_median() { # URL: median seconds of HEADS HEAD requests
	local i t=()
	for ((i = 0; i < HEADS; i++)); do
		t+=("$(curl -s -o /dev/null -I -w '%{time_total}' "$1/$BUCKET/probe")")
	done
	"${UTIL[@]}" median "${t[@]}"
}

# --- data --------------------------------------------------------------------------------

if [[ -f $SRC && -f $SRC.layout && $(<"$SRC.layout") == "size=$SIZE_BYTES random" ]]; then
	say "reusing $SRC ($SIZE of random data)"
else
	say "writing $SRC: $SIZE of random data"
	rm -f -- "$SRC" "$SRC.layout"
	dd if=/dev/urandom of="$SRC" bs=1M iflag=fullblock,count_bytes count="$SIZE_BYTES" status=none
	sync -- "$SRC"
	echo "size=$SIZE_BYTES random" >"$SRC.layout"
fi

# write_image KEY OBJECT_SIZE: SRC into s3://bench/KEY as block objects, directly (untimed);
# OBJECT_SIZE "one": as one object.
write_image() {
	local os=(--object-size "$2")
	[[ $2 != one ]] || os=()
	AWS_ENDPOINT_URL=$DIRECT "$LIGHTFOOT" copy "$SRC" "s3://$BUCKET/$1" "${os[@]}" \
		>>"$DIR/logs/setup.log" 2>&1 || die "could not write s3://$BUCKET/$1 (see $DIR/logs/setup.log)"
}
# The one-object image only when nbdcopy runs.
NEED_ONE=""
[[ " $JOBS " != *" nbdcopy "* ]] || NEED_ONE=1
say "writing the images into the store (64K objects${BEST_BYTES:+, $BEST objects}${NEED_ONE:+, one object})"
write_image "data-$PEER_OBJECT" "$PEER_OBJECT"
[[ -z $BEST_BYTES ]] || write_image "data-$BEST" "$BEST"
[[ -z $NEED_ONE ]] || write_image data-one one

# The store's volumes keep overwritten and deleted objects until vacuumed: after every run,
# untimed (the master answers when the compaction is done).
vacuum() { curl -s -o /dev/null --max-time 600 "http://127.0.0.1:$P_MASTER/vol/vacuum?garbageThreshold=0.05" || true; }

# --- configurations ----------------------------------------------------------------------

# Keys: lf-SIZE[-prefetch|-coalesce] (lightfoot serve at object size SIZE), lf-one and
# nbdkit-one (one object), nbdkit,
# nbdkit-bs (with the blocksize filter); for copy: lightfoot, lightfoot-object, rclone, aws.
configs_of() { # JOB: the configuration keys, in order
	local p=lf-$PEER_OBJECT b=""
	[[ -z $BEST_BYTES ]] || b=lf-$BEST
	case $1 in
	nbdcopy) echo "$p" ${b:+"$b"} nbdkit lf-one nbdkit-one ;;
	trim) echo "$p" ${b:+"$b"} nbdkit ;;
	seqread) echo "$p" "$p-prefetch" ${b:+"$b" "$b-prefetch"} nbdkit-bs ;;
	randwrite) echo "$p" "$p-coalesce" ${b:+"$b" "$b-coalesce"} nbdkit-bs ;;
	copy-up)
		echo lightfoot
		have rclone && echo rclone
		have aws && echo aws
		;;
	copy-down)
		echo lightfoot
		if ((ONE_OBJECT == 0)) && { have aws || have rclone; }; then echo lightfoot-object; fi
		have rclone && echo rclone
		have aws && echo aws
		;;
	esac
}

config_name() {
	case $1 in
	lf-one) echo "lightfoot one object" ;;
	lf-*-prefetch | lf-*-coalesce) echo "lightfoot $(object_of "$1") --${1##*-}" ;;
	lf-*) echo "lightfoot $(object_of "$1")" ;;
	nbdkit) echo "nbdkit S3 $PEER_OBJECT" ;;
	nbdkit-one) echo "nbdkit S3 one object" ;;
	nbdkit-bs) echo "nbdkit S3 $PEER_OBJECT + blocksize" ;;
	lightfoot) echo "lightfoot copy" ;;
	lightfoot-object) echo "lightfoot copy (one object)" ;;
	rclone) echo "rclone copyto" ;;
	aws) echo "aws s3 cp" ;;
	esac
}

object_of() { # CONFIG: its object size ("one": one object)
	local s=${1#lf-}
	if [[ $1 == *-one ]]; then echo one; elif [[ $1 == lf-* ]]; then echo "${s%%-*}"; else echo "$PEER_OBJECT"; fi
}

# server_cmd CONFIG JOB KEY: the server's command line in SCMD.
server_cmd() {
	local ro=() os
	[[ $2 == nbdcopy || $2 == seqread ]] && ro=(-r)
	os=$(object_of "$1")
	case $1 in
	lf-*)
		local extra=()
		[[ $1 == *-prefetch ]] && extra=(--prefetch)
		[[ $1 == *-coalesce ]] && extra=(--coalesce)
		local geometry=(--object-size "$os" --size "$SIZE_BYTES")
		[[ $os != one ]] || geometry=()
		SCMD=("$LIGHTFOOT" serve --unix "$SOCK" --pid-file "$PIDF" --stats --json "${ro[@]}" "${extra[@]}"
			"s3://$BUCKET/$3" "${geometry[@]}")
		;;
	nbdkit*)
		local filter=()
		[[ $1 == nbdkit-bs ]] && filter=(--filter=blocksize)
		local geometry=("size=$SIZE_BYTES" "object-size=$os")
		[[ $os != one ]] || geometry=()
		SCMD=(nbdkit -f -U "$SOCK" -P "$PIDF" "${ro[@]}" "${filter[@]}" S3 "endpoint-url=$ENDPOINT"
			"access-key=$AWS_ACCESS_KEY_ID" "secret-key=$AWS_SECRET_ACCESS_KEY" "bucket=$BUCKET"
			"key=$3" "${geometry[@]}")
		;;
	esac
}

client_cmd() { # JOB FIO_OUT ALIGN
	local fio=(fio --name="$1" --ioengine=nbd --uri="$URI" --numjobs="$FIO_JOBS" --iodepth=1 --bs=4k
		--runtime="$RUNTIME" --time_based --group_reporting --eta=never --output-format=json --output="$2")
	local quarter=$((SIZE_BYTES / FIO_JOBS))
	case $1 in
	nbdcopy) CMD=(nbdcopy "$URI" null:) ;;
	seqread) CMD=("${fio[@]}" --rw=read --size="$quarter" --offset_increment="$quarter") ;;
	randwrite) CMD=("${fio[@]}" --rw=randwrite --fsync="$FSYNC" --end_fsync=1) ;;
	trim) CMD=("${UTIL[@]}" trim "$URI" "$3") ;;
	esac
}

start_server() { # LOG
	rm -f -- "$SOCK" "$PIDF" "$DIR/server.time"
	echo "+ ${SCMD[*]}" >"$1"
	/usr/bin/time -f "%M %U %S" -o "$DIR/server.time" "${SCMD[@]}" >>"$1" 2>&1 &
	SERVER_PID=$!
	REAL_PID=""
	local i
	for ((i = 0; i < 1200; i++)); do
		if [[ -S $SOCK && -s $PIDF ]]; then
			REAL_PID=$(<"$PIDF")
			return 0
		fi
		kill -0 "$SERVER_PID" 2>/dev/null || return 1
		sleep 0.05
	done
	return 1
}

stop_server() {
	[[ -n $SERVER_PID ]] || return 0
	# SIGTERM to the server alone: GNU time, its parent, then writes its figures and exits.
	# --coalesce writes back what it holds at exit: up to 120 s.
	[[ -z $REAL_PID ]] || kill -TERM "$REAL_PID" 2>/dev/null || true
	local i
	for ((i = 0; i < 1200; i++)); do
		kill -0 "$SERVER_PID" 2>/dev/null || break
		sleep 0.1
	done
	[[ -z $REAL_PID ]] || kill -KILL "$REAL_PID" 2>/dev/null || true
	stop_pid "$SERVER_PID" 5
	SERVER_PID="" REAL_PID=""
	rm -f -- "$SOCK" "$PIDF"
}

# --- runs ----------------------------------------------------------------------------------

FAILED=0
COLS="round,latency_ms,job,config,ok,seconds,rate,unit,ops,get,put,delete,list,other"
COLS+=",lf_get,lf_put,lf_delete,lf_list,lf_head,rss_kib,cpu_s,cached_bytes,dirty_bytes,left_objects,verified,steal_pct,error"
echo "$COLS" >"$CSV"

# shellcheck source=steal.sh
. "$HERE/steal.sh"

cache_of() { # FILE: "cached dirty" bytes
	"$LIGHTFOOT" cache stat --json "$1" | python3 -c 'import json,sys; s=json.load(sys.stdin)[0]; print(s["cached_bytes"], s["stat"]["dirty"] * s["page_size"])'
}
time_of() { # GNU time's "%M %U %S" file: "rss_kib cpu_s"
	awk 'NF == 3 && $1 ~ /^[0-9]+$/ { m = $1; c = $2 + $3; ok = 1 } END { if (ok) printf "%s %.2f\n", m, c }' "$1"
}
secs() { python3 -c "print(f'{$2 - $1:.3f}')"; }

# record COLUMN=VALUE...: one CSV row; columns not named are empty. "req=G P D L O" and
# "lf=G P D L H" fill the store's and lightfoot's request counts.
record() {
	local -A v
	local kv col out="" a
	for kv; do
		case $kv in
		req=*)
			read -r -a a <<<"${kv#req=}"
			v[get]=${a[0]:-} v[put]=${a[1]:-} v[delete]=${a[2]:-} v[list]=${a[3]:-} v[other]=${a[4]:-}
			;;
		lf=*)
			read -r -a a <<<"${kv#lf=}"
			[[ ${a[0]:-n/a} != n/a ]] || a=(n/a n/a n/a n/a n/a)
			v[lf_get]=${a[0]} v[lf_put]=${a[1]} v[lf_delete]=${a[2]} v[lf_list]=${a[3]} v[lf_head]=${a[4]}
			;;
		*) v[${kv%%=*}]=${kv#*=} ;;
		esac
	done
	for col in ${COLS//,/ }; do
		out+=${v[$col]:-},
	done
	out=${out%,}
	echo "${out//$'\n'/ }" >>"$CSV"
}

run_nbd() { # ROUND LATENCY JOB CONFIG
	local round=$1 lat=$2 job=$3 c=$4 base key os align err=""
	base=$DIR/logs/r$1-${2}ms-$3-$4
	os=$(object_of "$c")
	align=$SIZE_BYTES
	[[ $os == one ]] || align=$(to_bytes "$os" object)
	if [[ $job == trim ]]; then
		key=trim-$os
		write_image "$key" "$os"
	else
		key=data-$os
	fi
	server_cmd "$c" "$job" "$key"
	client_cmd "$job" "$base.fio" "$align"
	if ! start_server "$base.server"; then
		stop_server
		record round="$round" latency_ms="$lat" job="$job" config="$c" ok=0 error="server did not start"
		say "!!! round $round ${lat} ms $job $(config_name "$c"): the server did not start (see $base.server)"
		FAILED=1
		return
	fi
	local m0 m1 mark t0 t1 steal
	m0=$("${UTIL[@]}" metrics "$METRICS" "$BUCKET")
	echo "+ ${CMD[*]}" >"$base.client"
	mark=$(steal_mark)
	t0=$EPOCHREALTIME
	timeout $((RUNTIME * 3 + 3600)) "${CMD[@]}" >>"$base.client" 2>&1 || err="client failed"
	t1=$EPOCHREALTIME
	steal=$(steal_pct "$mark")
	stop_server
	m1=$("${UTIL[@]}" metrics "$METRICS" "$BUCKET")
	local seconds rate="" unit="" ops="" req lf rss cpu left="" mib iops
	seconds=$(secs "$t0" "$t1")
	case $job in
	nbdcopy)
		unit=MiB/s
		rate=$(python3 -c "print(f'{$SIZE_BYTES / 2**20 / $seconds:.3f}')")
		;;
	seqread | randwrite)
		local rw=read f
		[[ $job == randwrite ]] && rw="write"
		if [[ -z $err ]] && f=$("${UTIL[@]}" fio "$base.fio" "$rw" 2>>"$base.client"); then
			read -r ops mib iops <<<"$f"
			if [[ $job == seqread ]]; then rate=$mib unit=MiB/s; else rate=$iops unit=IOPS; fi
		else
			err=${err:-"no fio output"}
		fi
		;;
	trim)
		unit=s
		left=$("${UTIL[@]}" blocks "$DIRECT" "$BUCKET" "$key")
		((left == 0)) || err=${err:-"$left objects left"}
		;;
	esac
	req=$("${UTIL[@]}" delta "$m0" "$m1")
	lf="n/a"
	[[ $c != lf-* ]] || lf=$("${UTIL[@]}" lfstats "$base.server")
	read -r rss cpu <<<"$(time_of "$DIR/server.time" 2>/dev/null)" || true
	record round="$round" latency_ms="$lat" job="$job" config="$c" ok="$([[ -z $err ]] && echo 1 || echo 0)" \
		seconds="$seconds" rate="$rate" unit="$unit" ops="$ops" req="$req" lf="$lf" rss_kib="$rss" cpu_s="$cpu" \
		left_objects="$left" verified=- steal_pct="$steal" error="${err//,/;}"
	vacuum
	if [[ -n $err ]]; then
		FAILED=1
		say "!!! round $round ${lat} ms $job $(config_name "$c"): $err (see $base.*)"
	else
		say "round $round ${lat} ms $job $(config_name "$c"): $seconds s${rate:+, $rate $unit}, store requests (get put delete list other) $req, steal $steal %"
	fi
}

copy_cmd() { # DIRECTION CONFIG
	local lfargs=()
	((ONE_OBJECT)) || lfargs=(--object-size "$COPY_OBJECT_SIZE")
	local obj=up-aws
	have aws || obj=up-rclone
	# shellcheck disable=SC2016 # the sh -c scripts take their own arguments
	case $1-$2 in
	up-lightfoot) CMD=("$LIGHTFOOT" copy --json "$SRC" "s3://$BUCKET/up-lightfoot" "${lfargs[@]}") ;;
	up-rclone) CMD=(rclone copyto "$SRC" "s3bench:$BUCKET/up-rclone") ;;
	up-aws) CMD=("$AWS" --endpoint-url "$ENDPOINT" s3 cp --no-progress "$SRC" "s3://$BUCKET/up-aws") ;;
	down-lightfoot) CMD=("$LIGHTFOOT" copy --json "s3://$BUCKET/up-lightfoot" "$DST") ;;
	down-lightfoot-object) CMD=("$LIGHTFOOT" copy --json "s3://$BUCKET/$obj" "$DST") ;;
	down-rclone) CMD=(sh -c 'rclone copyto "$1" "$2" && sync -- "$2"' sh "s3bench:$BUCKET/up-rclone" "$DST") ;;
	down-aws) CMD=(sh -c '"$1" --endpoint-url "$2" s3 cp --no-progress "$3" "$4" && sync -- "$4"' sh "$AWS" "$ENDPOINT" "s3://$BUCKET/up-aws" "$DST") ;;
	esac
}

run_copy() { # ROUND LATENCY DIRECTION CONFIG
	local round=$1 lat=$2 dir=$3 c=$4 base err="" file
	base=$DIR/logs/r$1-${2}ms-copy-$3-$4
	if [[ $dir == up ]]; then
		"${UTIL[@]}" rm "$DIRECT" "$BUCKET" "up-$c" >/dev/null
		file=$SRC
	else
		rm -f -- "$DST"
		file=$DST
	fi
	"$LIGHTFOOT" cache evict "$SRC" >/dev/null
	copy_cmd "$dir" "$c"
	echo "+ ${CMD[*]}" >"$base.log"
	local m0 m1 mark t0 t1 steal
	m0=$("${UTIL[@]}" metrics "$METRICS" "$BUCKET")
	rm -f -- "$DIR/copy.time"
	mark=$(steal_mark)
	t0=$EPOCHREALTIME
	timeout 7200 /usr/bin/time -f "%M %U %S" -o "$DIR/copy.time" "${CMD[@]}" >"$base.out" 2>>"$base.log" || err="failed"
	t1=$EPOCHREALTIME
	steal=$(steal_pct "$mark")
	local cached="" dirty=""
	[[ -f $file ]] && read -r cached dirty <<<"$(cache_of "$file")"
	m1=$("${UTIL[@]}" metrics "$METRICS" "$BUCKET")
	local seconds rate req lf verified=- rss cpu
	seconds=$(secs "$t0" "$t1")
	rate=$(python3 -c "print(f'{$SIZE_BYTES / 2**20 / $seconds:.3f}')")
	req=$("${UTIL[@]}" delta "$m0" "$m1")
	lf="n/a"
	if [[ $c == lightfoot* ]]; then
		local side=destination
		[[ $dir == down ]] && side=source
		lf=$("${UTIL[@]}" lfcopy "$base.out" "$side")
	fi
	if [[ -z $err && $dir == down ]] && [[ $VERIFY == all || ($VERIFY == first && $round == 1) ]]; then
		if cmp -s -- "$SRC" "$DST"; then verified=yes; else err="MISMATCH" verified=no; fi
		"$LIGHTFOOT" cache evict "$SRC" "$DST" >/dev/null 2>&1 || true
	fi
	read -r rss cpu <<<"$(time_of "$DIR/copy.time" 2>/dev/null)" || true
	record round="$round" latency_ms="$lat" job="copy-$dir" config="$c" ok="$([[ -z $err ]] && echo 1 || echo 0)" \
		seconds="$seconds" rate="$rate" unit=MiB/s req="$req" lf="$lf" rss_kib="$rss" cpu_s="$cpu" \
		cached_bytes="$cached" dirty_bytes="$dirty" verified="$verified" steal_pct="$steal" error="${err//,/;}"
	vacuum
	if [[ -n $err ]]; then
		FAILED=1
		say "!!! round $round ${lat} ms copy-$dir $(config_name "$c"): $err (see $base.log)"
	else
		say "round $round ${lat} ms copy-$dir $(config_name "$c"): $seconds s, $rate MiB/s, cached $((${cached:-0} >> 20)) MiB, RSS $((${rss:-0} >> 10)) MiB, store requests $req"
	fi
}

ordered() { # ROUND KEYS...: the keys in order in odd rounds, reversed in even ones
	local r=$1 i
	shift
	local k=("$@")
	for ((i = 0; i < ${#k[@]}; i++)); do
		echo "${k[$((r % 2 ? i : ${#k[@]} - 1 - i))]}"
	done
}

say "SIZE=$SIZE ROUNDS=$ROUNDS LATENCIES=\"${LATENCY_LIST[*]}\" JOBS=\"${JOB_LIST[*]}\" RUNTIME=$RUNTIME BEST=${BEST_BYTES:+$BEST} ONE_OBJECT=$ONE_OBJECT"
for ((r = 1; r <= ROUNDS; r++)); do
	for lat in "${LATENCY_LIST[@]}"; do
		set_latency "$lat"
		h=$(head_median "$ENDPOINT")
		d=$(head_median "$DIRECT")
		hm=$(python3 -c "print(f'{$h * 1000:.2f}')")
		dm=$(python3 -c "print(f'{$d * 1000:.2f}')")
		say "round $r latency $lat ms: HEAD median $hm ms through $ENDPOINT, $dm ms directly ($HEADS requests each)"
		# Toxiproxy adds its own hop: warn when the difference strays from LATENCY by more
		# than 2 ms or a fifth.
		python3 -c "import sys; d = $hm - $dm - ${lat%p}; sys.exit(abs(d) > max(2, ${lat%p} / 5))" ||
			say "WARNING: the added latency measured $(python3 -c "print(f'{$hm - $dm:.2f}')") ms, not ${lat%p} ms"
		# seconds: the median through the endpoint in use; rate: directly.
		record round="$r" latency_ms="$lat" job=head config=curl ok=1 seconds="$h" rate="$d" unit=s ops="$HEADS"
		for job in "${JOB_LIST[@]}"; do
			if [[ $job == copy ]]; then
				read -r -a keys <<<"$(configs_of copy-up | tr '\n' ' ')"
				for c in $(ordered "$r" "${keys[@]}"); do run_copy "$r" "$lat" up "$c"; done
				read -r -a keys <<<"$(configs_of copy-down | tr '\n' ' ')"
				for c in $(ordered "$r" "${keys[@]}"); do run_copy "$r" "$lat" down "$c"; done
				rm -f -- "$DST"
			else
				read -r -a keys <<<"$(configs_of "$job")"
				for c in $(ordered "$r" "${keys[@]}"); do run_nbd "$r" "$lat" "$job" "$c"; done
			fi
		done
	done
done

rev=$(git -C "$HERE/.." describe --always --dirty 2>/dev/null || echo unknown)
python3 "$HERE/summarize_s3.py" "$CSV" "$DIR/table-s3.md" \
	"SIZE=$SIZE, ROUNDS=$ROUNDS, RUNTIME=$RUNTIME s, BEST=${BEST:-none}, ONE_OBJECT=$ONE_OBJECT; SeaweedFS $(basename -- "$WEED"), ${TOXI:+toxiproxy $("$TOXI" -version | awk '{print $NF}'), }nbdkit $(nbdkit --version | awk '{print $2}'); $(uname -r); lightfoot $rev; $(date -u +'%Y-%m-%d %H:%M UTC')"
say "raw runs: $CSV; tables: $DIR/table-s3.md; logs: $DIR/logs/"
if ((FAILED)); then
	echo "!!! some runs failed: see the lines marked !!! above" >&2
	exit 1
fi
