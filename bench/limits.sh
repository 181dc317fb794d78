#!/usr/bin/env bash
# limits.sh: what a small request costs the server when the storage is free (issue 31).
#
# Serves one file on tmpfs (no device: what is measured is the server) with `lightfoot serve
# --cache=keep` and `nbdkit file`, and runs fio's nbd engine against each: 4 KiB random reads
# and writes, JOBS x depth 1 and 1 job x depth DEPTH, after a RAMP, for RUNTIME seconds.
# Servers alternate within each round. Per run: IOPS (fio), the server's CPU time (utime +
# stime of all its threads, /proc/PID/stat) over fio's requests (µs per request, and its user
# and kernel parts), fio's own CPU as a share of one core (at about 100 % with one job, the
# client is the bottleneck: no server can give more IOPS), and the share of CPU the host
# stole (bench/steal.sh); rounds with steal >= STEAL_MAX % are kept in the CSV but left out
# of the medians.
#
# With RATE=N, fio asks for N requests a second in all (its jobs share it), less than either
# server gives flat out: the servers then do the same work in the same time, and the CPU a
# request is what the request costs. Flat out, the server that is not the bottleneck spends its
# time left over reading the client's requests piece by piece as they come (a faster server
# makes more, smaller reads), so the CPU a request there is bounded by the client's pace as
# much as by the server's work.
#
# With STORAGE=disk the file is on DIR's own filesystem instead (a real disk), the cache is
# dropped before each server's run, and the servers are the cache-neutral ones:
# lightfoot-neutral, lightfoot-direct, nbdkit-none (`nbdkit file cache=none`) and qemu-none
# (`qemu-nbd --cache=none -e 4`); the ratio columns compare the first server with the last.
#
# Usage (as root, on a quiet machine): bench/limits.sh [DIR]
#     ROUNDS=5 RUNTIME=20 RAMP=5 SIZE=1G JOBS=4 DEPTH=16 STEAL_MAX=10 STORAGE=tmpfs|disk RATE=
#     WORKLOADS="randread-j4 randread-d16 randwrite-j4 randwrite-d16"
#     SERVERS="lightfoot nbdkit" (disk: "lightfoot-neutral lightfoot-direct qemu-none nbdkit-none")
#     LIGHTFOOT=path/to/lightfoot   EXTRA="--threads 4"
#     OLD=path/to/another/lightfoot: server "old" runs it (an A/B: SERVERS="lightfoot old"),
#     "old-neutral" as lightfoot-neutral (STORAGE=disk SERVERS="lightfoot-neutral old-neutral")
#     server "nbdkit-null" (nbdkit's null plugin: no storage) shows the client's own ceiling
# Output: DIR/limits.csv (every run) and a table of medians on stdout (DIR/limits.md).
set -euo pipefail
export LC_ALL=C
HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/steal.sh
. "$HERE/steal.sh"
die() { echo "limits.sh: $*" >&2; exit 1; }
[[ $EUID -eq 0 ]] || die "run as root (it mounts a tmpfs)"
DIR=${1:-/work/tmp/bench-limits}
ROUNDS=${ROUNDS:-5} RUNTIME=${RUNTIME:-20} RAMP=${RAMP:-5} SIZE=${SIZE:-1G}
JOBS=${JOBS:-4} DEPTH=${DEPTH:-16} STEAL_MAX=${STEAL_MAX:-10} RATE=${RATE:-}
WORKLOADS=${WORKLOADS:-"randread-j4 randread-d16 randwrite-j4 randwrite-d16"}
STORAGE=${STORAGE:-tmpfs}
case $STORAGE in
tmpfs) SERVERS=${SERVERS:-"lightfoot nbdkit"} ;;
disk) SERVERS=${SERVERS:-"lightfoot-neutral lightfoot-direct qemu-none nbdkit-none"} ;;
*) echo "limits.sh: STORAGE is tmpfs or disk" >&2; exit 1 ;;
esac
LF=${LIGHTFOOT:-$HERE/../target/release/lightfoot}
EXTRA=${EXTRA:-}
[[ -x $LF ]] || die "$LF: not built (cargo build --release)"
for t in fio nbdkit; do command -v $t >/dev/null || die "$t is not installed"; done
mkdir -p "$DIR/mnt" "$DIR/logs"
if [[ $STORAGE == tmpfs ]]; then
	mountpoint -q "$DIR/mnt" || mount -t tmpfs -o size=$(( $(numfmt --from=iec "$SIZE") / 1048576 + 64 ))m tmpfs "$DIR/mnt"
	trap 'umount "$DIR/mnt" 2>/dev/null || true' EXIT
	IMG=$DIR/mnt/disk.img
else
	mountpoint -q "$DIR/mnt" && die "$DIR/mnt is a mount (a tmpfs left by a tmpfs run?): umount it first"
	IMG=$DIR/disk.img
	command -v qemu-nbd >/dev/null || die "qemu-nbd is not installed"
fi
SOCK=$DIR/nbd.sock
[[ -f $IMG && $(stat -c %s "$IMG") -eq $(numfmt --from=iec "$SIZE") ]] || { head -c "$SIZE" /dev/urandom >"$IMG"; sync "$IMG"; }
CSV=$DIR/limits.csv
echo "round,workload,server,iops,requests,cpu_s,us_per_req,steal_pct,user_us_per_req,sys_us_per_req,client_cpu_pct" >"$CSV"

start() {
	rm -f "$SOCK"
	case $1 in
	# shellcheck disable=SC2086
	lightfoot) "$LF" serve --cache=keep $EXTRA --unix "$SOCK" "$IMG" 2>"$DIR/logs/server.log" & ;;
	# shellcheck disable=SC2086
	old) "${OLD:?OLD=path to the other binary}" serve --cache=keep $EXTRA --unix "$SOCK" "$IMG" 2>"$DIR/logs/server.log" & ;;
	# shellcheck disable=SC2086
	old-neutral) "${OLD:?OLD=path to the other binary}" serve $EXTRA --unix "$SOCK" "$IMG" 2>"$DIR/logs/server.log" & ;;
	# shellcheck disable=SC2086
	lightfoot-neutral) "$LF" serve $EXTRA --unix "$SOCK" "$IMG" 2>"$DIR/logs/server.log" & ;;
	# shellcheck disable=SC2086
	lightfoot-direct) "$LF" serve --cache=direct $EXTRA --unix "$SOCK" "$IMG" 2>"$DIR/logs/server.log" & ;;
	nbdkit) nbdkit -f -U "$SOCK" file "$IMG" 2>"$DIR/logs/server.log" & ;;
	nbdkit-none) nbdkit -f -U "$SOCK" file "$IMG" cache=none 2>"$DIR/logs/server.log" & ;;
	# The client's ceiling: a server that reads each request (and a WRITE's payload) and
	# answers it with no storage at all. Not a peer: what fio gives with nothing to do.
	nbdkit-null) nbdkit -f -U "$SOCK" null size="$SIZE" 2>"$DIR/logs/server.log" & ;;
	# -t: stay up when the ramp's clients leave.
	qemu-none) qemu-nbd -t -f raw --cache=none -e 4 -k "$SOCK" "$IMG" 2>"$DIR/logs/server.log" & ;;
	*) die "unknown server $1" ;;
	esac
	PID=$!
	for _ in $(seq 200); do [[ -S $SOCK ]] && return 0; sleep 0.05; done
	die "$1 did not start: $(cat "$DIR/logs/server.log")"
}
# The server's CPU time in user space and in the kernel, in seconds, all threads.
cpu_of() { awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); printf "%.3f %.3f\n", $12 / hz, $13 / hz }' "/proc/$1/stat"; }

for round in $(seq "$ROUNDS"); do
	for w in $WORKLOADS; do
		case $w in
		*-j4) shape=(--numjobs="$JOBS" --iodepth=1) ;;
		*-d16) shape=(--numjobs=1 --iodepth="$DEPTH") ;;
		esac
		# fio's rate is each job's.
		[[ -n $RATE ]] && shape+=(--rate_iops=$((RATE / ${shape[0]#--numjobs=})))
		rw=${w%-*}
		servers=$SERVERS
		((round % 2 == 0)) && servers=$(echo "$SERVERS" | awk '{ for (i = NF; i > 0; i--) printf "%s ", $i }')
		for s in $servers; do
			[[ $STORAGE == disk ]] && { sync; echo 3 >/proc/sys/vm/drop_caches; }
			start "$s"
			out=$DIR/logs/$round-$w-$s.json
			# The ramp runs first, alone: the measured window starts after it.
			fio --name=ramp --ioengine=nbd --uri="nbd+unix:///?socket=$SOCK" --bs=4k --rw="$rw" \
				"${shape[@]}" --time_based --runtime="$RAMP" --eta=never >/dev/null
			read -r u0 s0 < <(cpu_of "$PID")
			mark=$(steal_mark)
			fio --name="$w" --ioengine=nbd --uri="nbd+unix:///?socket=$SOCK" --bs=4k --rw="$rw" \
				"${shape[@]}" --time_based --runtime="$RUNTIME" --group_reporting --eta=never \
				--output-format=json --output="$out"
			read -r u1 s1 < <(cpu_of "$PID")
			steal=$(steal_pct "$mark")
			kill -TERM "$PID"; wait "$PID" 2>/dev/null || true
			# fio's own CPU (its jobs' user + system time, summed) as a share of one core: at
			# about 100 % the client is the bottleneck, and no server can be faster than it.
			read -r iops reqs client < <(python3 -c "
import json,sys; j=json.load(open('$out'))['jobs'][0]; side=j['read'] if j['read']['total_ios'] else j['write']
# usr_cpu and sys_cpu are per job (an average over group_reporting's jobs); job_runtime sums them.
print(round(side['iops']), side['total_ios'], round((j['usr_cpu'] + j['sys_cpu']) * j['job_runtime'] / 1000 / $RUNTIME))")
			cpu=$(echo "$u1 - $u0 + $s1 - $s0" | bc -l)
			us=$(echo "$cpu * 1000000 / $reqs" | bc -l)
			user_us=$(echo "($u1 - $u0) * 1000000 / $reqs" | bc -l)
			sys_us=$(echo "($s1 - $s0) * 1000000 / $reqs" | bc -l)
			printf "%s,%s,%s,%s,%s,%.3f,%.2f,%s,%.2f,%.2f,%s\n" "$round" "$w" "$s" "$iops" "$reqs" "$cpu" "$us" "$steal" \
				"$user_us" "$sys_us" "$client" | tee -a "$CSV"
		done
	done
done

python3 - "$CSV" "$STEAL_MAX" <<'PY' | tee "$DIR/limits.md"
import csv, statistics, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if int(r["steal_pct"]) < int(sys.argv[2])]
ws = list(dict.fromkeys(r["workload"] for r in rows))
ss = list(dict.fromkeys(r["server"] for r in rows))
print("| workload | " + " | ".join(f"{s} IOPS | {s} µs/req" for s in ss) + " | IOPS ratio | CPU/req ratio | CPU/req ratio round by round: median (range) | rounds |")
print("|---" * (2 * len(ss) + 5) + "|")
for w in ws:
    med = {}
    for s in ss:
        rs = [r for r in rows if r["workload"] == w and r["server"] == s]
        med[s] = (statistics.median(float(r["iops"]) for r in rs), statistics.median(float(r["us_per_req"]) for r in rs), len(rs)) if rs else None
    cells = " | ".join(f"{m[0]:.0f} | {m[1]:.2f}" if m else "- | -" for m in med.values())
    a, b = med.get(ss[0]), med.get(ss[-1]) if len(ss) > 1 else None
    ratio = f"{a[0] / b[0]:.2f}× | {a[1] / b[1]:.2f}×" if a and b else "- | -"
    # The same ratio within each round (both servers ran in it), which the host's moods
    # between rounds do not move.
    per_round = []
    for rnd in dict.fromkeys(r["round"] for r in rows):
        x = {r["server"]: r for r in rows if r["workload"] == w and r["round"] == rnd}
        if len(ss) > 1 and ss[0] in x and ss[-1] in x:
            per_round.append(float(x[ss[0]]["us_per_req"]) / float(x[ss[-1]]["us_per_req"]))
    rounds = f"{statistics.median(per_round):.2f}× ({min(per_round):.2f}-{max(per_round):.2f})" if per_round else "-"
    print(f"| {w} | {cells} | {ratio} | {rounds} | {min(m[2] for m in med.values() if m)} |")
# Where each server's CPU goes (user space, kernel), and how busy the client was.
print()
print("| workload | server | user µs/req | kernel µs/req | client CPU (one core = 100 %) |")
print("|---|---|---|---|---|")
for w in ws:
    for s in ss:
        rs = [r for r in rows if r["workload"] == w and r["server"] == s]
        if rs:
            m = lambda k: statistics.median(float(r[k]) for r in rs)
            print(f"| {w} | {s} | {m('user_us_per_req'):.2f} | {m('sys_us_per_req'):.2f} | {m('client_cpu_pct'):.0f} % |")
PY
