#!/usr/bin/env bash
# ab.sh: does a new lightfoot binary run as fast as an old one? An A/B of two builds, on the
# existing benchmarks, with the binaries alternating in the same run.
#
# For each benchmark named, ROUNDS rounds; each round runs the benchmark script once with
# each binary (RUNS=1, LIGHTFOOT=old, then new; the order swaps every other round, so a
# machine that drifts hits both alike), only lightfoot's own jobs (no peers: an A/B needs
# none), each invocation in its own directory. Then one table per benchmark: per job (and
# workload), the median of old, of new, and "new rel. old" (new / old for throughputs,
# old / new for times: above 1 always means new is better), with the median and range of
# the same ratio taken round by round. Ratios below BAR (0.95) are marked.
#
#   benchmark  script                  jobs compared
#   copy       copy.sh                 ONLY='^lightfoot': lightfoot, --no-dontcache,
#                                      --cache=keep, --cache=drop, --cache=direct
#   serve      serve.sh                CONFIGS="lightfoot lightfoot-keep" x the 4 workloads
#   prefetch   serve.sh PRESET=prefetch  CONFIGS="lightfoot lightfoot-prefetch lightfoot-direct
#                                      lightfoot-direct-prefetch" x its 4 workloads
#   coalesce   coalesce.sh             CONFIGS="lightfoot coalesce" x the 4 workloads, COUNT=0
#   nbd        nbd.sh                  TOOLS=lightfoot x the 4 transfers (with SERVER=lightfoot
#                                      the server is the binary under test too)
#
# Usage (as root: the scripts drop caches):
#     OLD=/path/old-lightfoot NEW=/path/new-lightfoot bench/ab.sh copy serve ...
#     OLD=a NEW=b ROUNDS=1 SIZE=256M WORKSET=64M RUNTIME=2 bench/ab.sh copy coalesce  # smoke
#
# Environment:
#     OLD, NEW   the two binaries (required; copied into DIR/bin first, so a rebuild during
#                the run changes nothing). The same binary twice is an A/A run: the noise.
#     ROUNDS     rounds (default 5); each runs every benchmark once per binary
#     DIR        work directory (default /work/tmp/bench-ab): DIR/BENCH/rNN-old|new/ per
#                invocation (its results, logs and ab.log, the script's output), the tables in
#                DIR/ab.md, the invocations in DIR/ab-runs.csv. Kept short: serve.sh and
#                coalesce.sh put a Unix socket in there.
#     BAR        the acceptance bar for new rel. old (default 0.95)
#     anything else goes to the scripts as it is: SIZE, WORKSET, RUNTIME, TARGET, WORKLOADS,
#     HOLES, TRANSFERS, SERVER, DROP, COALESCE_ARGS, LIGHTFOOT_ARGS, ... (RUNS, LIGHTFOOT and
#     DIR are set here). A variable prefixed with a benchmark's name in capitals applies to
#     that benchmark alone and wins over the plain one: SERVE_WORKLOADS=randread,
#     PREFETCH_CONFIGS=..., COALESCE_WORKLOADS=strided, COPY_ONLY=..., NBD_TRANSFERS=...
#     (needed when several benchmarks are run whose keys differ, as CONFIGS do). Defaults
#     that differ from the scripts': the CONFIGS/ONLY/TOOLS above; coalesce COUNT=0 (no traced
#     counting runs); nbd VERIFY=first in round 1 and none after (each invocation is its
#     script's round 1).
#
# The generated data is made once and shared: before each invocation the script's source
# files (copy: src.img; serve, prefetch: src.img, and dst.img with TARGET=data; coalesce:
# disk.img with TARGET=data; nbd: half.img, rand.img), with the .layout file by which the
# script recognises them, are hard-linked from DIR/.seed-SCRIPT/ into the invocation's
# directory; the script reuses them when SIZE (and the layout) match, as it does in its own
# DIR, and after it ran, whatever it (re)made becomes the seed.
#
# Output: the tables on stdout and in DIR/ab.md (bench/summarize_ab.py DIR redoes them).
# Failed runs (the scripts mark them: copy/serve status, coalesce error, nbd.sh stopping) are
# listed and left out of the medians. Exit status: 1 if any run or invocation failed, 2 if
# a ratio is below BAR (or has no data), else 0. As with every benchmark here, only ratios
# within one run mean anything; an A/A run (OLD = NEW) shows how far they stray by chance.
set -euo pipefail
export LC_ALL=C

die() { echo "ab.sh: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }

HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
[[ $EUID -eq 0 ]] || die "run as root (the benchmarks drop caches)"
(($# >= 1)) || die "usage: OLD=BIN NEW=BIN [ROUNDS=5] bench/ab.sh copy|serve|prefetch|coalesce|nbd ..."

[[ -n ${OLD:-} && -n ${NEW:-} ]] || die "set OLD= and NEW= to the two lightfoot binaries"
[[ -x $OLD ]] || die "OLD=$OLD: not an executable"
[[ -x $NEW ]] || die "NEW=$NEW: not an executable"
ROUNDS=${ROUNDS:-5}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS: not a positive integer"
BAR=${BAR:-0.95}
[[ $BAR =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "BAR=$BAR: not a number"
DIR=${DIR:-/work/tmp/bench-ab}
command -v python3 >/dev/null || die "python3 is needed"

BENCHES=()
for b in "$@"; do
	case $b in
	copy | serve | prefetch | coalesce | nbd) ;;
	*) die "unknown benchmark $b (copy, serve, prefetch, coalesce, nbd)" ;;
	esac
	[[ " ${BENCHES[*]} " == *" $b "* ]] || BENCHES+=("$b")
done

mkdir -p -- "$DIR"
DIR=$(realpath -- "$DIR")
exec 8>"$DIR/.lock"
flock -n 8 || die "another ab.sh is running in $DIR"

# The binaries, frozen: cargo may overwrite target/release/lightfoot while this runs.
mkdir -p -- "$DIR/bin"
install -m 755 -- "$OLD" "$DIR/bin/old"
install -m 755 -- "$NEW" "$DIR/bin/new"
describe() { # SIDE PATH
	local sum ver
	sum=$(sha256sum -- "$DIR/bin/$1" | cut -c1-12)
	ver=$("$DIR/bin/$1" --version 2>/dev/null | head -n 1) || true
	echo "$2 (sha256 $sum, ${ver:-no --version})"
}
OLD_DESC=$(describe old "$OLD")
NEW_DESC=$(describe new "$NEW")
SAME=""
cmp -s -- "$DIR/bin/old" "$DIR/bin/new" && SAME=" (the same binary: an A/A run)"

# shellcheck source=steal.sh
. "$HERE/steal.sh"

script_of() {
	case $1 in
	copy) echo copy.sh ;;
	serve | prefetch) echo serve.sh ;;
	coalesce) echo coalesce.sh ;;
	nbd) echo nbd.sh ;;
	esac
}
csv_of() { [[ $1 == nbd ]] && echo nbd.csv || echo results.csv; }

# The data a script makes once and reuses while it matches: "FILE MARKER" pairs (the script
# reuses FILE when MARKER says it has the layout asked for).
shared_of() {
	case $1 in
	copy.sh) echo "src.img src.img.layout" ;;
	serve.sh) echo "src.img src.img.layout" "dst.img dst.img.layout" ;;
	coalesce.sh) echo "disk.img disk.img.data" ;;
	nbd.sh) echo "half.img half.img.layout" "rand.img rand.img.layout" ;;
	esac
}

# seed_in SCRIPT DIR: hard-link the seed's files into a fresh invocation directory.
seed_in() {
	local seed=$DIR/.seed-${1%.sh} f m
	while read -r f m; do
		[[ -f $seed/$f && -f $seed/$m ]] || continue
		ln -f -- "$seed/$f" "$2/$f"
		cp -f -- "$seed/$m" "$2/$m"
	done < <(shared_of "$1" | tr ' ' '\n' | paste - -)
}

# seed_out SCRIPT DIR: what the invocation left (made or reused) becomes the seed. A
# coalesce disk.img without its marker is a sparse target full of fio's writes: dropped.
seed_out() {
	local seed=$DIR/.seed-${1%.sh} f m
	mkdir -p -- "$seed"
	while read -r f m; do
		if [[ -f $2/$f && -f $2/$m ]]; then
			if ! [[ $2/$f -ef $seed/$f ]]; then
				ln -f -- "$2/$f" "$seed/$f"
			fi
			cp -f -- "$2/$m" "$seed/$m"
		elif [[ $1 == coalesce.sh ]]; then
			rm -f -- "${2:?}/$f"
		fi
	done < <(shared_of "$1" | tr ' ' '\n' | paste - -)
}

# invoke BENCH ROUND SIDE: one run of the benchmark's script with one binary. Appends a row
# to ab-runs.csv.
invoke() {
	local bench=$1 round=$2 side=$3 script rel dir up
	script=$(script_of "$bench")
	rel=$bench/r$(printf %02d "$round")-$side
	dir=$DIR/$rel
	up=${bench^^}
	rm -rf -- "$dir"
	mkdir -p -- "$dir"
	seed_in "$script" "$dir"
	say "$bench: round $round/$ROUNDS, $side ($script in $dir)"
	local t0 t1 mark steal rc=0
	mark=$(steal_mark)
	t0=$EPOCHREALTIME
	(
		set +e
		# BENCH_VAR wins over VAR for this benchmark.
		for v in $(compgen -e); do
			[[ $v == "${up}_"?* ]] && export "${v#"${up}_"}=${!v}"
		done
		export RUNS=1 LIGHTFOOT=$DIR/bin/$side DIR=$dir
		case $bench in
		copy) export ONLY=${ONLY:-^lightfoot} ;;
		serve)
			unset PRESET
			export CONFIGS=${CONFIGS:-lightfoot lightfoot-keep}
			;;
		prefetch)
			export PRESET=prefetch
			export CONFIGS=${CONFIGS:-lightfoot lightfoot-prefetch lightfoot-direct lightfoot-direct-prefetch}
			;;
		coalesce)
			export CONFIGS=${CONFIGS:-lightfoot coalesce}
			export COUNT=${COUNT:-0}
			;;
		nbd)
			export TOOLS=lightfoot
			((round == 1)) && export VERIFY=${VERIFY:-first} || export VERIFY=${VERIFY:-none}
			;;
		esac
		env | grep -E '^(RUNS|LIGHTFOOT|DIR|ONLY|PRESET|CONFIGS|WORKLOADS|COUNT|TOOLS|VERIFY|SIZE|WORKSET|RUNTIME|TARGET|TRANSFERS|SERVER|HOLES|DROP|COALESCE_ARGS|LIGHTFOOT_ARGS|PIECE|QUIET|INTERLEAVE)=' |
			sort | sed 's/^/+ /' >"$dir/ab.log"
		# The script's progress (stderr) to the terminal and the log, its tables (stdout) to
		# the log only.
		bash "$HERE/$script" 2>&1 >>"$dir/ab.log" | tee -a "$dir/ab.log" | sed -u 's/^/   | /' >&2
		exit "${PIPESTATUS[0]}"
	) || rc=$?
	t1=$EPOCHREALTIME
	steal=$(steal_pct "$mark")
	seed_out "$script" "$dir"
	local secs
	secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
	echo "$bench,$round,$side,$rel,$rc,$secs,$steal" >>"$DIR/ab-runs.csv"
	if ((rc != 0)); then
		echo "!!! $bench round $round, $side: $script exited with $rc; see $dir/ab.log" >&2
	fi
	say "$bench: round $round, $side: ${secs} s, exit $rc, host steal $steal %"
}

# --- the rounds --------------------------------------------------------------------------

for b in "${BENCHES[@]}"; do rm -rf -- "${DIR:?}/$b"; done
echo "bench,round,side,dir,exit,seconds,steal_pct" >"$DIR/ab-runs.csv"

# What was compared, where: the head of ab.md.
FSTYPE=$(findmnt -no FSTYPE -T "$DIR" 2>/dev/null || stat -f -c %T -- "$DIR")
SETTINGS=$(env | grep -E '^((COPY|SERVE|PREFETCH|COALESCE|NBD)_)?(SIZE|WORKSET|RUNTIME|TARGET|WORKLOADS|CONFIGS|ONLY|HOLES|TRANSFERS|SERVER|DROP|COALESCE_ARGS|LIGHTFOOT_ARGS|PIECE|VERIFY|COUNT|QUIET)=' |
	sort | sed -E "s/^([^=]*)=(.* .*)\$/\1='\2'/" | paste -sd' ' || true)
{
	echo "A/B of two lightfoot binaries, bench/ab.sh $*: ROUNDS=$ROUNDS${SETTINGS:+, $SETTINGS} (the scripts' defaults otherwise)"
	echo ""
	echo "- old: $OLD_DESC"
	echo "- new: $NEW_DESC$SAME"
	echo "- $(uname -r), $FSTYPE in $DIR; bench scripts $(git -C "$HERE/.." describe --always --dirty 2>/dev/null || echo unknown); started $(date -u +'%Y-%m-%d %H:%M UTC')"
} >"$DIR/ab-meta.txt"

T0=$SECONDS
for b in "${BENCHES[@]}"; do
	for ((r = 1; r <= ROUNDS; r++)); do
		if ((r % 2)); then sides=(old new); else sides=(new old); fi
		for s in "${sides[@]}"; do invoke "$b" "$r" "$s"; done
	done
done
echo "- finished $(date -u +'%Y-%m-%d %H:%M UTC'), $(((SECONDS - T0) / 60)) min" >>"$DIR/ab-meta.txt"

say "tables: $DIR/ab.md; each invocation's output: $DIR/BENCH/rNN-SIDE/ab.log"
rc=0
python3 "$HERE/summarize_ab.py" "$DIR" "$BAR" || rc=$?
exit "$rc"
