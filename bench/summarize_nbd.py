#!/usr/bin/env python3
"""Summarises bench/nbd.sh: per transfer, median wall time of lightfoot and nbdcopy --flush,
their ratio, and what each left in the page cache (worst run, source + destination, as a share
of the bytes transferred); then the geometric mean of the ratios.

Usage: summarize_nbd.py nbd.csv SIZE_BYTES SERVER
"""
import csv
import math
import statistics
import sys
from collections import defaultdict


def main():
    path, size, server = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    runs = defaultdict(list)
    with open(path) as f:
        for row in csv.DictReader(f):
            runs[(row["transfer"], row["tool"])].append(row)

    transfers = ["pull-half", "pull-rand", "push-half", "push-rand"]
    rounds = max(len(v) for v in runs.values())
    print(f"NBD copy, {size / 2**30:g} GiB per transfer, server: {server}, {rounds} rounds, medians\n")
    print("| transfer | lightfoot s | nbdcopy --flush s | ratio | lightfoot left in cache | nbdcopy left in cache | lightfoot RSS MiB | nbdcopy RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for t in transfers:
        lf, nc = runs.get((t, "lightfoot"), []), runs.get((t, "nbdcopy"), [])
        if not lf or not nc:
            continue
        ml = statistics.median(float(r["seconds"]) for r in lf)
        mn = statistics.median(float(r["seconds"]) for r in nc)
        ratio = ml / mn
        ratios.append(ratio)

        def left(rs):
            worst = max(int(r["src_cached"]) + int(r["dst_cached"]) for r in rs)
            return f"{worst / 2**20:.1f} MiB ({100 * worst / size:.2f} %)"

        def rss(rs):
            return f"{statistics.median(int(r['rss_kib']) for r in rs) / 1024:.1f}"

        print(f"| {t} | {ml:.2f} | {mn:.2f} | {ratio:.3f} | {left(lf)} | {left(nc)} | {rss(lf)} | {rss(nc)} |")
    if ratios:
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"\ngeometric mean of the ratios (lightfoot / nbdcopy): {geo:.3f}")
        print("targets: each ratio <= 1.05, geometric mean <= 1.0, <= 1 % of the bytes left in the cache")


if __name__ == "__main__":
    main()
