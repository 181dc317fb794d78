#!/usr/bin/env python3
"""bench/run.sh's table from its run.csv: per program and variant, the median time, the
same-round ratio of time against bare, the working set kept, what was left in the cache (tree
and output, as a share of the bytes moved) and the peak cache of the large file and its copy.

    summarize_run.py run.csv
"""
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
M = 1 << 20
print("| program | variant | s (median) | time / bare (same-round median) | working set kept | left: tree + output, % of moved | peak cache of the large file + copy, MiB |")
print("|---|---|---|---|---|---|---|")
for p in dict.fromkeys(r["program"] for r in rows):
    for v in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["program"] == p and r["variant"] == v]
        if not mine:
            continue
        med = lambda k: statistics.median([float(r[k]) for r in mine if r[k] != ""] or [float("nan")])
        ratios = []
        for r in mine:
            b = [x for x in rows if x["program"] == p and x["variant"] == "bare" and x["round"] == r["round"]]
            if b and float(b[0]["seconds"]) > 0:
                ratios.append(float(r["seconds"]) / float(b[0]["seconds"]))
        ratio = f"{statistics.median(ratios):.3f}" if ratios and v not in ("bare", "control") else "–"
        kept = statistics.median(int(r["ws_kept_bytes"]) / int(r["ws_bytes"]) for r in mine)
        left = statistics.median((int(r["left_tree_bytes"]) + int(r["left_output_bytes"])) / int(r["moved_bytes"]) for r in mine)
        print(f"| {p} | {v} | {med('seconds'):.2f} | {ratio} | {kept * 100:.2f} % | {left * 100:.2f} % | {med('peak_bytes') / M:.0f} |")
