#!/usr/bin/env bash
# coalesce.sh: does `lightfoot serve --coalesce` turn small scattered writes into fewer and
# faster ones, and how does it compare with the peers? (issue 6)
#
# Four fio workloads (nbd engine, 4 jobs x iodepth 1, a flush every 64 writes per job and at
# the end), each against every server in turn, round after round (alternating, so slow
# drifts of these VMs hit every server alike):
#     strided   1 KiB written every 4 KiB (rw=write:3k), each job in its own quarter
#     rand64m   random 1 KiB writes within a 64 MiB region per job
#     randall   random 1 KiB writes over the whole file
#     rand4k    random 4 KiB writes over the whole file
# Servers: lightfoot (neutral mode) without and with --coalesce, nbdkit file cache=none,
# qemu-nbd --cache=none, and nbdkit file with the page cache (the reference); optionally
# `nbdkit null` (key null), which discards writes and flushes nothing: what fio's client and
# the socket allow on this machine, a bound for every server; and `nbdkit memory` (key
# memory), which stores in memory but never touches a disk.
# Backend write calls (pwrite64, pwritev, pwritev2 of the server and all its threads) are
# counted in separate counting runs (COUNT), the server under `perf stat` on the syscall
# tracepoints; lightfoot --coalesce also reports its own count (--stats) in every run. The
# timed rounds run untraced: while a syscall tracepoint is enabled, every syscall of every
# process on the machine takes the kernel's slow path, and that moved the servers unequally
# (strided, paired probe runs at < 10 % steal: --coalesce 14 % slower traced, the plain server
# 10 % faster, medians; see docs/benchmarks/runs/coalesce.md, 2026-11-24).
#
# Usage (as root: it drops caches):
#     bench/coalesce.sh [DIR]
#     SIZE=256M RUNS=1 RUNTIME=2 DROP=0 CONFIGS=coalesce WORKLOADS=strided bench/coalesce.sh
#
# Environment:
#     SIZE       size of the served file (default 4G; K, M, G suffixes)
#     RUNS       rounds (default 5)
#     RUNTIME    seconds per fio run (default 20)
#     TARGET     sparse (default: a fresh sparse file before each run) or data (a fully
#                written file, made once and overwritten run after run)
#     CONFIGS    servers by key (default: "lightfoot coalesce nbdkit-none qemu-none nbdkit";
#                also: null, memory, and coalesce-SIZE for --coalesce with --coalesce-block
#                SIZE, e.g. "lightfoot coalesce-32K coalesce coalesce-256K" to compare blocks)
#     WORKLOADS  workloads by key (default: "strided rand64m randall rand4k")
#     DIR        work directory (default: the first argument, else /work/tmp/bench-coalesce)
#     LIGHTFOOT  the binary (default ../target/release/lightfoot beside this script)
#     COALESCE_ARGS  more options for lightfoot --coalesce (every coalesce config)
#     DROP       1 (default): drop caches before each run; 0: don't (smoke tests on a machine
#                where someone else is measuring)
#     QUIET      steal limit in percent (default 10) for the quiet-rounds column
#     COUNT      counting runs per workload and server, traced, before the timed rounds
#                (default 1; 0: no backend write counts but lightfoot's own)
#
# Output: a table of medians per workload (IOPS, ratio to lightfoot without --coalesce,
# backend writes per client write, fio's mean write and FLUSH latencies, the host's CPU steal
# during the runs; strided, with the null server in CONFIGS, a model of what holding writes
# can give: null's write round trip and the plain server's FLUSH per 64 writes) on stdout and in
# DIR/table.md; every run in DIR/results.csv; logs in DIR/logs/. Only ratios within one run
# mean anything here. The share of CPU time the host stole from this VM (/proc/stat "steal")
# is recorded for every run: it swings from 0 to over 30 % within minutes on these VMs, so a
# "quiet rounds" column gives the same-round ratio over the rounds in which both the server's
# run and the plain server's run saw less than QUIET % (count in parentheses).
set -euo pipefail
export LC_ALL=C

die() { echo "coalesce.sh: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }

HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
[[ $EUID -eq 0 ]] || die "run as root (it writes /proc/sys/vm/drop_caches)"
(($# <= 1)) || die "usage: coalesce.sh [DIR]"

SIZE=${SIZE:-4G}
RUNS=${RUNS:-5}
RUNTIME=${RUNTIME:-20}
TARGET=${TARGET:-sparse}
CONFIGS=${CONFIGS:-lightfoot coalesce nbdkit-none qemu-none nbdkit}
WORKLOADS=${WORKLOADS:-strided rand64m randall rand4k}
DIR=${DIR:-${1:-/work/tmp/bench-coalesce}}
LIGHTFOOT=${LIGHTFOOT:-$HERE/../target/release/lightfoot}
DROP=${DROP:-1}
COALESCE_ARGS=${COALESCE_ARGS:-}
QUIET=${QUIET:-10}
COUNT=${COUNT:-1}

JOBS=4
FSYNC=64
SIZE_BYTES=$(numfmt --from=iec -- "$SIZE") || die "SIZE=$SIZE: not a size"
((SIZE_BYTES % (JOBS * 4096) == 0)) || die "SIZE=$SIZE: must be a multiple of $((JOBS * 4))K"
((SIZE_BYTES >= JOBS * 64 << 20)) || die "SIZE=$SIZE: at least $((JOBS * 64))M (rand64m)"
[[ $RUNS =~ ^[1-9][0-9]*$ && $RUNTIME =~ ^[1-9][0-9]*$ ]] || die "RUNS and RUNTIME: positive integers"
[[ $COUNT =~ ^[0-9]+$ ]] || die "COUNT=$COUNT: a number of runs"
[[ $TARGET == sparse || $TARGET == data ]] || die "TARGET=$TARGET: sparse or data"
[[ -x $LIGHTFOOT ]] || die "no lightfoot binary at $LIGHTFOOT: cargo build --release, or set LIGHTFOOT="
LIGHTFOOT=$(realpath -- "$LIGHTFOOT")
for t in fio perf python3; do command -v $t >/dev/null || die "$t is missing"; done

mkdir -p -- "$DIR/logs"
DIR=$(realpath -- "$DIR")
exec 9>"$DIR/.lock"
flock -n 9 || die "another coalesce.sh is running in $DIR"
FILE=$DIR/disk.img
SOCK=$DIR/nbd.sock
PIDF=$DIR/server.pid
CSV=$DIR/results.csv
URI="nbd+unix:///?socket=$SOCK"
((${#SOCK} < 100)) || die "$SOCK: too long for a Unix socket path"
rm -f -- "$DIR"/logs/*
echo "round,workload,config,traced,iops,client_writes,flushes,backend_writes,lightfoot_backend_writes,steal_pct,write_us,flush_us,error" >"$CSV"

# shellcheck source=steal.sh
. "$HERE/steal.sh"

config_name() {
	case $1 in
	lightfoot) echo "lightfoot" ;;
	coalesce) echo "lightfoot --coalesce" ;;
	coalesce-[0-9]*[KM]) echo "lightfoot --coalesce --coalesce-block ${1#coalesce-}" ;;
	nbdkit-none) echo "nbdkit file cache=none" ;;
	qemu-none) echo "qemu-nbd --cache=none" ;;
	nbdkit) echo "nbdkit file (page cache)" ;;
	memory) echo "nbdkit memory (no storage)" ;;
	null) echo "nbdkit null (discards: the client's bound)" ;;
	*) return 1 ;;
	esac
}

server_cmd() {
	local lf=("$LIGHTFOOT" serve --unix "$SOCK" --pid-file "$PIDF")
	case $1 in
	lightfoot) SCMD=("${lf[@]}" "$FILE") ;;
	# shellcheck disable=SC2086 # COALESCE_ARGS: words
	coalesce) SCMD=("${lf[@]}" --coalesce --stats --json $COALESCE_ARGS "$FILE") ;;
	# shellcheck disable=SC2086 # COALESCE_ARGS: words
	coalesce-*) SCMD=("${lf[@]}" --coalesce --stats --json $COALESCE_ARGS --coalesce-block "${1#coalesce-}" "$FILE") ;;
	nbdkit-none) SCMD=(nbdkit -f -U "$SOCK" -P "$PIDF" file "$FILE" cache=none) ;;
	qemu-none) SCMD=(qemu-nbd -f raw -e "$JOBS" -t -k "$SOCK" --pid-file="$PIDF" --cache=none "$FILE") ;;
	nbdkit) SCMD=(nbdkit -f -U "$SOCK" -P "$PIDF" file "$FILE") ;;
	memory) SCMD=(nbdkit -f -U "$SOCK" -P "$PIDF" memory "$SIZE_BYTES") ;;
	null) SCMD=(nbdkit -f -U "$SOCK" -P "$PIDF" null "$SIZE_BYTES") ;;
	esac
}

client_cmd() {
	local fio=(fio --name="$1" --ioengine=nbd --uri="$URI" --numjobs="$JOBS" --iodepth=1
		--runtime="$RUNTIME" --time_based --group_reporting --eta=never --fsync="$FSYNC"
		--end_fsync=1 --output-format=json --output="$2")
	local quarter=$((SIZE_BYTES / JOBS))
	case $1 in
	strided) CMD=("${fio[@]}" --rw=write:3k --bs=1k --size="$quarter" --offset_increment="$quarter") ;;
	rand64m) CMD=("${fio[@]}" --rw=randwrite --bs=1k --size=64m --offset_increment=64m) ;;
	randall) CMD=("${fio[@]}" --rw=randwrite --bs=1k) ;;
	rand4k) CMD=("${fio[@]}" --rw=randwrite --bs=4k) ;;
	*) return 1 ;;
	esac
}

read -r -a CONFIG_KEYS <<<"${CONFIGS//,/ }"
read -r -a WORKLOAD_KEYS <<<"${WORKLOADS//,/ }"
for k in "${CONFIG_KEYS[@]}"; do config_name "$k" >/dev/null || die "CONFIGS: unknown $k"; done
for k in "${WORKLOAD_KEYS[@]}"; do client_cmd "$k" x || die "WORKLOADS: unknown $k"; done

prepare_file() {
	if [[ $TARGET == sparse ]]; then
		rm -f -- "$FILE"
		truncate -s "$SIZE_BYTES" -- "$FILE"
	elif [[ ! -f $FILE || $(stat -c %s -- "$FILE") != "$SIZE_BYTES" || ! -f $FILE.data ]]; then
		say "writing $FILE: $SIZE of random data (TARGET=data)"
		rm -f -- "$FILE" "$FILE.data"
		dd if=/dev/urandom of="$FILE" bs=1M iflag=fullblock,count_bytes count="$SIZE_BYTES" status=none
		touch -- "$FILE.data"
	fi
	sync -- "$FILE"
	[[ $DROP == 0 ]] || echo 3 >/proc/sys/vm/drop_caches
}

SERVER_PID=""
REAL_PID=""
cleanup() {
	[[ -z $REAL_PID ]] || kill -KILL "$REAL_PID" 2>/dev/null || true
	[[ -z $SERVER_PID ]] || kill -KILL "$SERVER_PID" 2>/dev/null || true
	wait 2>/dev/null || true
}
trap cleanup EXIT

# start_server KEY LOG [PERF_OUT]: with PERF_OUT, the server runs under `perf stat`, which
# counts the file writes of all its threads (inherited); SERVER_PID is perf's then, REAL_PID
# always the server's.
start_server() {
	rm -f -- "$SOCK" "$PIDF"
	server_cmd "$1"
	echo "+ ${SCMD[*]}" >"$2"
	if [[ -n ${3:-} ]]; then
		perf stat -x, -o "$3" -e syscalls:sys_enter_pwrite64,syscalls:sys_enter_pwritev,syscalls:sys_enter_pwritev2 \
			-- "${SCMD[@]}" >>"$2" 2>&1 &
	else
		"${SCMD[@]}" >>"$2" 2>&1 &
	fi
	SERVER_PID=$!
	local i
	for ((i = 0; i < 200; i++)); do
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
	[[ -z $REAL_PID ]] || kill -TERM "$REAL_PID" 2>/dev/null || true
	local i
	for ((i = 0; i < 600; i++)); do
		kill -0 "$SERVER_PID" 2>/dev/null || break
		sleep 0.1
	done
	[[ -z $REAL_PID ]] || kill -KILL "$REAL_PID" 2>/dev/null || true
	kill -KILL "$SERVER_PID" 2>/dev/null || true
	wait "$SERVER_PID" 2>/dev/null || true
	SERVER_PID=""
	rm -f -- "$SOCK" "$PIDF"
}

# One run (ROUND: a number, timed; or cN, the Nth counting run, traced): prints nothing,
# appends a CSV line.
run_one() {
	local round=$1 w=$2 c=$3 base=$DIR/logs/$2-$3-$1 traced=0 perf=""
	[[ $round != c* ]] || { traced=1 perf=$base.perf; }
	prepare_file
	REAL_PID=""
	if ! start_server "$c" "$base.server" $perf; then
		echo "$round,$w,$c,$traced,,,,,,,,,server did not start" >>"$CSV"
		stop_server
		return
	fi
	client_cmd "$w" "$base.fio"
	local err="" mark
	mark=$(steal_mark)
	timeout $((RUNTIME * 3 + 300)) "${CMD[@]}" >"$base.client" 2>&1 || err="client failed"
	local steal
	steal=$(steal_pct "$mark")
	# The client's last flush (end_fsync) wrote everything back: the count at exit covers the
	# run only.
	stop_server
	python3 - "$round" "$w" "$c" "$traced" "$base.fio" "$base.perf" "$base.server" "$steal" "$err" >>"$CSV" <<'EOF'
import json, sys
rnd, w, c, traced, fio, perf, server, steal, err = sys.argv[1:]
iops = writes = syncs = backend = lf = wlat = flat = ""
try:
    text = open(fio).read()
    job = json.loads(text[text.index("{"):])["jobs"][0]
    iops = f'{job["write"]["iops"]:.1f}'
    writes = job["write"]["total_ios"]
    syncs = job.get("sync", {}).get("total_ios", "")
    # Mean latencies as the client sees them: a write's round trip, a FLUSH's.
    wlat = f'{job["write"]["lat_ns"]["mean"] / 1e3:.1f}'
    if syncs:
        flat = f'{job["sync"]["lat_ns"]["mean"] / 1e3:.1f}'
    if job.get("error"):
        err = err or f'fio error {job["error"]}'
except (OSError, ValueError, KeyError) as e:
    err = err or "fio output unparsable"
try:
    n = 0
    for line in open(perf) if traced == "1" else ():
        f = line.strip().split(",")
        if len(f) > 2 and f[2].startswith("syscalls:") and f[0].isdigit():
            n += int(f[0])
    backend = n if traced == "1" else ""
except OSError:
    pass
try:
    for line in open(server):
        if line.startswith("{") and '"coalesce"' in line:
            lf = json.loads(line)["coalesce"]["backend_writes"]
except (OSError, ValueError, KeyError):
    pass
print(f"{rnd},{w},{c},{traced},{iops},{writes},{syncs},{backend},{lf},{steal},{wlat},{flat},{err}")
EOF
	tail -n 1 "$CSV" | sed 's/^/   /' >&2
}

# sweep N WHAT PREFIX: N rounds of every workload against every server; rounds named
# PREFIX1.. (a "c" prefix makes them counting runs, see run_one). Each round starts one server
# further down the list (round 2 with the second, ...), so that no server always runs first
# or right after the same one: in probe runs of one server alone, the first of three
# back-to-back runs was the slowest four times in a row once, and the fastest in another hour.
sweep() {
	local n=$1 what=$2 prefix=$3 r w c i nc=${#CONFIG_KEYS[@]}
	for ((r = 1; r <= n; r++)); do
		for w in "${WORKLOAD_KEYS[@]}"; do
			for ((i = 0; i < nc; i++)); do
				c=${CONFIG_KEYS[$(((i + r - 1) % nc))]}
				say "$what $r/$n: $w, $(config_name "$c")"
				run_one "$prefix$r" "$w" "$c"
			done
		done
	done
}
sweep "$COUNT" "counting run (traced, not timed)" c
sweep "$RUNS" round ""

# The table names the servers as config_name does: key, a tab and the name, a line each.
NAMES=$(for k in "${CONFIG_KEYS[@]}"; do printf '%s\t%s\n' "$k" "$(config_name "$k")"; done)
python3 - "$CSV" "$CONFIGS" "$QUIET" "$NAMES" "$JOBS" "$FSYNC" <<'EOF' | tee "$DIR/table.md"
import csv, statistics, sys
JOBS, FSYNC = int(sys.argv[5]), int(sys.argv[6])
rows = list(csv.DictReader(open(sys.argv[1])))
names = dict(line.split("\t", 1) for line in sys.argv[4].splitlines())
quiet = float(sys.argv[3])
def steal(r):
    v = r.get("steal_pct")
    return None if v in ("", None) else float(v)
def med(xs):
    xs = [float(x) for x in xs if x not in ("", None)]
    return statistics.median(xs) if xs else None
def per_write(rs, col):
    return med(float(r[col]) / float(r["client_writes"]) for r in rs
               if r[col] and r["client_writes"] and float(r["client_writes"]) > 0)
def fmt(x, f):
    return "-" if x is None else format(x, f)
print("\nIOPS and ratios from the timed rounds (untraced); backend writes from the counting runs "
      "(perf stat on the write syscalls); lightfoot's own count (--stats) from every run.")
for w in dict.fromkeys(r["workload"] for r in rows):
    print(f"\n### {w} (fio nbd, 4 jobs x iodepth 1, flush every 64 writes)\n")
    print(f"| server | IOPS | × lightfoot | × lightfoot, same round | same round, middle half "
          f"| same round, quiet rounds (steal < {quiet:g} %) "
          "| backend writes / client write | lightfoot's own count | write µs | FLUSH µs "
          "| host steal % | failed runs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    timed = [r for r in rows if r["workload"] == w and r["traced"] == "0"]
    base = med(r["iops"] for r in timed if r["config"] == "lightfoot" and not r["error"])
    # Per round, against the plain server's run of the same round: less exposed to slow drifts.
    plain = {r["round"]: float(r["iops"]) for r in timed
             if r["config"] == "lightfoot" and not r["error"] and r["iops"]}
    plain_steal = {r["round"]: steal(r) for r in timed if r["config"] == "lightfoot"}
    for c in sys.argv[2].replace(",", " ").split():
        rs = [r for r in timed if r["config"] == c]
        ok = [r for r in rs if not r["error"]]
        counted = [r for r in rows if r["workload"] == w and r["config"] == c and r["traced"] == "1"
                   and not r["error"]]
        mine = [r for r in rows if r["workload"] == w and r["config"] == c and not r["error"]]
        iops = med(r["iops"] for r in ok)
        ratio = f"{iops / base:.2f}" if iops and base else "-"
        rounds = [float(r["iops"]) / plain[r["round"]] for r in ok if r["iops"] and plain.get(r["round"])]
        paired = med(rounds)
        # First to third quartile of the per-round ratios: how far one round goes on its own.
        spread = "-"
        if len(rounds) >= 2:
            q1, _, q3 = statistics.quantiles(rounds, n=4)
            spread = f"{q1:.2f}-{q3:.2f}"
        calm = [float(r["iops"]) / plain[r["round"]] for r in ok if r["iops"] and plain.get(r["round"])
                and steal(r) is not None and plain_steal.get(r["round"]) is not None
                and max(steal(r), plain_steal[r["round"]]) < quiet]
        calm = f"{statistics.median(calm):.2f} ({len(calm)})" if calm else "-"
        st = [steal(r) for r in rs if steal(r) is not None]
        st = f"{statistics.median(st):.0f} (max {max(st):.0f})" if st else "-"
        failed = len(rs) - len(ok)
        print(f"| {names[c]} | {fmt(iops, '.0f')} | {ratio} | {fmt(paired, '.2f')} | {spread} | {calm} "
              f"| {fmt(per_write(counted, 'backend_writes'), '.3f')} "
              f"| {fmt(per_write(mine, 'lightfoot_backend_writes'), '.3f')} "
              f"| {fmt(med(r['write_us'] for r in ok), '.0f')} | {fmt(med(r['flush_us'] for r in ok), '.0f')} "
              f"| {st} | {failed} |")
    # A job's cycle is 64 writes and a FLUSH, one after another. Strided, a server that
    # answered writes as fast as `nbdkit null` (which keeps nothing) and FLUSHed as fast as the
    # plain server (whose FLUSH makes the same 4 KiB blocks durable: each holds 1 KiB written
    # and is allocated whole either way) would reach this, from this run's medians: a model
    # of what holding writes can give, not a proof. Random writes are left out: there a
    # server that holds them has more to do at the FLUSH than one that wrote them as they came.
    wnull = med(r["write_us"] for r in timed if r["config"] == "null" and not r["error"])
    fplain = med(r["flush_us"] for r in timed if r["config"] == "lightfoot" and not r["error"])
    if w == "strided" and wnull and fplain and base:
        model = JOBS * FSYNC / ((FSYNC * wnull + fplain) / 1e6)
        print(f"\nModel: `nbdkit null`'s write ({wnull:.0f} µs) and the plain server's FLUSH "
              f"({fplain:.0f} µs) for every {FSYNC} writes: {model:.0f} IOPS, "
              f"{model / base:.2f}× lightfoot.")
EOF
