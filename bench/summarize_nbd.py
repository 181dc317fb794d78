#!/usr/bin/env python3
"""Summarises bench/nbd.sh: per transfer, median wall time of lightfoot and nbdcopy --flush,
their ratio, the median of the per-round ratios (each round runs both tools back to back, so
this pairing cancels the slow drifts of these VMs' disks that the ratio of medians keeps) and
their middle half (first to third quartile: how far one round says little on its own), what
each left in the page cache (worst run, source + destination, as a share
of the bytes transferred) and the median share of CPU time the host stole during the runs;
then the geometric mean of the ratios. A second table repeats this over the quiet rounds only:
those in which the host stole less than QUIET percent during both tools' runs of the transfer
(both tools' runs of a round are kept or dropped together, so neither is favoured).

Usage: summarize_nbd.py nbd.csv SIZE_BYTES SERVER [QUIET]
"""
import csv
import math
import statistics
import sys
from collections import defaultdict

TRANSFERS = ["pull-half", "pull-rand", "push-half", "push-rand"]


def steal(r):
    v = r.get("steal_pct")
    return None if v in (None, "") else float(v)


def table(runs, size):
    """Prints one table over `runs` {(transfer, tool): [row]}; returns the geometric mean."""
    print("| transfer | runs | lightfoot s | nbdcopy --flush s | ratio | same-round ratio "
          "| same-round, middle half | lightfoot left in cache | nbdcopy left in cache | lightfoot RSS MiB | nbdcopy RSS MiB "
          "| host steal % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for t in TRANSFERS:
        lf, nc = runs.get((t, "lightfoot"), []), runs.get((t, "nbdcopy"), [])
        if not lf or not nc:
            continue
        ml = statistics.median(float(r["seconds"]) for r in lf)
        mn = statistics.median(float(r["seconds"]) for r in nc)
        ratio = ml / mn
        ratios.append(ratio)
        # Per-round pairs: a round's two runs of the transfer, one after the other.
        nc_by_round = {r["round"]: float(r["seconds"]) for r in nc}
        paired = [float(r["seconds"]) / nc_by_round[r["round"]] for r in lf if r["round"] in nc_by_round]
        same = f"{statistics.median(paired):.3f}" if paired else "-"
        if len(paired) >= 2:
            q1, _, q3 = statistics.quantiles(paired, n=4)
            spread = f"{q1:.3f}-{q3:.3f}"
        else:
            spread = "-"

        def left(rs):
            worst = max(int(r["src_cached"]) + int(r["dst_cached"]) for r in rs)
            return f"{worst / 2**20:.1f} MiB ({100 * worst / size:.2f} %)"

        def rss(rs):
            return f"{statistics.median(int(r['rss_kib']) for r in rs) / 1024:.1f}"

        st = [s for s in map(steal, lf + nc) if s is not None]
        st = f"{statistics.median(st):.0f} (max {max(st):.0f})" if st else "-"
        print(f"| {t} | {len(lf)}+{len(nc)} | {ml:.2f} | {mn:.2f} | {ratio:.3f} | {same} | {spread} | {left(lf)} | {left(nc)} "
              f"| {rss(lf)} | {rss(nc)} | {st} |")
    if not ratios:
        return None
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"\ngeometric mean of the ratios (lightfoot / nbdcopy): {geo:.3f}")
    return geo


def main():
    path, size, server = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    quiet = float(sys.argv[4]) if len(sys.argv) > 4 else 10.0
    runs = defaultdict(list)
    by_round = defaultdict(dict)
    with open(path) as f:
        for row in csv.DictReader(f):
            runs[(row["transfer"], row["tool"])].append(row)
            by_round[(row["transfer"], row["round"])][row["tool"]] = row
    rounds = max(len(v) for v in runs.values())
    print(f"NBD copy, {size / 2**30:g} GiB per transfer, server: {server}, {rounds} rounds, medians\n")
    table(runs, size)
    print("targets: each ratio <= 1.05, geometric mean <= 1.0, <= 1 % of the bytes left in the cache")

    quiet_runs = defaultdict(list)
    known = True
    for (t, _), tools in by_round.items():
        if set(tools) != {"lightfoot", "nbdcopy"}:
            continue
        st = [steal(r) for r in tools.values()]
        if None in st:
            known = False
            continue
        if max(st) < quiet:
            for tool, r in tools.items():
                quiet_runs[(t, tool)].append(r)
    if not known:
        return
    print(f"\nQuiet rounds only (host steal < {quiet:g} % during both tools' runs), medians\n")
    if quiet_runs:
        table(quiet_runs, size)
    else:
        print("none")


if __name__ == "__main__":
    main()
