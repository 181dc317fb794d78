#!/usr/bin/env bash
# guest.sh: how fast does a virtual machine run on an NBD server's disk, and what does the
# server read from storage and leave in the page cache for it?
#
# Boots the Linux guest of scripts/guest/ (QEMU, TCG) with one NBD export as its disk and runs
# one workload in it, per server and round, the servers alternating within each round. The
# read workloads run on an ext4 image made once from /usr trees; the write workloads on a fresh
# empty ext4 image each run.
#
#   workload    what the guest does (scripts/guest/jobs/)
#   scan        tar of the whole file system to /dev/null (a backup)
#   random      RANDOM_FILES whole small files (≤ 64 KiB) in a random order
#   walk        ls -lR of everything, then the 8 largest files
#   boot        the directories of bin/ and python3/ listed, then their files (≤ 2 MiB) in path
#               order
#   untar       a tar archive of TAR_TREE (on a second disk, served warm by nbdkit for every
#               server alike) unpacked into the empty file system, then sync
#   smallwrite  1024 4 KiB writes at random offsets of a 64 MiB file, every 32nd with
#               conv=fsync, then sync
#
#   server             command line (every one on a Unix socket, writable)
#   lightfoot          lightfoot serve $LIGHTFOOT_ARGS IMG (read-ahead on by default since
#                      issue 44, none before)
#   lightfoot-prefetch lightfoot serve --prefetch $LIGHTFOOT_ARGS IMG
#   lightfoot-plain    lightfoot serve --no-prefetch $LIGHTFOOT_ARGS IMG
#   lightfoot-old      lightfoot serve $LIGHTFOOT_ARGS IMG with the binary $LIGHTFOOT_OLD (an
#                      A/B of two builds under guests)
#   nbdkit             nbdkit file IMG (the host page cache and its readahead)
#   nbdkit-readahead   nbdkit --filter=readahead file IMG
#   nbdkit-trace       nbdkit --filter=log file IMG: records the guest's requests in
#                      DIR/logs/rR-WORKLOAD-nbdkit-trace.trace for bench/replay.sh (the log
#                      slows nbdkit down: not a peer)
#   qemu-wb            qemu-nbd --cache=writeback IMG
#   qemu-none          qemu-nbd --cache=none IMG (O_DIRECT)
#   cached             nbdkit file of a copy of IMG in /dev/shm (memory: nothing to read from
#                      storage): the reference for the read workloads' I/O part (not run for
#                      the write workloads)
#
# Object storage (read workloads only; each runs once per latency in LATENCIES, as KEY@MS): IMG
# is uploaded once as one object, s3://bench/guest.img, to a SeaweedFS started for the run
# (bench/store.sh: loopback, Toxiproxy in front for added latency), and served read-only:
#   lightfoot-s3       lightfoot serve -r $LIGHTFOOT_S3_ARGS s3://bench/guest.img
#   lightfoot-s3-old   the same with the binary $LIGHTFOOT_OLD (an A/B over object storage)
#   nbdkit-s3          nbdkit -r S3 endpoint-url=… bucket=bench key=guest.img (nbdkit's S3
#                      plugin, nbdkit-plugin-python + python3-boto3: a range GET per request)
#   nbdkit-s3-filters  the same with --filter=readahead --filter=cache (readahead asks the
#                      cache filter below it to fetch ahead; the cache keeps what was fetched,
#                      in a temporary file)
# Their table also gives the guest's time relative to lightfoot-prefetch's from the local file
# in the same rounds, and the store's GET requests (SeaweedFS's counters, before and after).
#
# The guest's own CPU time under TCG is a large part of every figure, so for read workloads
# the table gives the **I/O part**: the guest's time minus the `cached` run's time in the same
# round. The guest's time is its job's timed part by its own clock (jobs/lib: `timed`), not
# the boot.
#
# Usage (as root: it drops caches and bind-mounts the trees to build the image):
#     bench/guest.sh [DIR]
#     ROUNDS=1 WORKLOADS=scan CONFIGS="lightfoot cached" bench/guest.sh    # smoke test
#     WORKLOADS=scan CONFIGS="lightfoot-prefetch lightfoot-s3 nbdkit-s3 nbdkit-s3-filters" \
#         bench/guest.sh                                                   # object storage
#
# Environment:
#     ROUNDS        rounds (default 5)
#     WORKLOADS     default "scan random walk boot untar smallwrite"
#     CONFIGS       default "lightfoot lightfoot-prefetch nbdkit nbdkit-readahead qemu-wb
#                   qemu-none cached" (`cached` is only run for read workloads)
#     TREES         directories copied into the read image, each under its own name (default
#                   "/usr/bin /usr/lib/python3 /usr/share/doc /usr/share/man": about 600 MiB
#                   in 15,000 files here)
#     TAR_TREE      what untar unpacks (default /usr/include: about 110 MiB in small files)
#     RANDOM_FILES  files the random workload reads (default 2000)
#     LIGHTFOOT     the binary (default ../target/release/lightfoot beside this script)
#     LIGHTFOOT_OLD the binary of lightfoot-old
#     LIGHTFOOT_ARGS  extra arguments for every local lightfoot server
#     LIGHTFOOT_S3_ARGS  arguments of lightfoot-s3 (default --prefetch: the chunk cache)
#     LATENCIES     added response latencies in ms for the object storage servers (default
#                   "0 10"; 0: directly, no proxy)
#     GUEST_MEM     the guest's memory, MiB (default 512); GUEST_SMP its CPUs (default 1)
#     TIMEOUT       seconds a guest may take, boot included (default 900): a run past it failed
#     DIR           work directory (default: the first argument, else /work/tmp/bench-guest)
#
# Each run: sync and drop the host's caches; start the
# server; boot the guest (scripts/guest/boot.sh: cache=none, discard=unmap); when it powers
# off, read right away the page cache the image holds (`lightfoot cache stat`), the server's
# bytes read from storage (/proc/PID/io read_bytes: the storage reads it caused, its
# readahead included, less what it had read by the time it listened: its own binary and
# libraries, paged in again after the drop), peak RSS and CPU time (user + system, from
# listening on: on 2 cores the guest's emulation competes with it); stop the server
# (SIGTERM). The guest prints its disk's statistics at the end (/sys/block/vda/stat): its
# requests, the bytes it read, and the milliseconds its reads were outstanding (summed over
# reads in flight together: the I/O as the guest saw it).
#
# Output: tables per workload on stdout and in DIR/table.md (bench/summarize_guest.py DIR
# redoes them), every run in DIR/results.csv, consoles and server logs in DIR/logs/. Only
# ratios within one run mean anything on these VMs.
set -euo pipefail
export LC_ALL=C

die() { echo "guest.sh: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }

HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
GUEST=$HERE/../scripts/guest

[[ $EUID -eq 0 ]] || die "run as root (it drops caches and bind-mounts the trees)"
(($# <= 1)) || die "usage: guest.sh [DIR]"

ROUNDS=${ROUNDS:-5}
WORKLOADS=${WORKLOADS:-scan random walk boot untar smallwrite}
CONFIGS=${CONFIGS:-lightfoot lightfoot-prefetch nbdkit nbdkit-readahead qemu-wb qemu-none cached}
TREES=${TREES:-/usr/bin /usr/lib/python3 /usr/share/doc /usr/share/man}
TAR_TREE=${TAR_TREE:-/usr/include}
RANDOM_FILES=${RANDOM_FILES:-2000}
LIGHTFOOT=${LIGHTFOOT:-$HERE/../target/release/lightfoot}
LIGHTFOOT_ARGS=${LIGHTFOOT_ARGS:-}
LIGHTFOOT_S3_ARGS=${LIGHTFOOT_S3_ARGS---prefetch}
LATENCIES=${LATENCIES:-0 10}
TIMEOUT=${TIMEOUT:-900}
DIR=${1:-${DIR:-/work/tmp/bench-guest}}
export GUEST_MEM=${GUEST_MEM:-512} GUEST_SMP=${GUEST_SMP:-1}

[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS: not a positive integer"
[[ -x $LIGHTFOOT ]] || die "no lightfoot binary at $LIGHTFOOT: cargo build --release, or set LIGHTFOOT="
LIGHTFOOT=$(realpath -- "$LIGHTFOOT")
for t in qemu-system-x86_64 nbdkit qemu-nbd mkfs.ext4 python3; do
	command -v "$t" >/dev/null || die "$t is missing (scripts/install-deps.sh installs it)"
done
"$GUEST/build.sh" >/dev/null || die "scripts/guest/build.sh failed"

mkdir -p -- "$DIR/logs"
DIR=$(realpath -- "$DIR")
exec 9>"$DIR/.lock"
flock -n 9 || die "another guest.sh is running in $DIR"
SOCK=$DIR/nbd.sock
TARSOCK=$DIR/tar.sock
PIDF=$DIR/server.pid
CSV=$DIR/results.csv
((${#SOCK} < 100)) || die "$SOCK: too long for a Unix socket path; choose a shorter DIR"

read -r -a WORKLOAD_KEYS <<<"${WORKLOADS//,/ }"
read -r -a CONFIG_KEYS <<<"${CONFIGS//,/ }"
is_s3() { [[ $1 == lightfoot-s3* || $1 == nbdkit-s3* ]]; }
# Each object storage server once per latency: KEY@MS.
keys=()
for c in "${CONFIG_KEYS[@]}"; do
	if is_s3 "$c"; then
		for l in $LATENCIES; do
			[[ $l =~ ^[0-9]+$ ]] || die "LATENCIES: $l is not a number of ms"
			keys+=("$c@$l")
		done
	else
		keys+=("$c")
	fi
done
CONFIG_KEYS=("${keys[@]}")
for w in "${WORKLOAD_KEYS[@]}"; do
	[[ -f $GUEST/jobs/$w && $w != lib && $w != check && $w != write ]] || die "WORKLOADS: unknown $w"
done
is_read() { [[ $1 == scan || $1 == random || $1 == walk || $1 == boot ]]; }

config_name() {
	case $1 in
	*@*) echo "$(config_name "${1%@*}"), +${1#*@} ms" ;;
	lightfoot-s3) echo "lightfoot s3${LIGHTFOOT_S3_ARGS:+ $LIGHTFOOT_S3_ARGS}" ;;
	lightfoot-s3-old) echo "lightfoot $LIGHTFOOT_OLD s3${LIGHTFOOT_S3_ARGS:+ $LIGHTFOOT_S3_ARGS}" ;;
	nbdkit-s3) echo "nbdkit S3" ;;
	nbdkit-s3-filters) echo "nbdkit --filter=readahead --filter=cache S3" ;;
	lightfoot) echo "lightfoot${LIGHTFOOT_ARGS:+ $LIGHTFOOT_ARGS}" ;;
	lightfoot-prefetch) echo "lightfoot --prefetch${LIGHTFOOT_ARGS:+ $LIGHTFOOT_ARGS}" ;;
	lightfoot-plain) echo "lightfoot --no-prefetch${LIGHTFOOT_ARGS:+ $LIGHTFOOT_ARGS}" ;;
	lightfoot-old) echo "lightfoot $LIGHTFOOT_OLD${LIGHTFOOT_ARGS:+ $LIGHTFOOT_ARGS}" ;;
	nbdkit) echo "nbdkit file" ;;
	nbdkit-readahead) echo "nbdkit --filter=readahead file" ;;
	nbdkit-trace) echo "nbdkit --filter=log file (recording)" ;;
	qemu-wb) echo "qemu-nbd --cache=writeback" ;;
	qemu-none) echo "qemu-nbd --cache=none" ;;
	cached) echo "cached (nbdkit file, image in the page cache)" ;;
	*) return 1 ;;
	esac
}
for c in "${CONFIG_KEYS[@]}"; do config_name "$c" >/dev/null || die "CONFIGS: unknown $c"; done
[[ " ${CONFIG_KEYS[*]} " != *" lightfoot-old "* && " ${CONFIG_KEYS[*]} " != *" lightfoot-s3-old@"* ||
	-x ${LIGHTFOOT_OLD:-} ]] || die "lightfoot-old and lightfoot-s3-old need LIGHTFOOT_OLD, a binary"

# --- the images ----------------------------------------------------------------------------

IMG=$DIR/read.img   # the read workloads' file system, made once
TAR=$DIR/tree.tar   # untar's archive, made once
WIMG=$DIR/write.img # the write workloads' target, made afresh each run

STAGE=$DIR/stage
cleanup_stage() {
	local m
	for m in "$STAGE"/*/; do mountpoint -q "$m" && umount "$m"; done
	rm -rf -- "$STAGE"
}

LAYOUT="trees=$TREES random=$RANDOM_FILES v3"
if [[ -f $IMG && -f $IMG.layout && $(<"$IMG.layout") == "$LAYOUT" ]]; then
	say "reusing $IMG ($LAYOUT)"
else
	say "making $IMG from $TREES"
	rm -f -- "$IMG" "$IMG.layout"
	trap cleanup_stage EXIT
	mkdir -p -- "$STAGE/.lf"
	for t in $TREES; do
		[[ -d $t ]] || die "TREES: $t is not a directory"
		mkdir -p -- "$STAGE/$(basename "$t")"
		mount --bind -o ro "$t" "$STAGE/$(basename "$t")"
	done
	# Names the guest's xargs can take as they are: no blanks, quotes or backslashes.
	plain() { grep -v "[[:space:]\"'\\\\]" || true; }
	(
		cd "$STAGE"
		# The lists the jobs read (so that no walk of the tree comes before the timed part).
		find . -path ./.lf -prune -o -type f -size -65k -print | sed 's,^\./,,' | plain |
			shuf -n "$RANDOM_FILES" --random-source=<(yes) >.lf/random.list
		find . -path ./.lf -prune -o -type f -printf '%P\n' | plain | xargs -d '\n' stat -c '%s %n' |
			sort -rn | sed -n 1,8p | cut -d' ' -f2- >.lf/large.list
		find ./bin ./python3 -type f -size -2049k 2>/dev/null | sed 's,^\./,,' | sort | plain >.lf/boot.list
	)
	for l in random large boot; do [[ -s $STAGE/.lf/$l.list ]] || die "no files for .lf/$l.list in $TREES"; done
	bytes=$(du -sb --apparent-size "$STAGE" | cut -f1)
	size=$(((bytes * 13 / 10 / 1048576 + 256) / 64 * 64))M
	mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 -d "$STAGE" "$IMG" "$size"
	cleanup_stage
	trap - EXIT
	echo "$LAYOUT" >"$IMG.layout"
fi
if [[ " ${WORKLOAD_KEYS[*]} " == *" untar "* && ! -f $TAR ]]; then
	say "making $TAR from $TAR_TREE"
	tar cf "$TAR.tmp" -C "$(dirname "$TAR_TREE")" "$(basename "$TAR_TREE")"
	truncate -s "%1M" "$TAR.tmp" # a whole number of sectors for the disk
	mv "$TAR.tmp" "$TAR"
fi
IMG_BYTES=$(stat -c %s "$IMG")
SHM=/dev/shm/lightfoot-bench-guest-$$.img
if [[ " ${CONFIG_KEYS[*]} " == *" cached "* ]]; then
	avail=$(($(stat -f -c '%a * %S' /dev/shm)))
	((avail > IMG_BYTES + (1 << 30))) || die "/dev/shm: $((avail >> 20)) MiB free, the cached reference needs $((IMG_BYTES >> 20)) MiB"
	cp -- "$IMG" "$SHM"
fi
WIMG_SIZE=${WIMG_SIZE:-2G}

# --- the object store ----------------------------------------------------------------------

BUCKET=bench
UTIL=(/usr/bin/python3 "$HERE/s3_util.py") # Debian's interpreter: boto3, as nbdkit's plugin
STORE=0
for c in "${CONFIG_KEYS[@]}"; do is_s3 "$c" && STORE=1; done
if ((STORE)); then
	nbdkit S3 --version >/dev/null 2>&1 || die "nbdkit's S3 plugin is needed (nbdkit-plugin-python, python3-boto3)"
	# shellcheck source=bench/store.sh
	. "$HERE/store.sh"
fi

# --- servers -------------------------------------------------------------------------------

SERVER_PID=""
TAR_PID=""
stop_all() {
	local p
	for p in $SERVER_PID $TAR_PID; do kill -KILL "$p" 2>/dev/null || true; done
	((STORE == 0)) || store_stop
	wait 2>/dev/null || true
	rm -f -- "$SHM"
}
trap stop_all EXIT
if ((STORE)); then
	need_proxy=0
	for l in $LATENCIES; do [[ $l == 0 ]] || need_proxy=1; done
	store_start "$need_proxy"
	store_latency 0
	say "uploading $IMG to s3://$BUCKET/guest.img"
	"$LIGHTFOOT" copy "$IMG" "s3://$BUCKET/guest.img" >"$DIR/logs/upload.log" 2>&1 ||
		die "upload failed (see $DIR/logs/upload.log)"
fi

# shellcheck source=bench/servers.sh
. "$HERE/servers.sh"

# start_server KEY FILE LOG: the server on $SOCK; waits for its pid file.
start_server() {
	local lf=("$LIGHTFOOT" serve --unix "$SOCK" --pid-file "$PIDF" --stats --json)
	local nk=(nbdkit -f -U "$SOCK" -P "$PIDF")
	local qn=(qemu-nbd -f raw -t -k "$SOCK" --pid-file="$PIDF")
	local cmd s3=()
	if is_s3 "$1"; then
		store_latency "${1#*@}"
		s3=(endpoint-url="$ENDPOINT" access-key="$AWS_ACCESS_KEY_ID" secret-key="$AWS_SECRET_ACCESS_KEY"
			bucket="$BUCKET" key=guest.img)
	fi
	case $1 in
	lightfoot-s3@*) cmd=("${lf[@]}" -r $LIGHTFOOT_S3_ARGS "s3://$BUCKET/guest.img") ;;
	lightfoot-s3-old@*) cmd=("$LIGHTFOOT_OLD" "${lf[@]:1}" -r $LIGHTFOOT_S3_ARGS "s3://$BUCKET/guest.img") ;;
	nbdkit-s3@*) cmd=("${nk[@]}" -r S3 "${s3[@]}") ;;
	nbdkit-s3-filters@*) cmd=("${nk[@]}" -r --filter=readahead --filter=cache S3 "${s3[@]}") ;;
	lightfoot) cmd=("${lf[@]}" $LIGHTFOOT_ARGS "$2") ;;
	lightfoot-prefetch) cmd=("${lf[@]}" --prefetch $LIGHTFOOT_ARGS "$2") ;;
	lightfoot-plain) cmd=("${lf[@]}" --no-prefetch $LIGHTFOOT_ARGS "$2") ;;
	lightfoot-old) cmd=("$LIGHTFOOT_OLD" "${lf[@]:1}" $LIGHTFOOT_ARGS "$2") ;;
	nbdkit | cached) cmd=("${nk[@]}" file "$2") ;;
	nbdkit-readahead) cmd=("${nk[@]}" --filter=readahead file "$2") ;;
	nbdkit-trace) cmd=("${nk[@]}" --filter=log file "$2" logfile="${3%.server}.trace") ;;
	qemu-wb) cmd=("${qn[@]}" --cache=writeback "$2") ;;
	qemu-none) cmd=("${qn[@]}" --cache=none "$2") ;;
	esac
	launch "$3" "${cmd[@]}"
}

# stop_server: SIGTERM, 60 s, then SIGKILL; sets SERVER_RC.
stop_server() {
	kill -TERM "$SERVER_PID" 2>/dev/null || true
	local i
	for ((i = 0; i < 600; i++)); do
		kill -0 "$SERVER_PID" 2>/dev/null || break
		sleep 0.1
	done
	kill -KILL "$SERVER_PID" 2>/dev/null && SERVER_RC=killed || SERVER_RC=0
	local rc=0
	wait "$SERVER_PID" 2>/dev/null || rc=$?
	[[ $SERVER_RC == killed ]] || SERVER_RC=$rc
	SERVER_PID=""
}

# The archive's disk: nbdkit, read-only, its file read into the page cache first, so that
# untar's source costs every server under test the same.
start_tar_server() {
	cat "$TAR" >/dev/null
	rm -f -- "$TARSOCK"
	nbdkit -f -r -U "$TARSOCK" file "$TAR" >"$DIR/logs/tar-server.log" 2>&1 &
	TAR_PID=$!
	local i
	for ((i = 0; i < 200; i++)); do
		[[ -S $TARSOCK ]] && return 0
		sleep 0.05
	done
	die "nbdkit serving $TAR did not start"
}

# --- runs ----------------------------------------------------------------------------------

HEADER="round,workload,config,status,guest_s,job_s,wall_s,guest_reads,guest_read_bytes,guest_writes,guest_write_bytes,guest_discards,guest_flushes,server_read_bytes,cache_left_bytes,server_rss_kib,server_rc,store_gets,server_cpu_s,guest_read_ms"
[[ -f $CSV ]] || echo "$HEADER" >"$CSV"
[[ $(head -n 1 "$CSV") == "$HEADER" ]] || die "$CSV has other columns (an older guest.sh): move it away"

# run ROUND WORKLOAD CONFIG: one boot; appends a line to $CSV.
run() {
	local round=$1 w=$2 c=$3 file disks=() log console status=ok
	log=$DIR/logs/r$round-$w-$c
	if is_read "$w"; then
		file=$IMG
	else
		file=$WIMG
		rm -f -- "$WIMG"
		mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$WIMG" "$WIMG_SIZE"
	fi
	sync
	echo 3 >/proc/sys/vm/drop_caches
	# The reference serves a copy in tmpfs: file cache idle for ~30 s is paged out on these
	# VMs, and a reference that loses half its cache mid-run is no reference.
	[[ $c == cached ]] && file=$SHM
	disks=("$SOCK")
	is_s3 "$c" && disks=("ro:$SOCK")
	if [[ $w == untar ]]; then
		start_tar_server
		disks+=("ro:$TARSOCK")
	fi
	local m0="" gets=-
	((STORE == 0)) || m0=$("${UTIL[@]}" metrics "$METRICS" "$BUCKET")
	start_server "$c" "$file" "$log.server" || { status=server-failed; }
	local t0 t1 usage="- -" left=- rc=0 rb0=- rb rss cpu0=- cpu cpus=-
	# What the server read from storage to start (its binary and libraries, paged in after
	# the drop: 18 MB for lightfoot, 9.5 for nbdkit) is not the image's.
	[[ $status == ok ]] && read -r rb0 _ cpu0 <<<"$(server_usage "$SERVER_PID")"
	t0=$EPOCHREALTIME
	if [[ $status == ok ]]; then
		timeout -k 10 "$TIMEOUT" "$GUEST/boot.sh" "$w" "" "${disks[@]}" >"$log.console" 2>&1 || rc=$?
		t1=$EPOCHREALTIME
		usage=$(server_usage "$SERVER_PID")
		read -r rb rss cpu <<<"$usage"
		usage="$rb $rss"
		[[ $rb == - || $rb0 == - ]] || usage="$((rb - rb0)) $rss"
		[[ $cpu == - || $cpu0 == - ]] || cpus=$(awk -v t=$((cpu - cpu0)) -v hz="$CLK_TCK" 'BEGIN { printf "%.2f", t / hz }')
		left=$(cached_bytes "$file")
		stop_server
		((rc == 0)) || status=guest-failed-$rc
		[[ $SERVER_RC == 0 ]] || status=server-rc-$SERVER_RC
	else
		t1=$EPOCHREALTIME
	fi
	if is_s3 "$c"; then
		[[ -z $SERVER_PID ]] || stop_server
		gets=$("${UTIL[@]}" delta "$m0" "$("${UTIL[@]}" metrics "$METRICS" "$BUCKET")" | cut -d' ' -f1)
	fi
	if [[ -n $TAR_PID ]]; then
		kill "$TAR_PID" 2>/dev/null || true
		wait "$TAR_PID" 2>/dev/null || true
		TAR_PID=""
	fi
	python3 - "$log.console" "$round" "$w" "$c" "$status" "$t0" "$t1" $usage "$left" "${SERVER_RC:--}" "$gets" "$cpus" >>"$CSV" <<'EOF'
import re, sys
log, rnd, w, c, status, t0, t1, rbytes, rss, left, src, gets, cpus = sys.argv[1:]
text = open(log, errors="replace").read().replace("\r", "") if status != "server-failed" else ""
timed = re.findall(r"^lf: timed ([0-9.]+)", text, re.M)
end = re.search(r"^lf: end \S+ rc=(\d+) seconds=([0-9.]+)", text, re.M)
stat = re.search(r"^lf: stat vda\s+([\d ]+)$", text, re.M)
if status == "ok" and (not end or end.group(1) != "0" or not timed):
    status = "job-failed"
f = [int(x) for x in stat.group(1).split()] if stat else []
g = lambda i: str(f[i]) if len(f) > i else "-"
b = lambda i: str(f[i] * 512) if len(f) > i else "-"
print(",".join([rnd, w, c, status, timed[-1] if timed else "-", end.group(2) if end else "-",
                f"{float(t1) - float(t0):.2f}", g(0), b(2), g(4), b(6), g(11), g(15),
                rbytes, left, rss, src, gets, cpus, g(3)]))
EOF
	tail -1 "$CSV" | awk -F, '{ printf "   %-10s %-20s %8s s (job %s s, boot+job %s s)  %s\n", $2, $3, $5, $6, $7, $4 }' >&2
}

say "$ROUNDS round(s): workloads ${WORKLOAD_KEYS[*]}; servers ${CONFIG_KEYS[*]}; image $IMG ($((IMG_BYTES >> 20)) MiB)"
for ((r = 1; r <= ROUNDS; r++)); do
	say "round $r/$ROUNDS"
	# The servers' order turns by one each round, so none always runs first after a drop.
	n=${#CONFIG_KEYS[@]}
	order=()
	for ((i = 0; i < n; i++)); do order+=("${CONFIG_KEYS[$(((i + r - 1) % n))]}"); done
	for w in "${WORKLOAD_KEYS[@]}"; do
		for c in "${order[@]}"; do
			[[ $c == cached ]] || is_s3 "$c" && ! is_read "$w" && continue
			run "$r" "$w" "$c"
		done
	done
done

{
	echo "guest.sh: ROUNDS=$ROUNDS GUEST_MEM=$GUEST_MEM GUEST_SMP=$GUEST_SMP, image $((IMG_BYTES >> 20)) MiB from $TREES"
	echo "lightfoot: $LIGHTFOOT${LIGHTFOOT_ARGS:+ (LIGHTFOOT_ARGS=$LIGHTFOOT_ARGS)}; $(uname -r); $(date -u '+%F %H:%M') UTC"
	echo
	python3 "$HERE/summarize_guest.py" "$CSV" "$(for c in "${CONFIG_KEYS[@]}"; do printf '%s=%s;' "$c" "$(config_name "$c")"; done)"
} | tee "$DIR/table.md"
