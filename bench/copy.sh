#!/usr/bin/env bash
# copy.sh: how fast does a file copy run, and what does it leave in the page cache?
#
# Copies one sparse source file with lightfoot (in several cache modes), with the usual
# peers (cp, nbdcopy, nocache, dd, qemu-img) and with a short RWF_DONTCACHE loop that
# serves as the yardstick (dontcache_loop.c), then prints a table of medians.
#
# Usage (as root: it drops caches):
#     bench/copy.sh [DIR]
#     SIZE=256M RUNS=1 WORKSET=64M bench/copy.sh          # smoke test
#
# Environment:
#     SIZE       size of the source file (default 4G; K, M, G suffixes, powers of 1024)
#     RUNS       rounds; each round runs every job once, in a fixed order (default 5)
#     WORKSET    bytes at the start of the source re-read before each run as the "working
#                set" the copy should leave alone (default 512M; a multiple of 2M)
#     DIR        work directory: source, destination, logs, results (default: the first
#                argument, else /work/tmp/bench). Needs 2 x SIZE free.
#     HOLES      1: the source alternates 64 MiB of data and 64 MiB holes (sparse-aware
#                tools then write half as much as the reference loop); 0 (default): all data
#     ONLY       an extended regex: run only the jobs whose name matches (default: all)
#     LIGHTFOOT  the binary to test (default ../target/release/lightfoot beside this script)
#
# Each run: remove the destination; sync; drop caches; read the working set with buffered dd;
# evict the readahead that dd left past it (so the job starts with exactly the working set
# cached); run the job under /usr/bin/time; right after, read the page-cache figures of the
# source and destination with `lightfoot cache stat`; only then compare DST with SRC (cmp
# fills the cache; the next run drops it again). A control job that only sleeps shows what
# the VM's background paging does to the working set in the same time.
#
# Output: the table on stdout and in DIR/table.md, every run in DIR/results.csv, each job's
# output in DIR/logs/. Peers that are not installed are reported as MISSING and skipped.
# See bench/README.md for the columns. Do not read absolute times across runs of this script:
# on these VMs only ratios within one run mean anything.
set -euo pipefail
export LC_ALL=C # EPOCHREALTIME and number formats

die() { echo "copy.sh: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }

HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)

[[ $EUID -eq 0 ]] || die "run as root (it writes /proc/sys/vm/drop_caches)"
(($# <= 1)) || die "usage: copy.sh [DIR]"

SIZE=${SIZE:-4G}
RUNS=${RUNS:-5}
WORKSET=${WORKSET:-512M}
DIR=${DIR:-${1:-/work/tmp/bench}}
LIGHTFOOT=${LIGHTFOOT:-$HERE/../target/release/lightfoot}

MiB=$((1 << 20))
CHUNK=$((64 * MiB)) # source layout: 64 MiB of data, 64 MiB hole, 64 MiB of data, ...

to_bytes() { numfmt --from=iec -- "$1" 2>/dev/null || die "$2=$1: not a size (e.g. 512M, 4G)"; }
SIZE_BYTES=$(to_bytes "$SIZE" SIZE)
WS_BYTES=$(to_bytes "$WORKSET" WORKSET)
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || die "RUNS=$RUNS: not a positive integer"
((WS_BYTES > 0 && WS_BYTES % (2 * MiB) == 0)) ||
	die "WORKSET=$WORKSET: must be a positive multiple of 2M (eviction works on 2 MiB folios)"
((WS_BYTES < SIZE_BYTES)) || die "WORKSET=$WORKSET must be smaller than SIZE=$SIZE"

[[ -x $LIGHTFOOT ]] ||
	die "lightfoot binary not found at $LIGHTFOOT: build it (cargo build --release) or set LIGHTFOOT="
LIGHTFOOT=$(realpath -- "$LIGHTFOOT")
command -v python3 >/dev/null || die "python3 is needed to parse results"
[[ -x /usr/bin/time ]] || die "/usr/bin/time is needed for peak RSS (apt-get install time)"

mkdir -p -- "$DIR" "$DIR/logs"
DIR=$(realpath -- "$DIR")
exec 9>"$DIR/.lock"
flock -n 9 || die "another copy.sh is running in $DIR"

SRC=$DIR/src.img
DST=$DIR/dst.img
REF=$DIR/dontcache_loop
CSV=$DIR/results.csv
TIME_OUT=$DIR/time.out
rm -f -- "$DST" "$DIR"/logs/*.log

# Room for the source (about half of it allocated) and a destination (cp, dd and the loop
# allocate all of it).
need=$((SIZE_BYTES * 2))
[[ -e $SRC ]] && need=$((SIZE_BYTES))
avail=$(($(stat -f -c '%a * %S' -- "$DIR")))
((avail > need)) || die "$DIR: $((avail / MiB)) MiB free, need $((need / MiB)) MiB"

# --- the source: made once, reused while SIZE and the layout stay the same --------------

HOLES=${HOLES:-0}
[[ $HOLES == 0 || $HOLES == 1 ]] || die "HOLES=$HOLES: 0 or 1"
STRIDE=$((HOLES ? 2 * CHUNK : CHUNK))
LAYOUT="size=$SIZE_BYTES data/hole=$CHUNK holes=$HOLES"
if [[ -f $SRC && -f $SRC.layout && $(<"$SRC.layout") == "$LAYOUT" ]]; then
	say "reusing $SRC ($LAYOUT)"
else
	if ((HOLES)); then
		say "writing $SRC: $SIZE, alternating $((CHUNK / MiB)) MiB of random data and holes"
	else
		say "writing $SRC: $SIZE of random data"
	fi
	rm -f -- "$SRC" "$SRC.layout"
	truncate -s "$SIZE_BYTES" -- "$SRC"
	for ((off = 0; off < SIZE_BYTES; off += STRIDE)); do
		len=$((SIZE_BYTES - off < CHUNK ? SIZE_BYTES - off : CHUNK))
		# SIZE need not be a multiple of 1 MiB: write in bytes.
		dd if=/dev/urandom of="$SRC" bs=1M iflag=fullblock,count_bytes \
			oflag=seek_bytes seek="$off" count="$len" conv=notrunc status=none
	done
	sync -- "$SRC"
	echo "$LAYOUT" >"$SRC.layout"
fi
[[ $(stat -c %s -- "$SRC") == "$SIZE_BYTES" ]] || die "$SRC: wrong size"

# --- the yardstick -----------------------------------------------------------------------

REF_OK=0
if ! command -v gcc >/dev/null; then
	:
elif gcc -O2 -Wall -Wextra -o "$REF" "$HERE/dontcache_loop.c"; then
	REF_OK=1
else
	die "dontcache_loop.c did not compile"
fi

# --- the jobs ------------------------------------------------------------------------------

# stat -f calls ext4 "ext2/ext3": ask findmnt first.
FSTYPE=$(findmnt -no FSTYPE -T "$DIR" 2>/dev/null || stat -f -c %T -- "$DIR")

LOOP_JOB="dontcache_loop (reference)"
CONTROL_JOB="sleep (control)"
JOBS=(
	"lightfoot"
	"lightfoot --no-dontcache"
	"lightfoot --cache=keep"
	"lightfoot --cache=drop"
	"lightfoot --cache=direct"
	"cp + sync"
	"nbdcopy --flush"
	"nbdcopy --flush --request-size=4194304"
	"nocache cp + sync"
	"dd nocache fdatasync"
	"qemu-img convert -T none -t none"
	"$LOOP_JOB"
	"$CONTROL_JOB"
)
# ONLY: an extended regex; only jobs whose name matches run (keep the reference loop,
# nbdcopy --flush and the control in it: the ratios and the working-set figure need them).
if [[ -n ${ONLY:-} ]]; then
	kept=()
	for job in "${JOBS[@]}"; do
		[[ $job =~ $ONLY ]] && kept+=("$job")
	done
	((${#kept[@]} > 0)) || die "ONLY=$ONLY matches no job"
	JOBS=("${kept[@]}")
fi

# The program a job needs, for the MISSING check.
job_tool() {
	case $1 in
	lightfoot*) echo lightfoot ;;
	"cp + sync") echo cp ;;
	nbdcopy*) echo nbdcopy ;;
	nocache*) echo nocache ;;
	dd*) echo dd ;;
	qemu-img*) echo qemu-img ;;
	"$LOOP_JOB") echo gcc ;;
	"$CONTROL_JOB") echo sleep ;;
	*) die "no tool for job $1" ;;
	esac
}

tool_present() {
	case $1 in
	lightfoot) true ;;
	gcc) ((REF_OK)) ;;
	*) command -v "$1" >/dev/null ;;
	esac
}

# Sets CMD to the command line of job $1. Jobs that do not make DST durable themselves get
# the flush a fair comparison needs (KERNEL-NOTES, "Peers measured here"): `sync FILE` is an
# fsync of DST, the same promise lightfoot and the loop make. Single commands run directly
# (not under a shell) so that peak RSS is theirs.
job_cmd() {
	case $1 in
	"lightfoot") CMD=("$LIGHTFOOT" copy "$SRC" "$DST") ;;
	"lightfoot --no-dontcache") CMD=(env LIGHTFOOT_NO_DONTCACHE=1 "$LIGHTFOOT" copy "$SRC" "$DST") ;;
	"lightfoot --cache=keep") CMD=("$LIGHTFOOT" copy --cache=keep "$SRC" "$DST") ;;
	"lightfoot --cache=drop") CMD=("$LIGHTFOOT" copy --cache=drop "$SRC" "$DST") ;;
	"lightfoot --cache=direct") CMD=("$LIGHTFOOT" copy --cache=direct "$SRC" "$DST") ;;
	"cp + sync") CMD=(sh -c 'cp -- "$1" "$2" && sync -- "$2"' sh "$SRC" "$DST") ;;
	"nbdcopy --flush") CMD=(nbdcopy --flush "$SRC" "$DST") ;;
	"nbdcopy --flush --request-size=4194304")
		CMD=(nbdcopy --flush --request-size=4194304 "$SRC" "$DST") ;;
	"nocache cp + sync") CMD=(sh -c 'nocache cp -- "$1" "$2" && sync -- "$2"' sh "$SRC" "$DST") ;;
	"dd nocache fdatasync")
		CMD=(dd if="$SRC" of="$DST" bs=4M iflag=nocache oflag=nocache conv=fdatasync status=none) ;;
	"qemu-img convert -T none -t none")
		CMD=(qemu-img convert -f raw -O raw -T none -t none "$SRC" "$DST") ;;
	"$LOOP_JOB") CMD=("$REF" "$SRC" "$DST") ;;
	"$CONTROL_JOB") CMD=(sleep "$(control_seconds)") ;;
	*) die "no command for job $1" ;;
	esac
}

# The control sleeps as long as lightfoot's default copy has taken so far (median), so that
# its working-set figure is what background paging alone does in that time; 4 s before any
# lightfoot run has succeeded.
LIGHTFOOT_WALLS=()
control_seconds() {
	if ((${#LIGHTFOOT_WALLS[@]} == 0)); then
		echo 4
	else
		printf '%s\n' "${LIGHTFOOT_WALLS[@]}" | sort -g |
			awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
	fi
}

# --- measuring -----------------------------------------------------------------------------

# Prints the `lightfoot cache stat --json` array for one range of files, or [] on failure
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

echo "round,job,status,exit,wall_s,peak_rss_kib,ws_bytes,ws_cached_before,src_beyond_before,ws_cached,src_beyond,dst_cached,dst_dirty_pages,dst_writeback_pages,cmp" >"$CSV"

csv_row() {
	local IFS=,
	echo "$*" >>"$CSV"
}

FAILURES=0

# run_one ROUND JOB: one cold run, one CSV row.
run_one() {
	local round=$1 job=$2
	local slug
	slug=$(tr -cs 'A-Za-z0-9=.-' _ <<<"$job")
	slug=${slug%_}
	local log=$DIR/logs/$round-$slug.log

	rm -f -- "$DST"
	sync
	echo 3 >/proc/sys/vm/drop_caches
	dd if="$SRC" of=/dev/null bs=1M count=$((WS_BYTES / MiB)) status=none
	# dd's readahead ran up to read_ahead_kb past the working set: drop that, so the job
	# starts with exactly the working set cached.
	"$LIGHTFOOT" cache evict --range "$WS_BYTES:" "$SRC" >/dev/null
	local before_ws before_beyond
	before_ws=$(cache_json "0:$WS_BYTES" "$SRC")
	before_beyond=$(cache_json "$WS_BYTES:" "$SRC")

	job_cmd "$job"
	local t0 t1 rc=0
	t0=$EPOCHREALTIME
	/usr/bin/time -f %M -o "$TIME_OUT" "${CMD[@]}" >"$log" 2>&1 || rc=$?
	t1=$EPOCHREALTIME

	# Measure at once: background paging starts eating idle cache within seconds.
	local after_ws after_beyond after_dst="[]"
	after_ws=$(cache_json "0:$WS_BYTES" "$SRC")
	after_beyond=$(cache_json "$WS_BYTES:" "$SRC")
	[[ -e $DST ]] && after_dst=$(cache_json "0:" "$DST")

	# EPOCHREALTIME always has 6 decimals: drop the dot for microseconds.
	local wall_us=$((${t1/./} - ${t0/./}))
	local wall
	wall=$(printf '%d.%06d' $((wall_us / 1000000)) $((wall_us % 1000000)))
	local rss
	rss=$(tail -n 1 -- "$TIME_OUT")
	[[ $rss =~ ^[0-9]+$ ]] || rss=""

	local s
	read -r -a s <<<"$(parse_stats "$before_ws" "$before_beyond" "$after_ws" "$after_beyond" "$after_dst")"
	# s: ws_before(cached dirty wb) beyond_before(...) ws(...) beyond(...) dst(...)

	# Correctness, only now that the cache figures are taken.
	local status=ok cmp_result=n/a
	if ((rc != 0)); then
		status=failed
		echo "!!! FAILED: round $round, $job exited with $rc; see $log:" >&2
		tail -n 5 -- "$log" | sed 's/^/!!!   /' >&2
	elif [[ $job != "$CONTROL_JOB" ]]; then
		if [[ ! -e $DST ]]; then
			cmp_result=missing
		elif cmp -s -- "$SRC" "$DST"; then
			cmp_result=same
		else
			cmp_result=DIFFERENT
		fi
		if [[ $cmp_result != same ]]; then
			status=mismatch
			echo "!!! MISMATCH: round $round, $job: DST $cmp_result from SRC (cmp $SRC $DST)" >&2
		fi
	fi
	[[ $status == ok ]] || FAILURES=$((FAILURES + 1))
	[[ $job == lightfoot && $status == ok ]] && LIGHTFOOT_WALLS+=("$wall")

	csv_row "$round" "\"$job\"" "$status" "$rc" "$wall" "$rss" "$WS_BYTES" \
		"${s[0]}" "${s[3]}" "${s[6]}" "${s[9]}" "${s[12]}" "${s[13]}" "${s[14]}" "$cmp_result"
	printf '   %-42s %8.2f s  %s\n' "$job" "$wall" "$status" >&2
	rm -f -- "$DST"
}

# --- the rounds ----------------------------------------------------------------------------

MISSING=()
for job in "${JOBS[@]}"; do
	tool=$(job_tool "$job")
	if ! tool_present "$tool"; then
		echo "MISSING: $tool (job \"$job\" is skipped)" >&2
		MISSING+=("$job")
	fi
done
is_missing() {
	local m
	for m in "${MISSING[@]}"; do [[ $m == "$1" ]] && return 0; done
	return 1
}

say "$RUNS round(s) of ${#JOBS[@]} jobs: SIZE=$SIZE WORKSET=$WORKSET DIR=$DIR ($FSTYPE)"
for ((round = 1; round <= RUNS; round++)); do
	say "round $round/$RUNS"
	for job in "${JOBS[@]}"; do
		if is_missing "$job"; then
			csv_row "$round" "\"$job\"" "missing:$(job_tool "$job")" "" "" "" "$WS_BYTES" "" "" "" "" "" "" "" ""
			printf '   %-42s MISSING: %s\n' "$job" "$(job_tool "$job")" >&2
			continue
		fi
		run_one "$round" "$job"
	done
done
rm -f -- "$TIME_OUT"

# --- the table -----------------------------------------------------------------------------

rev=$(git -C "$HERE/.." describe --always --dirty 2>/dev/null || echo unknown)
python3 "$HERE/summarize.py" "$CSV" "$DIR/table.md" \
	"SIZE=$SIZE, WORKSET=$WORKSET, RUNS=$RUNS; $(uname -r), $FSTYPE in $DIR; lightfoot $rev; $(date -u +'%Y-%m-%d %H:%M UTC')"
say "raw runs: $CSV; table: $DIR/table.md; job output: $DIR/logs/"
if ((FAILURES > 0)); then
	echo "!!! $FAILURES run(s) failed or produced a different destination: see the lines marked !!! above" >&2
	exit 1
fi
