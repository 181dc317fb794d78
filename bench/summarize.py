#!/usr/bin/env python3
"""Turn the per-run CSV of bench/copy.sh into a table of medians per job.

    summarize.py RESULTS.csv TABLE.md [NOTE]

Prints the table (markdown) and writes it to TABLE.md, with NOTE (what was run, where) above
it. Can be re-run on an old results.csv. Only the standard library: it runs on any python3.

Medians are over the runs that succeeded and produced an identical destination. Ratios are
taken round by round (a job's wall time over the yardstick's in the same round), then the
median of those: the rounds interleave the jobs, so a machine that drifts between rounds
moves both sides of each ratio together.
"""
import csv
import statistics
import sys

LOOP_JOB = "dontcache_loop (reference)"
NBDCOPY_JOB = "nbdcopy --flush"
CONTROL_JOB = "sleep (control)"
MiB = 1 << 20


def num(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, digits):
    return "–" if value is None else f"{value:.{digits}f}"


def ratio_by_round(rows, job, base):
    """Median over rounds of wall(job) / wall(base), rounds where both succeeded."""
    walls = {}
    for r in rows:
        if r["status"] == "ok":
            walls[(r["job"], r["round"])] = num(r["wall_s"])
    ratios = []
    for (name, rnd), wall in walls.items():
        if name != job:
            continue
        b = walls.get((base, rnd))
        if wall is not None and b:
            ratios.append(wall / b)
    return median(ratios)


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: summarize.py RESULTS.csv TABLE.md [NOTE]")
    csv_path, table_path = sys.argv[1], sys.argv[2]
    note = sys.argv[3] if len(sys.argv) == 4 else ""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))

    jobs = list(dict.fromkeys(r["job"] for r in rows))  # order of first appearance
    header = ("| job | runs ok | wall s | × loop | × nbdcopy --flush "
              "| src beyond WS MiB | WS kept % | dst cached MiB | peak RSS MiB |")
    lines = [header, "|" + "---|" * 9]
    for job in jobs:
        mine = [r for r in rows if r["job"] == job]
        missing = [r["status"] for r in mine if r["status"].startswith("missing:")]
        if missing:
            tool = missing[0].split(":", 1)[1]
            lines.append(f"| {job} | MISSING: {tool} |" + " |" * 7)
            continue
        ok = [r for r in mine if r["status"] == "ok"]
        bad = [r["status"] for r in mine if r["status"] != "ok"]
        runs = f"{len(ok)}/{len(mine)}"
        if bad:
            kinds = sorted(set(bad))
            runs += " **" + ", ".join(f"{bad.count(k)} {k}" for k in kinds) + "**"
        wall = median(num(r["wall_s"]) for r in ok)
        control = job == CONTROL_JOB
        x_loop = None if control else ratio_by_round(rows, job, LOOP_JOB)
        x_nbd = None if control else ratio_by_round(rows, job, NBDCOPY_JOB)
        beyond = median(num(r["src_beyond"]) for r in ok)
        ws = median(
            100 * num(r["ws_cached"]) / num(r["ws_bytes"])
            for r in ok if num(r["ws_cached"]) is not None and num(r["ws_bytes"]))
        dst = None if control else median(num(r["dst_cached"]) for r in ok)
        rss = median(num(r["peak_rss_kib"]) for r in ok)
        lines.append(
            f"| {job} | {runs} | {fmt(wall, 2)} | {fmt(x_loop, 2)} | {fmt(x_nbd, 2)} "
            f"| {fmt(beyond and beyond / MiB, 1)} | {fmt(ws, 1)} "
            f"| {fmt(dst and dst / MiB, 1)} | {fmt(rss and rss / 1024, 1)} |")

    # The starting point every job had, to show the setup did what it says.
    measured = [r for r in rows if num(r["ws_bytes"]) and num(r["ws_cached_before"]) is not None]
    ws_before = median(100 * num(r["ws_cached_before"]) / num(r["ws_bytes"]) for r in measured)
    beyond_before = median(num(r["src_beyond_before"]) for r in measured)
    footer = (f"Before each job (median): working set {fmt(ws_before, 1)} % cached, "
              f"source beyond it {fmt(beyond_before and beyond_before / MiB, 1)} MiB. "
              "Ratios: median over rounds of the wall-time ratio within the round. "
              "Only ratios within one run of the benchmark are comparable.")

    text = "\n".join(([note, ""] if note else []) + lines + ["", footer]) + "\n"
    with open(table_path, "w") as f:
        f.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
