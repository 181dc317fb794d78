#!/usr/bin/env python3
"""Turn the per-run CSV of bench/serve.sh into one table of medians per workload.

    summarize_serve.py RESULTS.csv TABLE.md [NOTE]

Prints the tables (markdown) and writes them to TABLE.md, with NOTE (what was run, where)
above them. Can be re-run on an old results.csv. Only the standard library; shares its
helpers with summarize.py (copy.sh's summarizer).

Medians are over the runs that succeeded. Throughput is higher-is-better (MiB/s or IOPS), so
ratios above 1 mean faster than the base. Ratios are taken round by round (a server's
throughput over the base's in the same round and workload), then the median of those: the
rounds interleave the servers, so a machine that drifts between rounds moves both sides of
each ratio together. The "best neutral peer" of a round is the faster of nbdkit file
cache=none and qemu-nbd --cache=none in that round (whichever succeeded).
"""
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from summarize import MiB, fmt, median, num  # noqa: E402

NBDKIT = "nbdkit file"
NEUTRAL_PEERS = ("nbdkit file cache=none", "qemu-nbd --cache=none")
CONTROL = "sleep (control)"

WORKLOADS = {
    "seqread": "Sequential read: `nbdcopy URI null:`",
    "seqwrite": "Sequential write: `nbdcopy --flush -- [ nbdkit pattern size=SIZE ] URI`",
    "randread": "4 KiB random read: fio nbd engine, 4 jobs × iodepth 1",
    "randwrite": "4 KiB random write, a flush every 64 writes per job: fio nbd engine, "
                 "4 jobs × iodepth 1",
}


def throughputs(rows):
    """{(workload, config, round): throughput} of the runs that succeeded."""
    out = {}
    for r in rows:
        t = num(r["throughput"])
        if r["status"] == "ok" and t:
            out[(r["workload"], r["config"], r["round"])] = t
    return out


def ratio_by_round(tput, workload, config, bases):
    """Median over rounds of tput(config) / max(tput(base) for base in bases)."""
    ratios = []
    for (wl, name, rnd), t in tput.items():
        if wl != workload or name != config:
            continue
        base = [tput[(wl, b, rnd)] for b in bases if (wl, b, rnd) in tput]
        if base:
            ratios.append(t / max(base))
    return median(ratios)


def table(rows, workload, tput):
    mine = [r for r in rows if r["workload"] == workload]
    unit = next((r["unit"] for r in mine if r["unit"]),
                "IOPS" if workload.startswith("rand") else "MiB/s")
    digits = 0 if unit == "IOPS" else 1
    title = WORKLOADS.get(workload, workload)
    lines = [f"### {title}", "",
             f"| server | runs ok | {unit} | × nbdkit file | × best neutral peer "
             "| beyond WS MiB | WS kept % | peak RSS MiB | server CPU s |",
             "|" + "---|" * 9]
    for config in dict.fromkeys(r["config"] for r in mine):  # order of first appearance
        runs = [r for r in mine if r["config"] == config]
        missing = [r["status"] for r in runs if r["status"].startswith("missing:")]
        if missing:
            tool = missing[0].split(":", 1)[1]
            lines.append(f"| {config} | MISSING: {tool} |" + " |" * 7)
            continue
        ok = [r for r in runs if r["status"] == "ok"]
        bad = [r["status"] for r in runs if r["status"] != "ok"]
        count = f"{len(ok)}/{len(runs)}"
        if bad:
            count += " **" + ", ".join(f"{bad.count(k)} {k}" for k in sorted(set(bad))) + "**"
        control = config == CONTROL
        t = None if control else median(num(r["throughput"]) for r in ok)
        x_nbdkit = None if control else ratio_by_round(tput, workload, config, (NBDKIT,))
        x_neutral = None if control else ratio_by_round(tput, workload, config, NEUTRAL_PEERS)
        beyond = median(num(r["beyond"]) for r in ok)
        ws = median(100 * num(r["ws_cached"]) / num(r["ws_bytes"])
                    for r in ok if num(r["ws_cached"]) is not None and num(r["ws_bytes"]))
        rss = median(num(r["server_peak_rss_kib"]) for r in ok)
        cpu = median(num(r["server_cpu_s"]) for r in ok)
        lines.append(
            f"| {config} | {count} | {fmt(t, digits)} | {fmt(x_nbdkit, 2)} | {fmt(x_neutral, 2)} "
            f"| {fmt(beyond and beyond / MiB, 1)} | {fmt(ws, 1)} "
            f"| {fmt(rss and rss / 1024, 1)} | {fmt(cpu, 2)} |")

    measured = [r for r in mine if num(r["ws_bytes"]) and num(r["ws_cached_before"]) is not None]
    ws_before = median(100 * num(r["ws_cached_before"]) / num(r["ws_bytes"]) for r in measured)
    beyond_before = median(num(r["beyond_before"]) for r in measured)
    lines += ["", f"Before each run (median): working set {fmt(ws_before, 1)} % cached, "
              f"file beyond it {fmt(beyond_before and beyond_before / MiB, 1)} MiB."]
    return lines


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: summarize_serve.py RESULTS.csv TABLE.md [NOTE]")
    csv_path, table_path = sys.argv[1], sys.argv[2]
    note = sys.argv[3] if len(sys.argv) == 4 else ""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))

    tput = throughputs(rows)
    out = [note, ""] if note else []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        out += table(rows, workload, tput) + [""]
    out.append("Throughput: median of the runs that succeeded (higher is better). Ratios: median "
               "over rounds of the throughput ratio within the round (above 1: faster). "
               "Only ratios within one run of the benchmark are comparable.")
    text = "\n".join(out) + "\n"
    with open(table_path, "w") as f:
        f.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
