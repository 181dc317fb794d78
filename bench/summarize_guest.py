#!/usr/bin/env python3
"""Tables of bench/guest.sh's results.csv: per workload, per server, medians over the rounds.

    bench/summarize_guest.py DIR/results.csv ["key=name;key=name;..."]

Read workloads: the guest's time, its I/O part (guest time minus the `cached` run's in the
same round, then the median over rounds), the I/O part relative to nbdkit file's and to
qemu-nbd --cache=none's (ratio of the medians: below 1 is faster), the server's bytes read from
storage per byte the guest read, the guest's read requests, the page cache the image held
right after, and the server's peak RSS. Write workloads: the guest's time and its ratio to
nbdkit file's, the guest's flushes and discards, the cache left.

Object storage servers (configs KEY@MS: lightfoot-s3, nbdkit-s3, nbdkit-s3-filters at MS ms
added latency) get a table of their own per read workload: the guest's time, relative to
lightfoot's from the local file (lightfoot-prefetch's, else lightfoot's) and to the faster of
nbdkit's S3 configurations at the same latency, the store's GETs and the server's peak RSS.
"""
import csv
import statistics
import sys
from collections import defaultdict

MiB = 1 << 20


def num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(v, spec=".2f", none="-"):
    return none if v is None else format(v, spec)


def main():
    path = sys.argv[1]
    names = {}
    if len(sys.argv) > 2:
        for item in sys.argv[2].split(";"):
            if "=" in item:
                k, v = item.split("=", 1)
                names[k] = v
    rows = list(csv.DictReader(open(path)))
    workloads, configs = [], []
    for r in rows:
        if r["workload"] not in workloads:
            workloads.append(r["workload"])
        if r["config"] not in configs:
            configs.append(r["config"])
    by = defaultdict(list)
    for r in rows:
        by[(r["workload"], r["config"])].append(r)
    failed = [r for r in rows if r["status"] != "ok"]
    read = {"scan", "random", "walk", "boot"}
    for w in workloads:
        ok = {c: [r for r in by[(w, c)] if r["status"] == "ok"] for c in configs}
        ref = {r["round"]: num(r["guest_s"]) for r in ok.get("cached", [])}
        stats = {}
        for c in configs:
            rs = ok[c]
            if not by[(w, c)]:
                continue
            guest = med(num(r["guest_s"]) for r in rs)
            io = med(num(r["guest_s"]) - ref[r["round"]] for r in rs
                     if r["round"] in ref and num(r["guest_s"]) is not None and ref[r["round"]] is not None)
            amp = med(num(r["server_read_bytes"]) / num(r["guest_read_bytes"]) for r in rs
                      if num(r["server_read_bytes"]) is not None and num(r["guest_read_bytes"]))
            # The guest's time over nbdkit file's in the same round: robust where the I/O
            # part is within the rounds' noise (nbdkit's scan here is about as fast as cached).
            peer = {r["round"]: num(r["guest_s"]) for r in ok.get("nbdkit", [])}
            vs_nbdkit = med(num(r["guest_s"]) / peer[r["round"]] for r in rs
                            if peer.get(r["round"]) and num(r["guest_s"]) is not None)
            stats[c] = dict(
                n=f"{len(rs)}/{len(by[(w, c)])}", guest=guest, io=io, amp=amp, vs_nbdkit=vs_nbdkit,
                reads=med(num(r["guest_reads"]) for r in rs),
                gread=med(num(r["guest_read_bytes"]) for r in rs),
                sread=med(num(r["server_read_bytes"]) for r in rs),
                left=med(num(r["cache_left_bytes"]) for r in rs),
                rss=med(num(r["server_rss_kib"]) for r in rs),
                flushes=med(num(r["guest_flushes"]) for r in rs),
                discards=med(num(r["guest_discards"]) for r in rs),
                gets=med(num(r.get("store_gets")) for r in rs),
                cpu=med(num(r.get("server_cpu_s")) for r in rs),
                rms=med(num(r.get("guest_read_ms")) for r in rs),
            )
        # A peer over object storage that hit guest.sh's TIMEOUT (timeout's status 124) counts
        # at the limit: its wall time, marked ≥.
        for c, st in stats.items():
            cut = [r for r in by[(w, c)] if r["status"] == "guest-failed-124"]
            if "@" in c and cut:
                st["guest"] = med([num(r["guest_s"]) for r in ok[c]] + [num(r["wall_s"]) for r in cut])
                st["n"] += f" ({len(cut)} at the time limit: ≥)"
        remote = {c: s for c, s in stats.items() if "@" in c}
        stats = {c: s for c, s in stats.items() if "@" not in c}
        print(f"### {w}\n")
        if w in read:
            base_n = stats.get("nbdkit", {}).get("io")
            base_q = stats.get("qemu-none", {}).get("io")
            print("| server | runs ok | guest s | guest rel. nbdkit file | I/O part s | I/O rel. nbdkit file "
                  "| I/O rel. qemu-nbd none | guest read MiB | server read / guest read | guest requests "
                  "| cache left MiB | server RSS MiB | server CPU s | guest read ms |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for c, s in stats.items():
                # A peer's I/O part at or below 0.1 s is noise: no ratio to it ("n/a").
                rel = lambda b: ("n/a" if b is not None and b <= 0.1 else
                                 fmt(s["io"] / b if s["io"] is not None and b else None, ".2f"))
                left = None if c == "cached" or s["left"] is None else s["left"] / MiB
                print(f"| {names.get(c, c)} | {s['n']} | {fmt(s['guest'])} | {fmt(s['vs_nbdkit'])} | {fmt(s['io'])} | "
                      f"{rel(base_n) if c != 'cached' else '-'} | {rel(base_q) if c != 'cached' else '-'} | "
                      f"{fmt(s['gread'] / MiB if s['gread'] is not None else None, '.0f')} | "
                      f"{fmt(s['amp'])} | {fmt(s['reads'], '.0f')} | {fmt(left, '.1f')} | "
                      f"{fmt(s['rss'] / 1024 if s['rss'] is not None else None, '.0f')} | {fmt(s['cpu'])} | "
                      f"{fmt(s['rms'], '.0f')} |")
        else:
            base = stats.get("nbdkit", {}).get("guest")
            print("| server | runs ok | guest s | rel. nbdkit file | guest flushes | guest discards "
                  "| cache left MiB | server RSS MiB | server CPU s |")
            print("|---|---|---|---|---|---|---|---|---|")
            for c, s in stats.items():
                rel = fmt(s["guest"] / base if s["guest"] is not None and base else None)
                print(f"| {names.get(c, c)} | {s['n']} | {fmt(s['guest'])} | {rel} | {fmt(s['flushes'], '.0f')} | "
                      f"{fmt(s['discards'], '.0f')} | "
                      f"{fmt(s['left'] / MiB if s['left'] is not None else None, '.1f')} | "
                      f"{fmt(s['rss'] / 1024 if s['rss'] is not None else None, '.0f')} | {fmt(s['cpu'])} |")
        print()
        if remote:
            object_storage_table(w, remote, stats, names)
    print("Medians over the rounds' good runs. Guest rel. nbdkit file: median of the rounds' ratios. "
          "I/O part: the guest's time minus the `cached` run's "
          "in the same round; its ratios are of the medians (below 1: faster than the peer; n/a: the "
          "peer's I/O part is 0.1 s or less, within the rounds' noise). "
          "Server read: /proc/PID/io read_bytes (storage reads the server caused). "
          "Guest read ms: /sys/block/vda/stat's read ticks, the time its reads were outstanding "
          "(summed over reads in flight together).")
    if failed:
        print("\n**Failed runs**: " + "; ".join(f"r{r['round']} {r['workload']} {r['config']}: {r['status']}"
                                               for r in failed))


def object_storage_table(w, remote, local, names):
    local_ref = next((local[c]["guest"] for c in ("lightfoot-prefetch", "lightfoot") if c in local), None)
    print(f"#### {w}, object storage\n")
    print("| server | runs ok | guest s | rel. local lightfoot | rel. best nbdkit S3 | store GETs | server RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for c, s in remote.items():
        lat = c.split("@", 1)[1]
        peers = [p["guest"] for k, p in remote.items()
                 if k.startswith("nbdkit-s3") and k.split("@", 1)[1] == lat and p["guest"] is not None]
        best = min(peers) if peers else None
        rel = lambda b: fmt(s["guest"] / b if s["guest"] is not None and b else None)
        print(f"| {names.get(c, c)} | {s['n']} | {fmt(s['guest'])} | {rel(local_ref)} | "
              f"{rel(best) if not c.startswith('nbdkit') else '-'} | {fmt(s['gets'], '.0f')} | "
              f"{fmt(s['rss'] / 1024 if s['rss'] is not None else None, '.0f')} |")
    print()


if __name__ == "__main__":
    main()
