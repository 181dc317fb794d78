#!/usr/bin/env bash
# serve.sh: how fast does an NBD server serve a disk image, and what does it leave in the
# page cache?
#
# Serves one file over a Unix socket with lightfoot (in some cache modes), nbdkit's file
# plugin and qemu-nbd (each with and without the page cache), and runs four client workloads
# against each: a sequential read and a sequential write with nbdcopy, 4 KiB random reads
# and 4 KiB random writes (a flush every 64 writes) with fio's nbd engine. Prints a table of
# medians per workload. PRESET=prefetch runs the matrix of issue 5 (`serve --prefetch`)
# instead: small sequential, interleaved, random and mixed reads.
#
# Usage (as root: it drops caches):
#     bench/serve.sh [DIR]
#     SIZE=256M WORKSET=64M RUNS=1 RUNTIME=3 bench/serve.sh        # smoke test
#     PRESET=prefetch bench/serve.sh                               # issue 5's matrix
#
# Environment:
#     SIZE       size of the served file (default 4G; K, M, G suffixes, powers of 1024)
#     RUNS       rounds; each round runs every workload with every server once (default 5)
#     WORKSET    bytes at the start of the served file re-read before each run as the
#                "working set" the server should leave alone (default 512M; a multiple of 2M)
#     RUNTIME    seconds each fio workload runs (default 20)
#     TARGET     what the write workloads write into: sparse (default: a fresh file truncated
#                to SIZE before each run, so writes fill holes) or data (a fully written file,
#                made once and overwritten run after run, as a VM's disk image would be)
#     VERIFY     1 (default): after each sequential write, compare the file with what was sent
#     CONFIGS    servers to run, by key (default: "lightfoot lightfoot-keep nbdkit nbdkit-none
#                qemu-wb qemu-none control"; also lightfoot-drop, lightfoot-direct,
#                lightfoot-prefetch, lightfoot-direct-prefetch, lightfoot-plain and
#                lightfoot-direct-plain (--no-prefetch: prefetch is on by default since
#                issue 44; a binary from before takes no such flag), nbdkit-readahead,
#                nbdkit-memory, device)
#     WORKLOADS  workloads to run, by key (default: "seqread seqwrite randread randwrite"; also
#                seqread4k, interleave3, mixed)
#     PRESET     prefetch: CONFIGS and WORKLOADS default to issue 5's matrix (lightfoot with
#                --prefetch and --no-prefetch in both modes, nbdkit, nbdkit-readahead, qemu-none;
#                seqread4k interleave3 randread mixed); CONFIGS or WORKLOADS, if set, win
#     INTERLEAVE the interleave3 client (default ../target/release/examples/interleave beside
#                this script: cargo build --release --examples)
#     DIR        work directory: files, logs, results (default: the first argument, else
#                /work/tmp/bench-serve). Needs 2 x SIZE free.
#     LIGHTFOOT  the binary to test (default ../target/release/lightfoot beside this script)
#
# Each run: prepare the served file (the random-data source for the read workloads, the
# target for the write workloads); sync; drop caches; read the working set with buffered dd;
# evict the readahead dd left past it; start a fresh server and wait for its socket; run the
# client; right after, read the page-cache figures of the served file with `lightfoot cache
# stat`, the server's peak RSS (VmHWM) and CPU time; stop the server (SIGTERM); only then
# verify a sequential write. A control that only sleeps shows what the VM's background paging
# does to the working set in the same time. The `device` config runs no server: fio reads the
# file itself with O_DIRECT (libaio) in the same round. For seqread it reads 2 MiB blocks 8
# deep; for the fio read workloads it runs the same jobs with psync instead of NBD. Write
# workloads are not run for it. It is a reference, not a bound: fio's buffers are in 4 KiB
# pages, so each of its reads reaches virtio-blk as requests of at most 254 pages, where
# lightfoot's huge-page buffers make whole 4 MiB requests (src/io/sys/mem.rs, AlignedBuf).
#
# Output: one table per workload on stdout and in DIR/table.md, every run in
# DIR/results.csv, client and server output in DIR/logs/. Tools that are not installed are
# reported as MISSING and their jobs skipped. See bench/README.md for the columns. Do not
# read absolute figures across runs of this script: on these VMs only ratios within one run
# mean anything.
set -euo pipefail
export LC_ALL=C # EPOCHREALTIME and number formats

die() { echo "serve.sh: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }

HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)

[[ $EUID -eq 0 ]] || die "run as root (it writes /proc/sys/vm/drop_caches)"
(($# <= 1)) || die "usage: serve.sh [DIR]"

SIZE=${SIZE:-4G}
RUNS=${RUNS:-5}
WORKSET=${WORKSET:-512M}
RUNTIME=${RUNTIME:-20}
TARGET=${TARGET:-sparse}
VERIFY=${VERIFY:-1}
PRESET=${PRESET:-}
case $PRESET in
"")
	DEFAULT_CONFIGS="lightfoot lightfoot-keep nbdkit nbdkit-none qemu-wb qemu-none control"
	DEFAULT_WORKLOADS="seqread seqwrite randread randwrite"
	;;
prefetch)
	# Issue 5: lightfoot with and without prefetch in both modes, against nbdkit with the
	# page cache (the reference), nbdkit's readahead filter and qemu-nbd with O_DIRECT.
	DEFAULT_CONFIGS="lightfoot-plain lightfoot-prefetch lightfoot-direct-plain lightfoot-direct-prefetch nbdkit nbdkit-readahead qemu-none"
	DEFAULT_WORKLOADS="seqread4k interleave3 randread mixed"
	;;
*) die "PRESET=$PRESET: unknown (prefetch, or unset)" ;;
esac
CONFIGS=${CONFIGS:-$DEFAULT_CONFIGS}
WORKLOADS=${WORKLOADS:-$DEFAULT_WORKLOADS}
DIR=${DIR:-${1:-/work/tmp/bench-serve}}
LIGHTFOOT=${LIGHTFOOT:-$HERE/../target/release/lightfoot}
INTERLEAVE=${INTERLEAVE:-$HERE/../target/release/examples/interleave}

MiB=$((1 << 20))
FIO_JOBS=4        # fio: jobs (one NBD connection each), iodepth 1 per job
FIO_FSYNC=64      # fio randwrite: a flush every 64 writes per job
FIO_BS=4096       # fio and interleave3: bytes per request
FIO_RANDOM=70     # fio mixed: % of requests at a random offset (the rest continue the last one)
STREAMS=3         # interleave3: sequential streams on its one connection
QEMU_SHARED=4     # qemu-nbd -e: nbdcopy and fio open 4 connections at once
CLIENT_TIMEOUT=${CLIENT_TIMEOUT:-$((RUNTIME * 3 + 600))} # a hung client is a failed run

to_bytes() { numfmt --from=iec -- "$1" 2>/dev/null || die "$2=$1: not a size (e.g. 512M, 4G)"; }
SIZE_BYTES=$(to_bytes "$SIZE" SIZE)
WS_BYTES=$(to_bytes "$WORKSET" WORKSET)
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || die "RUNS=$RUNS: not a positive integer"
[[ $RUNTIME =~ ^[1-9][0-9]*$ ]] || die "RUNTIME=$RUNTIME: not a positive number of seconds"
[[ $TARGET == sparse || $TARGET == data ]] || die "TARGET=$TARGET: sparse or data"
[[ $VERIFY == 0 || $VERIFY == 1 ]] || die "VERIFY=$VERIFY: 0 or 1"
((WS_BYTES > 0 && WS_BYTES % (2 * MiB) == 0)) ||
	die "WORKSET=$WORKSET: must be a positive multiple of 2M (eviction works on 2 MiB folios)"
((WS_BYTES < SIZE_BYTES)) || die "WORKSET=$WORKSET must be smaller than SIZE=$SIZE"
((SIZE_BYTES % 4096 == 0)) || die "SIZE=$SIZE: must be a multiple of 4K (fio's block size)"
# seqread4k: each fio job reads its own quarter of the file beyond the working set, in whole
# blocks.
FIO_REGION=$(((SIZE_BYTES - WS_BYTES) / FIO_JOBS / FIO_BS * FIO_BS))

[[ -x $LIGHTFOOT ]] ||
	die "lightfoot binary not found at $LIGHTFOOT: build it (cargo build --release) or set LIGHTFOOT="
LIGHTFOOT=$(realpath -- "$LIGHTFOOT")
if [[ -x $INTERLEAVE ]]; then INTERLEAVE=$(realpath -- "$INTERLEAVE"); fi
command -v python3 >/dev/null || die "python3 is needed to parse results"

mkdir -p -- "$DIR" "$DIR/logs"
DIR=$(realpath -- "$DIR")
exec 9>"$DIR/.lock"
flock -n 9 || die "another serve.sh is running in $DIR"

SRC=$DIR/src.img # served by the read workloads: SIZE bytes of random data
DST=$DIR/dst.img # served by the write workloads (TARGET)
CSV=$DIR/results.csv
SOCK=$DIR/nbd.sock
PIDF=$DIR/server.pid
URI="nbd+unix:///?socket=$SOCK"
((${#SOCK} < 100)) || die "$SOCK: too long for a Unix socket path; choose a shorter DIR"
rm -f -- "$SOCK" "$PIDF" "$DIR"/logs/*
[[ $TARGET == sparse ]] && rm -f -- "$DST"

# Room for the source and a target (fully written after a sequential write).
need=0
[[ -e $SRC ]] || need=$((need + SIZE_BYTES))
[[ -e $DST ]] || need=$((need + SIZE_BYTES))
avail=$(($(stat -f -c '%a * %S' -- "$DIR")))
((avail > need)) || die "$DIR: $((avail / MiB)) MiB free, need $((need / MiB)) MiB"

# --- the files: made once, reused while SIZE stays the same ----------------------------------

LAYOUT="size=$SIZE_BYTES random"
if [[ -f $SRC && -f $SRC.layout && $(<"$SRC.layout") == "$LAYOUT" ]]; then
	say "reusing $SRC ($LAYOUT)"
else
	say "writing $SRC: $SIZE of random data"
	rm -f -- "$SRC" "$SRC.layout"
	dd if=/dev/urandom of="$SRC" bs=1M iflag=fullblock,count_bytes count="$SIZE_BYTES" status=none
	sync -- "$SRC"
	echo "$LAYOUT" >"$SRC.layout"
fi
[[ $(stat -c %s -- "$SRC") == "$SIZE_BYTES" ]] || die "$SRC: wrong size"

# TARGET=data: a fully written target, made once and then only overwritten (its extents stay
# allocated, as a VM image's do). TARGET=sparse: made afresh before each write run.
if [[ $TARGET == data ]]; then
	if [[ -f $DST && -f $DST.layout && $(<"$DST.layout") == "$LAYOUT" ]]; then
		say "reusing $DST as the write target (TARGET=data)"
	else
		say "writing $DST: a copy of $SRC, the write target (TARGET=data)"
		rm -f -- "$DST" "$DST.layout"
		cp --sparse=never -- "$SRC" "$DST"
		sync -- "$DST"
		echo "$LAYOUT" >"$DST.layout"
	fi
fi

# --- servers and workloads ---------------------------------------------------------------------

# stat -f calls ext4 "ext2/ext3": ask findmnt first.
FSTYPE=$(findmnt -no FSTYPE -T "$DIR" 2>/dev/null || stat -f -c %T -- "$DIR")

read -r -a CONFIG_KEYS <<<"${CONFIGS//,/ }"
read -r -a WORKLOAD_KEYS <<<"${WORKLOADS//,/ }"
((${#CONFIG_KEYS[@]} > 0)) || die "CONFIGS is empty"
((${#WORKLOAD_KEYS[@]} > 0)) || die "WORKLOADS is empty"

# The name of a server configuration in the table (summarize_serve.py knows the peers'
# names for its ratio columns: keep them in step).
config_name() {
	case $1 in
	lightfoot) echo "lightfoot" ;;
	lightfoot-keep) echo "lightfoot --cache=keep" ;;
	lightfoot-drop) echo "lightfoot --cache=drop" ;;
	lightfoot-direct) echo "lightfoot --cache=direct" ;;
	lightfoot-prefetch) echo "lightfoot --prefetch" ;;
	lightfoot-direct-prefetch) echo "lightfoot --cache=direct --prefetch" ;;
	lightfoot-plain) echo "lightfoot --no-prefetch" ;;
	lightfoot-direct-plain) echo "lightfoot --cache=direct --no-prefetch" ;;
	nbdkit) echo "nbdkit file" ;;
	nbdkit-none) echo "nbdkit file cache=none" ;;
	nbdkit-readahead) echo "nbdkit --filter=readahead file" ;;
	nbdkit-memory) echo "nbdkit memory (no disk)" ;;
	qemu-wb) echo "qemu-nbd --cache=writeback" ;;
	qemu-none) echo "qemu-nbd --cache=none" ;;
	control) echo "sleep (control)" ;;
	device) echo "device (fio O_DIRECT, no server)" ;;
	*) return 1 ;;
	esac
}

config_tool() {
	case $1 in
	lightfoot*) echo lightfoot ;;
	nbdkit*) echo nbdkit ;;
	qemu*) echo qemu-nbd ;;
	control) echo sleep ;;
	device) echo fio ;;
	esac
}

workload_name() {
	case $1 in
	seqread) echo "sequential read, nbdcopy URI null: (MiB/s)" ;;
	seqwrite) echo "sequential write, nbdcopy --flush [ nbdkit pattern ] URI (MiB/s)" ;;
	randread) echo "4 KiB random read, fio nbd engine, $FIO_JOBS jobs x iodepth 1 (IOPS)" ;;
	randwrite) echo "4 KiB random write + flush every $FIO_FSYNC writes, fio nbd engine, $FIO_JOBS jobs x iodepth 1 (IOPS)" ;;
	seqread4k) echo "4 KiB sequential read, fio nbd engine, $FIO_JOBS jobs x iodepth 1, each in its own region (IOPS)" ;;
	interleave3) echo "$STREAMS interleaved 4 KiB sequential streams on one connection, one request at a time (IOPS)" ;;
	mixed) echo "4 KiB reads, $FIO_RANDOM % random + $((100 - FIO_RANDOM)) % continuing the last, fio nbd engine, $FIO_JOBS jobs x iodepth 1 (IOPS)" ;;
	*) return 1 ;;
	esac
}

# Programs a workload needs besides the server (the write source is nbdkit's pattern plugin).
workload_tools() {
	case $1 in
	seqread) echo nbdcopy ;;
	seqwrite) echo nbdcopy nbdkit ;;
	randread | randwrite | seqread4k | mixed) echo fio ;;
	interleave3) echo interleave ;;
	esac
}

for key in "${CONFIG_KEYS[@]}"; do
	config_name "$key" >/dev/null ||
		die "CONFIGS: unknown server $key (lightfoot lightfoot-keep lightfoot-drop lightfoot-direct lightfoot-prefetch lightfoot-direct-prefetch lightfoot-plain lightfoot-direct-plain nbdkit nbdkit-none nbdkit-readahead nbdkit-memory qemu-wb qemu-none control device)"
done
for key in "${WORKLOAD_KEYS[@]}"; do
	workload_name "$key" >/dev/null ||
		die "WORKLOADS: unknown workload $key (seqread seqwrite randread randwrite seqread4k interleave3 mixed)"
done

tool_present() {
	case $1 in
	lightfoot) true ;;
	interleave) [[ -x $INTERLEAVE ]] ;;
	*) command -v "$1" >/dev/null ;;
	esac
}

# The first missing program a job (workload $1, server $2) needs, or nothing.
job_missing() {
	local t
	for t in $(workload_tools "$1") $(config_tool "$2"); do
		tool_present "$t" || { echo "$t"; return; }
	done
}

# The file a workload serves.
served_file() {
	case $1 in
	seqread | randread | seqread4k | interleave3 | mixed) echo "$SRC" ;;
	*) echo "$DST" ;;
	esac
}

# Sets SCMD to the command line of server $1 serving file $2 on $SOCK, writing its process id
# to $PIDF once it accepts connections. Each runs in the foreground (the script starts it in
# the background and stops it with SIGTERM), writable, with its defaults otherwise. lightfoot
# prints its --stats as one JSON line to stderr when it exits (into the server log): request
# counts, and the prefetch buffer's hits and misses. (It counts requests with or without
# --stats; the option only adds the report.)
server_cmd() {
	local lf=("$LIGHTFOOT" serve --unix "$SOCK" --pid-file "$PIDF" --stats --json)
	local nk=(nbdkit -f -U "$SOCK" -P "$PIDF")
	local qn=(qemu-nbd -f raw -e "$QEMU_SHARED" -t -k "$SOCK" --pid-file="$PIDF")
	case $1 in
	lightfoot) SCMD=("${lf[@]}" "$2") ;;
	lightfoot-keep) SCMD=("${lf[@]}" --cache=keep "$2") ;;
	lightfoot-drop) SCMD=("${lf[@]}" --cache=drop "$2") ;;
	lightfoot-direct) SCMD=("${lf[@]}" --cache=direct "$2") ;;
	lightfoot-prefetch) SCMD=("${lf[@]}" --prefetch "$2") ;;
	lightfoot-direct-prefetch) SCMD=("${lf[@]}" --cache=direct --prefetch "$2") ;;
	lightfoot-plain) SCMD=("${lf[@]}" --no-prefetch "$2") ;;
	lightfoot-direct-plain) SCMD=("${lf[@]}" --cache=direct --no-prefetch "$2") ;;
	nbdkit) SCMD=("${nk[@]}" file "$2") ;;
	nbdkit-none) SCMD=("${nk[@]}" file "$2" cache=none) ;;
	nbdkit-readahead) SCMD=("${nk[@]}" --filter=readahead file "$2") ;;
	# Zeroes from memory, the file untouched: a lower bound on what the clients and the socket
	# allow (lightfoot --prefetch answered interleave3 twice as fast here).
	nbdkit-memory) SCMD=("${nk[@]}" memory "$SIZE_BYTES") ;;
	qemu-wb) SCMD=("${qn[@]}" --cache=writeback "$2") ;;
	qemu-none) SCMD=("${qn[@]}" --cache=none "$2") ;;
	*) die "no server command for $1" ;;
	esac
}

# Sets CMD to the client command line of workload $1 (fio writes its JSON report to $2).
# nbdcopy --flush makes the sequential write durable; fio's randwrite flushes every
# $FIO_FSYNC writes (the nbd engine sends NBD_CMD_FLUSH for fio's fsync) and once at the end.
# The write source is nbdkit's pattern plugin (each 8 bytes hold their offset: no zero
# blocks, nearly free to make); nbdkit's random plugin makes only ~270 MiB/s here, on both
# cores, and would be the bottleneck.
#
# The sequential workloads read the file beyond the working set, so that every server starts
# them cold (the working set is there to show whether a server leaves others' cache alone; in
# the read regions it would speed up the servers that read through the page cache).
# seqread4k gives each fio job its own quarter of that (--offset, --size, --offset_increment)
# and is not time-based: a job stops after RUNTIME or at the end of its quarter, whichever
# comes first, so nothing is read twice (a second pass would be served from the page cache by
# the servers that use it). interleave3 (examples/interleave.rs, lightfoot's own NBD client,
# one connection) does the same with thirds. mixed: fio's percentage_random draws, for each
# request, a random offset (70 %) or the block right after the previous one (30 %), so the
# sequential part comes in short runs (1.43 blocks on average, counting the random request
# that starts each run; 99 % of runs are at most 4 blocks).
client_cmd() {
	local fio=(fio --name="$1" --ioengine=nbd --uri="$URI" --bs="$FIO_BS" --numjobs="$FIO_JOBS"
		--iodepth=1 --runtime="$RUNTIME" --group_reporting --eta=never
		--output-format=json --output="$2")
	case $1 in
	seqread) CMD=(nbdcopy -- "$URI" null:) ;;
	# (The brackets are quoted: inside ( ) bash would read "[ ... ]" as one word.)
	seqwrite) CMD=(nbdcopy --flush -- "[" nbdkit pattern size="$SIZE_BYTES" "]" "$URI") ;;
	randread) CMD=("${fio[@]}" --time_based --rw=randread) ;;
	randwrite) CMD=("${fio[@]}" --time_based --rw=randwrite --fsync="$FIO_FSYNC" --end_fsync=1) ;;
	seqread4k) CMD=("${fio[@]}" --rw=read --offset="$WS_BYTES" --size="$FIO_REGION" --offset_increment="$FIO_REGION") ;;
	mixed) CMD=("${fio[@]}" --time_based --rw=randread --percentage_random="$FIO_RANDOM") ;;
	interleave3) CMD=("$INTERLEAVE" "$URI" --streams "$STREAMS" --block "$FIO_BS" --seconds "$RUNTIME" --start "$WS_BYTES") ;;
	*) die "no client command for $1" ;;
	esac
}

# Sets CMD to fio reading the served file $2 directly for read workload $1 (JSON report to $3).
device_cmd() {
	local fio=(fio --name="$1" --filename="$2" --direct=1 --invalidate=0 --eta=never --output-format=json --output="$3")
	local jobs=(--bs="$FIO_BS" --numjobs="$FIO_JOBS" --iodepth=1 --ioengine=psync --runtime="$RUNTIME" --group_reporting)
	case $1 in
	seqread) CMD=("${fio[@]}" --rw=read --bs=2M --iodepth=8 --ioengine=libaio --size="$SIZE_BYTES") ;;
	randread) CMD=("${fio[@]}" "${jobs[@]}" --time_based --rw=randread) ;;
	seqread4k) CMD=("${fio[@]}" "${jobs[@]}" --rw=read --offset="$WS_BYTES" --size="$FIO_REGION" --offset_increment="$FIO_REGION") ;;
	mixed) CMD=("${fio[@]}" "${jobs[@]}" --time_based --rw=randread --percentage_random="$FIO_RANDOM") ;;
	*) return 1 ;;
	esac
}

# The control sleeps as long as lightfoot's default server has taken on the workload so far
# (median), or the fio runtime, so that its working-set figure is what background paging
# alone does in that time; 4 s before any lightfoot run has succeeded.
declare -A LIGHTFOOT_WALLS=()
control_seconds() {
	case $1 in
	randread | randwrite | mixed) echo "$RUNTIME" ;;
	*)
		if [[ -z ${LIGHTFOOT_WALLS[$1]:-} ]]; then
			echo 4
		else
			printf '%s\n' ${LIGHTFOOT_WALLS[$1]} | sort -g |
				awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
		fi
		;;
	esac
}

# --- the server's lifetime -------------------------------------------------------------------

SERVER_PID="" # the process the script started (bash's $!)
SERVER_REAL="" # the process id the server wrote to $PIDF (the same, unless something wraps it)

kill_leftover_server() {
	if [[ -n $SERVER_PID ]]; then
		kill -KILL "$SERVER_PID" 2>/dev/null || true
		wait "$SERVER_PID" 2>/dev/null || true
	fi
}
trap kill_leftover_server EXIT

# start_server KEY FILE LOG: starts the server, waits (10 s at most) until its socket exists
# and it has written its pid file. Returns 1 if it died or never got ready.
start_server() {
	rm -f -- "$SOCK" "$PIDF"
	server_cmd "$1" "$2"
	echo "+ ${SCMD[*]}" >"$3"
	"${SCMD[@]}" >>"$3" 2>&1 &
	SERVER_PID=$!
	SERVER_REAL=""
	local i
	for ((i = 0; i < 200; i++)); do
		if [[ -S $SOCK && -s $PIDF ]]; then
			SERVER_REAL=$(<"$PIDF")
			[[ $SERVER_REAL =~ ^[0-9]+$ ]] || SERVER_REAL=$SERVER_PID
			return 0
		fi
		kill -0 "$SERVER_PID" 2>/dev/null || break
		sleep 0.05
	done
	return 1
}

# Process state from /proc/PID/stat ("" once reaped); the name field may hold spaces.
proc_state() {
	local s
	s=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
	s=${s##*) }
	echo "${s%% *}"
}

# Prints "peak_rss_kib cpu_seconds" of the running server (VmHWM; utime + stime of all its
# threads), "- -" if it is gone.
server_usage() {
	local pid=$1 hwm cpu
	hwm=$(awk '/^VmHWM:/ { print $2 }' "/proc/$pid/status" 2>/dev/null) || true
	cpu=$(awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); printf "%.2f", ($12 + $13) / hz }' \
		"/proc/$pid/stat" 2>/dev/null) || true
	echo "${hwm:--} ${cpu:--}"
}

# stop_server: SIGTERM, 60 s to exit (a server may flush on the way out), then SIGKILL.
# Sets SERVER_RC: the server's exit status, "killed" if it had to be killed.
stop_server() {
	SERVER_RC=""
	[[ -n $SERVER_PID ]] || return 0
	kill -TERM "$SERVER_PID" 2>/dev/null || true
	local i st
	for ((i = 0; i < 600; i++)); do
		st=$(proc_state "$SERVER_PID")
		[[ -z $st || $st == Z ]] && break
		sleep 0.1
	done
	if [[ -n $st && $st != Z ]]; then
		kill -KILL "$SERVER_PID" 2>/dev/null || true
		SERVER_RC=killed
	fi
	local rc=0
	wait "$SERVER_PID" 2>/dev/null || rc=$?
	[[ -n $SERVER_RC ]] || SERVER_RC=$rc
	SERVER_PID=""
	rm -f -- "$SOCK" "$PIDF"
}

# --- measuring ---------------------------------------------------------------------------------

# Prints the `lightfoot cache stat --json` array for one range of a file, or [] on failure
# (the parser then records empty fields).
cache_json() {
	"$LIGHTFOOT" cache stat --json --range "$@" 2>/dev/null || true
}

# Reads JSON arrays from the arguments, prints "cached_bytes dirty_pages writeback_pages" of
# the first file in each, "-" where the figure is unknown.
parse_stats() {
	python3 - "$@" <<'EOF'
import json, sys
out = []
for arg in sys.argv[1:]:
    try:
        entry = json.loads(arg)[0]
    except (ValueError, IndexError, TypeError):
        entry = {}
    cached = entry.get("cached_bytes")
    stat = entry.get("stat") or {}
    out += ["-" if cached is None else str(cached),
            str(stat.get("dirty", "-")), str(stat.get("writeback", "-"))]
print(" ".join(out))
EOF
}

# Prints "iops total_ios syncs error bytes" of a fio JSON report for direction $2 (read,
# write).
parse_fio() {
	python3 - "$1" "$2" <<'EOF'
import json, sys
try:
    with open(sys.argv[1]) as f:
        text = f.read()
    # fio may print warnings before the JSON object.
    job = json.loads(text[text.index("{"):])["jobs"][0]
    side = job[sys.argv[2]]
    print(f'{side["iops"]:.1f} {side["total_ios"]} {job.get("sync", {}).get("total_ios", "-")} '
          f'{job.get("error", 0)} {side.get("io_bytes", "-")} {side.get("bw_bytes", "-")}')
except (OSError, ValueError, KeyError, IndexError) as e:
    print("- - - unparsable - -")
EOF
}

# Prints "iops ios bytes" from the JSON line examples/interleave.rs printed into log $1.
parse_interleave() {
	python3 - "$1" <<'EOF'
import json, sys
try:
    with open(sys.argv[1]) as f:
        line = [l for l in f if l.startswith('{"streams"')][-1]
    r = json.loads(line)
    print(f'{r["iops"]:.1f} {r["ios"]} {r["bytes"]}')
except (OSError, ValueError, KeyError, IndexError):
    print("- - -")
EOF
}

# Prints "streams hits misses read_ahead unread" of the prefetch filter from the --stats JSON
# line lightfoot wrote to its log $1 at exit, "-" where unknown (no --prefetch, no report).
parse_prefetch() {
	python3 - "$1" <<'EOF'
import json, sys
p = {}
try:
    with open(sys.argv[1], errors="replace") as f:
        for line in f:
            if line.startswith("{"):
                try:
                    p = json.loads(line).get("prefetch") or {}
                except ValueError:
                    pass
except OSError:
    pass
print(" ".join(str(p.get(k, "-")) for k in ("streams_found", "hits", "misses", "prefetched", "wasted")))
EOF
}

# Adds two page counts, "-" if either is unknown.
add_pages() {
	if [[ $1 =~ ^[0-9]+$ && $2 =~ ^[0-9]+$ ]]; then echo $(($1 + $2)); else echo -; fi
}

echo "round,workload,config,status,client_exit,server_exit,wall_s,throughput,unit,ios,syncs,server_peak_rss_kib,server_cpu_s,ws_bytes,ws_cached_before,beyond_before,ws_cached,beyond,dirty_pages,writeback_pages,verify,bytes,pf_streams,pf_hits,pf_misses,pf_read_ahead,pf_unread" >"$CSV"

csv_row() {
	local IFS=,
	echo "$*" >>"$CSV"
}

FAILURES=0

# run_one ROUND WORKLOAD CONFIG: one cold run with a fresh server, one CSV row.
run_one() {
	local round=$1 wl=$2 key=$3
	local name file base log slog json
	name=$(config_name "$key")
	file=$(served_file "$wl")
	base=$DIR/logs/$round-$wl-$key
	log=$base.log slog=$base.server.log json=$base.json

	# The served file, then the cold start: only the working set cached.
	if [[ $file == "$DST" && $TARGET == sparse ]]; then
		rm -f -- "$DST"
		truncate -s "$SIZE_BYTES" -- "$DST"
	fi
	sync
	echo 3 >/proc/sys/vm/drop_caches
	dd if="$file" of=/dev/null bs=1M count=$((WS_BYTES / MiB)) status=none
	# dd's readahead ran up to read_ahead_kb past the working set: drop that, so the run
	# starts with exactly the working set cached.
	"$LIGHTFOOT" cache evict --range "$WS_BYTES:" "$file" >/dev/null

	local status=ok rc="" src_rc="" wall="" tput="" unit="" ios="" syncs="" usage="- -" verify=n/a
	local bytes="" pf=(- - - - -)
	if [[ $key != control && $key != device ]] && ! start_server "$key" "$file" "$slog"; then
		status=no-server
		echo "!!! FAILED: round $round, $wl, $name: the server did not start; see $slog:" >&2
		tail -n 5 -- "$slog" | sed 's/^/!!!   /' >&2
		stop_server
		csv_row "$round" "$wl" "\"$name\"" "$status" "" "$SERVER_RC" "" "" "" "" "" "" "" \
			"$WS_BYTES" "" "" "" "" "" "" "" "" "" "" "" "" ""
		FAILURES=$((FAILURES + 1))
		printf '   %-11s %-36s %s\n' "$wl" "$name" "$status" >&2
		return
	fi
	local before_ws before_beyond
	before_ws=$(cache_json "0:$WS_BYTES" "$file")
	before_beyond=$(cache_json "$WS_BYTES:" "$file")

	if [[ $key == control ]]; then
		CMD=(sleep "$(control_seconds "$wl")")
	elif [[ $key == device ]]; then
		device_cmd "$wl" "$file" "$json"
	else
		client_cmd "$wl" "$json"
	fi
	echo "+ ${CMD[*]}" >"$log"
	local t0 t1
	rc=0
	t0=$EPOCHREALTIME
	(cd -- "$DIR" && timeout -k 10 "$CLIENT_TIMEOUT" "${CMD[@]}") >>"$log" 2>&1 || rc=$?
	t1=$EPOCHREALTIME

	# Measure at once: background paging starts eating idle cache within seconds.
	local after_ws after_beyond
	after_ws=$(cache_json "0:$WS_BYTES" "$file")
	after_beyond=$(cache_json "$WS_BYTES:" "$file")
	[[ $key == control || $key == device ]] || usage=$(server_usage "$SERVER_REAL")
	stop_server
	src_rc=$SERVER_RC
	if [[ $key == lightfoot* ]]; then read -r -a pf <<<"$(parse_prefetch "$slog")"; fi

	# EPOCHREALTIME always has 6 decimals: drop the dot for microseconds.
	local wall_us=$((${t1/./} - ${t0/./}))
	wall=$(printf '%d.%06d' $((wall_us / 1000000)) $((wall_us % 1000000)))

	local s u f
	read -r -a s <<<"$(parse_stats "$before_ws" "$before_beyond" "$after_ws" "$after_beyond")"
	# s: ws_before(cached dirty wb) beyond_before(...) ws(...) beyond(...)
	read -r -a u <<<"$usage"

	if ((rc != 0)); then
		status=failed
		echo "!!! FAILED: round $round, $wl, $name: the client exited with $rc; see $log:" >&2
		tail -n 5 -- "$log" | sed 's/^/!!!   /' >&2
	elif [[ -n $src_rc && $src_rc != 0 ]]; then
		status=server-exit
		echo "!!! FAILED: round $round, $wl, $name: the server exited with $src_rc after SIGTERM; see $slog:" >&2
		tail -n 5 -- "$slog" | sed 's/^/!!!   /' >&2
	fi
	if [[ $key != control && $status == ok ]]; then
		case $wl in
		seqread | seqwrite)
			unit=MiB/s
			bytes=$SIZE_BYTES
			tput=$(awk -v b="$SIZE_BYTES" -v us="$wall_us" 'BEGIN { printf "%.1f", b / 1048576 / (us / 1e6) }')
			if [[ $key == device ]]; then
				# fio's own figure: its start-up (a few tenths of a second) is not the device's.
				read -r -a f <<<"$(parse_fio "$json" read)"
				tput=$(awk -v b="${f[5]}" 'BEGIN { printf "%.1f", b / 1048576 }')
			fi
			;;
		randread | randwrite | seqread4k | mixed)
			unit=IOPS
			local dir=read
			[[ $wl == randwrite ]] && dir=write
			read -r -a f <<<"$(parse_fio "$json" "$dir")"
			tput=${f[0]} ios=${f[1]} syncs=${f[2]} bytes=${f[4]}
			if [[ ${f[3]} != 0 ]]; then
				status=fio-error
				echo "!!! FAILED: round $round, $wl, $name: fio reported error ${f[3]}; see $json" >&2
			fi
			;;
		interleave3)
			unit=IOPS
			read -r -a f <<<"$(parse_interleave "$log")"
			tput=${f[0]} ios=${f[1]} bytes=${f[2]}
			if [[ $tput == - ]]; then
				status=failed
				echo "!!! FAILED: round $round, $wl, $name: no result from the client; see $log" >&2
			fi
			;;
		esac
		[[ $tput == - ]] && tput=""
		[[ $bytes == - ]] && bytes=""
	fi

	# Correctness, only now that the cache figures are taken and the server has exited.
	if [[ $wl == seqwrite && $key != control && $VERIFY == 1 && $status == ok ]]; then
		if cmp -s -- "$DST" <(nbdcopy -- "[" nbdkit pattern size="$SIZE_BYTES" "]" - 2>>"$log"); then
			verify=same
		else
			verify=DIFFERENT
			status=mismatch
			echo "!!! MISMATCH: round $round, $wl, $name: $DST is not what was written (the pattern)" >&2
		fi
	fi

	[[ $status == ok ]] || FAILURES=$((FAILURES + 1))
	if [[ $key == lightfoot && $status == ok ]]; then
		LIGHTFOOT_WALLS[$wl]="${LIGHTFOOT_WALLS[$wl]:-} $wall"
	fi

	csv_row "$round" "$wl" "\"$name\"" "$status" "$rc" "$src_rc" "$wall" "$tput" "$unit" \
		"$ios" "$syncs" "${u[0]/-/}" "${u[1]/-/}" "$WS_BYTES" "${s[0]}" "${s[3]}" "${s[6]}" \
		"${s[9]}" "$(add_pages "${s[7]}" "${s[10]}")" "$(add_pages "${s[8]}" "${s[11]}")" "$verify" \
		"$bytes" "${pf[0]/-/}" "${pf[1]/-/}" "${pf[2]/-/}" "${pf[3]/-/}" "${pf[4]/-/}"
	printf '   %-11s %-36s %8.2f s %12s %-6s %s\n' "$wl" "$name" "$wall" "${tput:--}" "$unit" "$status" >&2
}

# --- the rounds ----------------------------------------------------------------------------------

# The first line of a tool's --version, "TOOL MISSING" if it is not installed.
version_of() {
	local v
	v=$("$@" --version 2>/dev/null | head -n 1) || true
	echo "${v:-$1 MISSING}"
}
VERSIONS="$(version_of "$LIGHTFOOT"); $(version_of nbdkit); $(version_of qemu-nbd | cut -d' ' -f1,2); $(version_of nbdcopy); $(version_of fio)"
say "versions: $VERSIONS"
for wl in "${WORKLOAD_KEYS[@]}"; do
	for key in "${CONFIG_KEYS[@]}"; do
		m=$(job_missing "$wl" "$key")
		[[ -z $m ]] || echo "MISSING: $m (job $wl / \"$(config_name "$key")\" is skipped)" >&2
	done
done

say "$RUNS round(s) of ${#WORKLOAD_KEYS[@]} workloads x ${#CONFIG_KEYS[@]} servers: SIZE=$SIZE" \
	"WORKSET=$WORKSET RUNTIME=${RUNTIME}s TARGET=$TARGET DIR=$DIR ($FSTYPE)"
for ((round = 1; round <= RUNS; round++)); do
	say "round $round/$RUNS"
	for wl in "${WORKLOAD_KEYS[@]}"; do
		for key in "${CONFIG_KEYS[@]}"; do
			[[ $key == device && $wl != seqread && $wl != randread && $wl != seqread4k && $wl != mixed ]] && continue
			m=$(job_missing "$wl" "$key")
			if [[ -n $m ]]; then
				csv_row "$round" "$wl" "\"$(config_name "$key")\"" "missing:$m" "" "" "" "" "" "" "" \
					"" "" "$WS_BYTES" "" "" "" "" "" "" "" "" "" "" "" "" ""
				printf '   %-11s %-36s MISSING: %s\n' "$wl" "$(config_name "$key")" "$m" >&2
				continue
			fi
			run_one "$round" "$wl" "$key"
		done
	done
done
[[ $TARGET == sparse ]] && rm -f -- "$DST"

# --- the tables --------------------------------------------------------------------------------

rev=$(git -C "$HERE/.." describe --always --dirty 2>/dev/null || echo unknown)
python3 "$HERE/summarize_serve.py" "$CSV" "$DIR/table.md" \
	"${PRESET:+PRESET=$PRESET, }SIZE=$SIZE, WORKSET=$WORKSET, RUNS=$RUNS, RUNTIME=${RUNTIME}s, TARGET=$TARGET; $(uname -r), $FSTYPE in $DIR; lightfoot $rev; ${VERSIONS#*; }; $(date -u +'%Y-%m-%d %H:%M UTC')"
say "raw runs: $CSV; tables: $DIR/table.md; client and server output: $DIR/logs/"
if ((FAILURES > 0)); then
	echo "!!! $FAILURES run(s) failed: see the lines marked !!! above" >&2
	exit 1
fi
