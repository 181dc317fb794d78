#!/usr/bin/env bash
# run.sh: `lightfoot run -- CMD` against the bare command and against `nocache` (issue 30), on
# the same tree in the same run.
#
# The tree (DIR/tree, made once): one large file of BIG bytes and SMALL_COUNT files of
# SMALL_SIZE, random data. A working set (DIR/ws.img, WS bytes) is made hot before every run
# (read twice, so its pages are active), and a control run only waits: what the working set
# loses there is the host's own reclaim, not the command's.
#
# Programs (PROGRAMS), each followed by `sync -f` on its output in every variant, so the bare run
# pays for its writeback too:
#   tar     tar cf - tree | cat > /dev/null
#   cp      cp -r tree out && sync -f out
#   rsync   rsync -a tree/ out/ && sync -f out          (when rsync is installed)
#   dd      dd if=tree/big of=out.img bs=1M status=none && sync -f out.img
#   restic  restic backup tree into DIR/repo (a local repository made once), then sync -f
#           repo (when restic is installed; a static Go binary, which the preload cannot see: as
#           root the watcher covers it)
# Variants (VARIANTS): bare, lightfoot (`lightfoot run -- sh -c …`), nocache (`nocache sh -c
# …`, Debian's nocache), control (sleep for the median bare time of that program so far, at
# least 1 s).
#
# Each run: remove the program's output, drop the page cache (echo 3), warm the working set,
# run the variant timed (wall clock) while sampling the cache, then measure: the working set
# still cached (cachestat), the tree and the output left in the cache, and the peak cache of the large file and its copy while it ran
# (cachestat every 50 ms; see sampler.py below).
#
# Rounds are the outer loop, alternating the order of the variants. Medians per program and
# variant; ratios of time against bare within each round, then their median.
#
# Usage: bench/run.sh [DIR]   (root: drop_caches)
#     BIG=1G SMALL_COUNT=1024 WS=256M ROUNDS=3 bench/run.sh    # a shorter run
# Environment: BIG (default 3G), SMALL_COUNT (4096), SMALL_SIZE (256K), WS (512M), ROUNDS (5),
# PROGRAMS, VARIANTS, LIGHTFOOT (the binary; default ../target/release/lightfoot beside this
# script), DIR (default the argument, else /work/tmp/bench-run).
set -euo pipefail
export LC_ALL=C

die() { echo "run.sh: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }

HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
BIG=${BIG:-3G}
SMALL_COUNT=${SMALL_COUNT:-4096}
SMALL_SIZE=${SMALL_SIZE:-256K}
WS=${WS:-512M}
ROUNDS=${ROUNDS:-5}
DIR=${DIR:-${1:-/work/tmp/bench-run}}
LIGHTFOOT=${LIGHTFOOT:-$HERE/../target/release/lightfoot}
have() { command -v "$1" >/dev/null; }
default_programs="tar cp"
have rsync && default_programs+=" rsync"
default_programs+=" dd"
have restic && default_programs+=" restic"
PROGRAMS=${PROGRAMS:-$default_programs}
VARIANTS=${VARIANTS:-bare lightfoot nocache control}

[[ $EUID -eq 0 ]] || die "run as root (it writes /proc/sys/vm/drop_caches)"
[[ -x $LIGHTFOOT ]] || die "$LIGHTFOOT: not built (cargo build --release)"
for v in $VARIANTS; do [[ $v != nocache ]] || have nocache || die "nocache is not installed (apt-get install nocache)"; done
to_bytes() { numfmt --from=iec -- "$1" 2>/dev/null || die "$2=$1: not a size"; }
BIG_B=$(to_bytes "$BIG" BIG)
SMALL_B=$(to_bytes "$SMALL_SIZE" SMALL_SIZE)
WS_B=$(to_bytes "$WS" WS)
mkdir -p -- "$DIR"
cd -- "$DIR"
LF=$(cd -- "$(dirname -- "$LIGHTFOOT")" && pwd)/$(basename -- "$LIGHTFOOT")

layout="big=$BIG_B small=${SMALL_COUNT}x$SMALL_B"
if [[ -f tree.layout && $(<tree.layout) == "$layout" ]]; then
	say "reusing DIR/tree ($layout)"
else
	say "making DIR/tree: $layout"
	rm -rf tree tree.layout
	mkdir -p tree/small
	head -c "$BIG_B" /dev/urandom >tree/big
	python3 - "$SMALL_COUNT" "$SMALL_B" <<'EOF'
import os, sys
n, size = int(sys.argv[1]), int(sys.argv[2])
for i in range(n):
    with open(f"tree/small/{i // 256:03d}-{i:05d}", "wb") as f:
        f.write(os.urandom(size))
EOF
	sync -f tree/big
	echo "$layout" >tree.layout
fi
if [[ ! -f ws.img || $(stat -c %s ws.img) != "$WS_B" ]]; then
	head -c "$WS_B" /dev/urandom >ws.img
	sync -f ws.img
fi
export RESTIC_PASSWORD=bench
if [[ " $PROGRAMS " == *" restic "* && ! -d repo ]]; then
	restic init -q -r repo >/dev/null
fi

script_of() { # PROGRAM: its shell command, run in DIR
	case $1 in
	tar) echo 'tar cf - tree | cat > /dev/null' ;;
	cp) echo 'cp -r tree out && sync -f out' ;;
	rsync) echo 'rsync -a tree/ out/ && sync -f out' ;;
	dd) echo 'dd if=tree/big of=out.img bs=1M status=none && sync -f out.img' ;;
	restic) echo 'restic -q -r repo backup tree >/dev/null && sync -f repo' ;;
	*) die "unknown program $1" ;;
	esac
}

# The peak: every 50 ms, the pages cached of the large file and of its copy (tree/big, out.img,
# and the files at the top of out/, where rsync's temporary name is), by cachestat; the most
# seen is written to the file named by its argument (at once: the first figure says it runs;
# Debian's python3, whose start is not slowed by a version manager's shim). Small files are left out (each is read
# and closed in one go); restic's repository too.
cat >"$DIR/sampler.py" <<'EOF'
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
class Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]
class Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recent")]
def cached(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        st = Stat()
        libc.syscall(451, fd, ctypes.byref(Range(0, 0)), ctypes.byref(st), 0)
        return st.cache * 4096
    finally:
        os.close(fd)
peak = -1
while True:
    paths = ["tree/big", "out.img"]
    try:
        paths += [e.path for e in os.scandir("out") if e.is_file(follow_symlinks=False)]
    except OSError:
        pass
    n = sum(cached(p) for p in paths)
    if n > peak:
        peak = n
        with open(sys.argv[1], "w") as f:
            f.write(f"{peak}\n")
    time.sleep(0.05)
EOF
cached_files() { # FILE...: bytes cached, summed (cachestat through lightfoot cache stat)
	"$LF" cache stat --json "$@" 2>/dev/null | python3 -c 'import json,sys; print(sum(x.get("cached_bytes", 0) for x in json.load(sys.stdin)))'
}
tree_files() { find tree -type f; }
output_files() { [[ -e out ]] && find out -type f; [[ -e out.img ]] && echo out.img; [[ -d repo ]] && find repo -type f; true; }

warm() { # the working set, twice: its pages become active
	dd if=ws.img of=/dev/null bs=1M status=none
	dd if=ws.img of=/dev/null bs=1M status=none
}

CSV=$DIR/run.csv
echo "round,program,variant,seconds,ws_kept_bytes,ws_bytes,left_tree_bytes,left_output_bytes,peak_bytes,moved_bytes" >"$CSV"
declare -A BARE_TIMES

for ((round = 1; round <= ROUNDS; round++)); do
	read -r -a vs <<<"$VARIANTS"
	if ((round % 2 == 0)); then
		# shellcheck disable=SC2207
		vs=($(printf '%s\n' "${vs[@]}" | tac))
	fi
	for p in $PROGRAMS; do
		cmd=$(script_of "$p")
		for v in "${vs[@]}"; do
			rm -rf out out.img
			[[ $p != restic ]] || { rm -rf repo && restic init -q -r repo >/dev/null; }
			sync
			echo 3 >/proc/sys/vm/drop_caches
			warm
			rm -f "$DIR/peak"
			/usr/bin/python3 "$DIR/sampler.py" "$DIR/peak" &
			sampler=$!
			# Started only once it samples (it writes its first figure then).
			until [[ -s $DIR/peak ]]; do sleep 0.01; done
			t0=$EPOCHREALTIME
			case $v in
			bare) sh -c "$cmd" ;;
			lightfoot) "$LF" run -- sh -c "$cmd" ;;
			nocache) nocache sh -c "$cmd" ;;
			control)
				t=${BARE_TIMES[$p]:-1}
				sleep "$t"
				;;
			esac
			t1=$EPOCHREALTIME
			kill "$sampler" 2>/dev/null || true
			wait "$sampler" 2>/dev/null || true
			secs=$(python3 -c "print(f'{$t1 - $t0:.3f}')")
			[[ $v != bare ]] || BARE_TIMES[$p]=$(python3 -c "print(max(1.0, $secs))")
			ws_kept=$(cached_files ws.img)
			# shellcheck disable=SC2046
			left_tree=$(cached_files $(tree_files))
			outs=$(output_files)
			left_out=0
			# shellcheck disable=SC2086
			[[ -z $outs ]] || left_out=$(cached_files $outs)
			peak=$(<"$DIR/peak")
			moved=$((BIG_B + SMALL_COUNT * SMALL_B))
			[[ $p != dd ]] || moved=$BIG_B
			echo "$round,$p,$v,$secs,$ws_kept,$WS_B,$left_tree,$left_out,$peak,$moved" >>"$CSV"
			say "round $round $p $v: $secs s, working set kept $((ws_kept >> 20))/$((WS_B >> 20)) MiB, left: tree $((left_tree >> 20)) MiB, output $((left_out >> 20)) MiB, peak $((peak >> 20)) MiB"
		done
	done
done
rm -rf out out.img

python3 "$HERE/summarize_run.py" "$CSV" | tee "$DIR/table-run.md"
say "raw runs: $CSV"
