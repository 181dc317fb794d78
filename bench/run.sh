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
#           repo (when restic is installed; a static Go binary, which the preload cannot see)
# Variants (VARIANTS): bare, lightfoot (`lightfoot run -- sh -c …`), nocache (`nocache sh -c
# …`, Debian's nocache), control (sleep for the median bare time of that program so far, at
# least 1 s).
#
# Each run: remove the program's output, drop the page cache (echo 3), warm the working set,
# note the system's Cached (/proc/meminfo), run the variant timed (wall clock) while sampling
# Cached every 50 ms, then measure: the working set still cached (cachestat), the tree and the
# output left in the cache, and the peak growth of Cached above its level before the run (the
# most the command held at once, with whatever else the host did).
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

cached_meminfo() { awk '/^Cached:/ {print $2 * 1024}' /proc/meminfo; }
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
echo "round,program,variant,seconds,ws_kept_bytes,ws_bytes,left_tree_bytes,left_output_bytes,peak_growth_bytes,moved_bytes" >"$CSV"
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
			base=$(cached_meminfo)
			( peak=0; while :; do c=$(cached_meminfo); ((c > peak)) && peak=$c && echo "$peak" >"$DIR/peak"; sleep 0.05; done ) &
			sampler=$!
			echo "$base" >"$DIR/peak"
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
			peak=$(($(<"$DIR/peak") - base))
			moved=$((BIG_B + SMALL_COUNT * SMALL_B))
			[[ $p != dd ]] || moved=$BIG_B
			echo "$round,$p,$v,$secs,$ws_kept,$WS_B,$left_tree,$left_out,$peak,$moved" >>"$CSV"
			say "round $round $p $v: $secs s, working set kept $((ws_kept >> 20))/$((WS_B >> 20)) MiB, left: tree $((left_tree >> 20)) MiB, output $((left_out >> 20)) MiB, peak +$((peak >> 20)) MiB"
		done
	done
done
rm -rf out out.img

python3 - "$CSV" <<'EOF' | tee "$DIR/table-run.md"
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
M = 1 << 20
print("| program | variant | s (median) | time / bare (same-round median) | working set kept | left: tree + output, % of moved | peak cache growth MiB |")
print("|---|---|---|---|---|---|---|")
for p in dict.fromkeys(r["program"] for r in rows):
    for v in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["program"] == p and r["variant"] == v]
        if not mine:
            continue
        med = lambda k: statistics.median(float(r[k]) for r in mine)
        ratios = []
        for r in mine:
            b = [x for x in rows if x["program"] == p and x["variant"] == "bare" and x["round"] == r["round"]]
            if b and float(b[0]["seconds"]) > 0:
                ratios.append(float(r["seconds"]) / float(b[0]["seconds"]))
        ratio = f"{statistics.median(ratios):.3f}" if ratios and v not in ("bare", "control") else "–"
        kept = statistics.median(int(r["ws_kept_bytes"]) / int(r["ws_bytes"]) for r in mine)
        left = statistics.median((int(r["left_tree_bytes"]) + int(r["left_output_bytes"])) / int(r["moved_bytes"]) for r in mine)
        print(f"| {p} | {v} | {med('seconds'):.2f} | {ratio} | {kept * 100:.2f} % | {left * 100:.2f} % | {med('peak_growth_bytes') / M:.0f} |")
EOF
say "raw runs: $CSV"
