#!/usr/bin/env bash
# limits_large.sh: large sequential I/O against what the device gives fio directly (issue 31).
#
# A SIZE file on the real disk (DIR, ext4 here), read and copied from a cold cache. Per round:
#
#   fio-read     the reference for reads: fio, O_DIRECT, io_uring, the best of request sizes
#                BSS x depths DEPTHS (one fio run each) in this round
#   serve        `lightfoot serve` (neutral) read whole by `nbdcopy nbd+unix://... null:`
#   nbdkit       the same with `nbdkit file cache=none` (a peer, for context)
#   copy-null    `lightfoot copy FILE null:`
#   nbdcopy-null `nbdcopy FILE null:` (a peer)
#   fio-copy     the reference for file-to-file: one fio read job (SRC) and one fio write job
#                (a fresh file, end_fsync=1) at once, O_DIRECT, the best of COPY_BSS x depth 16;
#                the rate is SIZE over the slower job's time
#   copy-file    `lightfoot copy FILE FILE2` (fresh DST; durable: it flushes at the end)
#   cp           `cp FILE FILE2 && sync FILE2` (a peer; it leaves both files cached)
#
# Every job starts cold (drop_caches) and is timed from outside (fio: its own runtime). After
# each lightfoot job the script records the bytes of SRC and DST left cached (cachestat), to
# show the runs were cache-neutral. Jobs run in a rotated order each round.
#
# Usage (as root, on a quiet machine): bench/limits_large.sh [DIR]
#     ROUNDS=5 SIZE=2G BSS="256k 1m 4m" DEPTHS="8 16 32" COPY_BSS="1m 4m"
#     JOBS="serve nbdkit copy-null nbdcopy-null copy-file cp"   LIGHTFOOT=path   EXTRA_COPY=...
# Output: DIR/large.csv (every run) and a table of medians on stdout (DIR/large.md): each job's
# rate and its ratio to the reference of its own round.
set -euo pipefail
export LC_ALL=C
HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
die() { echo "limits_large.sh: $*" >&2; exit 1; }
[[ $EUID -eq 0 ]] || die "run as root (it drops caches)"
DIR=${1:-/work/tmp/bench-large}
ROUNDS=${ROUNDS:-5} SIZE=${SIZE:-2G}
BSS=${BSS:-"256k 1m 4m"} DEPTHS=${DEPTHS:-"8 16 32"} COPY_BSS=${COPY_BSS:-"1m 4m"}
JOBS=${JOBS:-"serve nbdkit copy-null nbdcopy-null copy-file cp"}
LF=${LIGHTFOOT:-$HERE/../target/release/lightfoot}
EXTRA_COPY=${EXTRA_COPY:-}
[[ -x $LF ]] || die "$LF: not built (cargo build --release)"
for t in fio nbdkit nbdcopy; do command -v $t >/dev/null || die "$t is not installed"; done
mkdir -p "$DIR/logs"
SRC=$DIR/src.img DST=$DIR/dst.img SOCK=$DIR/nbd.sock
BYTES=$(numfmt --from=iec "$SIZE")
if [[ ! -f $SRC || $(stat -c %s "$SRC") -ne $BYTES ]]; then
	head -c "$BYTES" /dev/urandom >"$SRC.tmp" && sync "$SRC.tmp" && mv "$SRC.tmp" "$SRC"
fi
CSV=$DIR/large.csv
echo "round,job,variant,seconds,mb_s,src_cached,dst_cached" >"$CSV"

cold() { sync; echo 3 >/proc/sys/vm/drop_caches; }
now() { date +%s.%N; }
cached() { [[ -e $1 ]] && "$LF" cache stat --json "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["cached_bytes"])' || echo 0; }
row() { # job variant seconds [src_cached dst_cached]
	printf "%s,%s,%s,%.3f,%.0f,%s,%s\n" "$round" "$1" "$2" "$3" "$(echo "$BYTES / $3 / 1000000" | bc -l)" "${4:-}" "${5:-}" | tee -a "$CSV"
}
timed() { local t0; t0=$(now); "$@" >/dev/null; echo "$(now) - $t0" | bc -l; }
serve_with() { # server command..., then reads the export whole with nbdcopy
	rm -f "$SOCK"
	"$@" 2>"$DIR/logs/server.log" &
	local pid=$! t
	for _ in $(seq 200); do [[ -S $SOCK ]] && break; sleep 0.05; done
	[[ -S $SOCK ]] || die "$1 did not start: $(cat "$DIR/logs/server.log")"
	t=$(timed nbdcopy "nbd+unix:///?socket=$SOCK" null:)
	kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
	echo "$t"
}
fio_secs() { # fio json -> the slowest job's runtime in seconds
	python3 -c "
import json,sys; j=json.load(open(sys.argv[1]))['jobs']
print(max((x['read']['runtime'] or x['write']['runtime']) for x in j) / 1000)" "$1"
}

for round in $(seq "$ROUNDS"); do
	for bs in $BSS; do
		for qd in $DEPTHS; do
			cold
			out=$DIR/logs/$round-fio-read-$bs-$qd.json
			fio --name=read --filename="$SRC" --rw=read --bs="$bs" --iodepth="$qd" --direct=1 \
				--ioengine=io_uring --size="$BYTES" --output-format=json --output="$out" >/dev/null
			row fio-read "$bs-q$qd" "$(fio_secs "$out")"
		done
	done
	for bs in $COPY_BSS; do
		cold; rm -f "$DST"
		out=$DIR/logs/$round-fio-copy-$bs.json
		fio --direct=1 --ioengine=io_uring --bs="$bs" --iodepth=16 --size="$BYTES" \
			--output-format=json --output="$out" \
			--name=read --filename="$SRC" --rw=read \
			--name=write --filename="$DST" --rw=write --end_fsync=1 >/dev/null
		row fio-copy "$bs-q16" "$(fio_secs "$out")"
	done
	# Rotate the jobs' order each round, so no job always follows the same one.
	read -ra jobs <<<"$JOBS"
	n=${#jobs[@]} k=$(((round - 1) % n))
	for j in "${jobs[@]:k}" "${jobs[@]:0:k}"; do
		cold; rm -f "$DST"
		case $j in
		serve) t=$(serve_with "$LF" serve --unix "$SOCK" "$SRC"); row serve neutral "$t" "$(cached "$SRC")" ;;
		nbdkit) t=$(serve_with nbdkit -f -U "$SOCK" file "$SRC" cache=none); row nbdkit cache=none "$t" ;;
		# shellcheck disable=SC2086
		copy-null) t=$(timed "$LF" copy $EXTRA_COPY "$SRC" null:); row copy-null neutral "$t" "$(cached "$SRC")" ;;
		nbdcopy-null) t=$(timed nbdcopy "$SRC" null:); row nbdcopy-null default "$t" ;;
		# shellcheck disable=SC2086
		copy-file) t=$(timed "$LF" copy $EXTRA_COPY "$SRC" "$DST"); row copy-file neutral "$t" "$(cached "$SRC")" "$(cached "$DST")" ;;
		cp) t=$(timed sh -c "cp '$SRC' '$DST' && sync '$DST'"); row cp default "$t" "$(cached "$SRC")" "$(cached "$DST")" ;;
		*) die "unknown job $j" ;;
		esac
	done
done
rm -f "$DST"

python3 - "$CSV" <<'PY' | tee "$DIR/large.md"
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
rounds = sorted({r["round"] for r in rows}, key=int)
# Each round's references: the best fio run of the round.
ref = {(r, kind): max(float(x["mb_s"]) for x in rows if x["round"] == r and x["job"] == kind)
       for r in rounds for kind in ("fio-read", "fio-copy") if any(x["round"] == r and x["job"] == kind for x in rows)}
refs = {"serve": "fio-read", "nbdkit": "fio-read", "copy-null": "fio-read", "nbdcopy-null": "fio-read",
        "copy-file": "fio-copy", "cp": "fio-copy"}
print("| job | MB/s (median) | reference | reference MB/s (median) | ratio to the round's reference (median) | SRC/DST left cached (max) | rounds |")
print("|---|---|---|---|---|---|---|")
for kind in ("fio-read", "fio-copy"):
    vs = [ref[(r, kind)] for r in rounds if (r, kind) in ref]
    if vs:
        print(f"| {kind} (best of the round) | {statistics.median(vs):.0f} | | | | | {len(vs)} |")
for job, kind in refs.items():
    rs = [x for x in rows if x["job"] == job]
    if not rs:
        continue
    ratios = [float(x["mb_s"]) / ref[(x["round"], kind)] for x in rs]
    left = [max(int(x[c] or 0) for x in rs) for c in ("src_cached", "dst_cached")]
    refmed = statistics.median(ref[(x["round"], kind)] for x in rs)
    print(f"| {job} ({rs[0]['variant']}) | {statistics.median(float(x['mb_s']) for x in rs):.0f} | {kind} | {refmed:.0f} "
          f"| {statistics.median(ratios):.2f}× | {left[0] >> 20} / {left[1] >> 20} MiB | {len(rs)} |")
PY
