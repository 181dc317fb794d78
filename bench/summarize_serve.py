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

Columns that only some runs can fill appear only when a table has something for them: the
ratio to the `device` config (fio reading the file itself with O_DIRECT, no server), the
ratio of a `--prefetch` server to the same server without it, the page-cache footprint as a
share of the bytes the client moved (CSVs from before that column existed have no byte
counts), and the prefetch filter's hits. When the servers of issue 5 (`serve --prefetch`,
PRESET=prefetch) are in the CSV, a last table checks its targets.
"""
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from summarize import MiB, fmt, median, num  # noqa: E402

NBDKIT = "nbdkit file"
NEUTRAL_PEERS = ("nbdkit file cache=none", "qemu-nbd --cache=none")
CONTROL = "sleep (control)"
DEVICE = "device (fio O_DIRECT, no server)"  # fio reading the file itself: a reference
PREFETCH = " --prefetch"  # "lightfoot --prefetch" is compared with "lightfoot", and so on
LF_PREFETCH = "lightfoot --prefetch"
LF_DIRECT = "lightfoot --cache=direct"
LF_DIRECT_PREFETCH = "lightfoot --cache=direct --prefetch"

WORKLOADS = {
    "seqread": "Sequential read: `nbdcopy URI null:`",
    "seqwrite": "Sequential write: `nbdcopy --flush -- [ nbdkit pattern size=SIZE ] URI`",
    "randread": "4 KiB random read: fio nbd engine, 4 jobs × iodepth 1",
    "randwrite": "4 KiB random write, a flush every 64 writes per job: fio nbd engine, "
                 "4 jobs × iodepth 1",
    "seqread4k": "4 KiB sequential read: fio nbd engine, 4 jobs × iodepth 1, each in its own "
                 "quarter of the file beyond the working set",
    "interleave3": "3 interleaved 4 KiB sequential streams on one connection, one request at a "
                   "time, each in its own third of the file beyond the working set: "
                   "examples/interleave.rs",
    "mixed": "4 KiB reads, 70 % random and 30 % continuing the previous one: fio nbd engine, "
             "4 jobs × iodepth 1, percentage_random=70",
}

# Issue 5's targets: (what, workload, server, base servers, at least). The base of a ratio is
# the fastest of the base servers in each round, as in ratio_by_round.
TARGETS = [
    ("direct + prefetch, 4-job sequential vs nbdkit file", "seqread4k", LF_DIRECT_PREFETCH,
     (NBDKIT,), 0.9),
    ("direct + prefetch, 4-job sequential vs direct", "seqread4k", LF_DIRECT_PREFETCH,
     (LF_DIRECT,), 2.5),
    ("direct + prefetch, interleaved vs nbdkit file", "interleave3", LF_DIRECT_PREFETCH,
     (NBDKIT,), 1.0),
    ("direct + prefetch, random vs direct", "randread", LF_DIRECT_PREFETCH, (LF_DIRECT,), 0.95),
    ("direct + prefetch, mixed vs direct (not in the issue)", "mixed", LF_DIRECT_PREFETCH,
     (LF_DIRECT,), 0.95),
    ("neutral + prefetch, 4-job sequential vs nbdkit file", "seqread4k", LF_PREFETCH,
     (NBDKIT,), 0.9),
    ("neutral + prefetch, interleaved vs nbdkit file", "interleave3", LF_PREFETCH, (NBDKIT,), 0.9),
]
FOOTPRINT_MAX = 1.0  # % of the bytes read left in the page cache


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


def without_prefetch(config, configs=()):
    """The server a --prefetch server is compared with (None for the others): the same with
    --no-prefetch when the run has it (prefetch is on by default since issue 44), else the
    same without the flag (a binary from before)."""
    if not config.endswith(PREFETCH):
        return None
    plain = config.replace(PREFETCH, " --no-prefetch")
    return plain if plain in configs else config.replace(PREFETCH, "")


def footprint(r):
    """% of the bytes the client moved that the run left cached beyond the working set (what
    the file had cached there before the run is not counted)."""
    after, before, moved = num(r.get("beyond")), num(r.get("beyond_before")), num(r.get("bytes"))
    if after is None or not moved:
        return None
    return 100 * max(0.0, after - (before or 0)) / moved


def hit_rate(r):
    hits, misses = num(r.get("pf_hits")), num(r.get("pf_misses"))
    if hits is None or misses is None or hits + misses == 0:
        return None
    return 100 * hits / (hits + misses)


def table(rows, workload, tput):
    mine = [r for r in rows if r["workload"] == workload]
    unit = next((r["unit"] for r in mine if r["unit"]),
                "IOPS" if workload.startswith("rand") else "MiB/s")
    digits = 0 if unit == "IOPS" else 1
    title = WORKLOADS.get(workload, workload)
    configs = list(dict.fromkeys(r["config"] for r in mine))  # order of first appearance
    ok_rows = [r for r in mine if r["status"] == "ok"]
    # The optional columns, when this table has something to put in them.
    show_pf_ratio = any(without_prefetch(c, configs) in configs for c in configs)
    show_footprint = any(footprint(r) is not None for r in ok_rows)
    show_hits = any(hit_rate(r) is not None for r in ok_rows)
    show_device = DEVICE in configs
    head = ["server", "runs ok", unit, "× nbdkit file", "× best neutral peer"]
    if show_device:
        head.append("× device")
    if show_pf_ratio:
        head.append("× without --prefetch")
    head.append("beyond WS MiB")
    if show_footprint:
        head.append("cached % of bytes")
    head.append("WS kept %")
    if show_hits:
        head += ["prefetch hits %", "read ahead unread MiB"]
    head += ["peak RSS MiB", "server CPU s"]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for config in configs:
        runs = [r for r in mine if r["config"] == config]
        missing = [r["status"] for r in runs if r["status"].startswith("missing:")]
        if missing:
            tool = missing[0].split(":", 1)[1]
            lines.append(f"| {config} | MISSING: {tool} |" + " |" * (len(head) - 2))
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
        cells = [config, count, fmt(t, digits), fmt(x_nbdkit, 2), fmt(x_neutral, 2)]
        if show_device:
            x_dev = None if control else ratio_by_round(tput, workload, config, (DEVICE,))
            cells.append(fmt(x_dev, 2))
        if show_pf_ratio:
            base = without_prefetch(config, configs)
            x_pf = ratio_by_round(tput, workload, config, (base,)) if base else None
            cells.append(fmt(x_pf, 2))
        cells.append(fmt(beyond and beyond / MiB, 1))
        if show_footprint:
            cells.append(fmt(median(footprint(r) for r in ok), 2))
        cells.append(fmt(ws, 1))
        if show_hits:
            unread = median(num(r.get("pf_unread")) for r in ok)
            cells += [fmt(median(hit_rate(r) for r in ok), 1), fmt(unread and unread / MiB, 1)]
        cells += [fmt(rss and rss / 1024, 1), fmt(cpu, 2)]
        lines.append("| " + " | ".join(cells) + " |")

    measured = [r for r in mine if num(r["ws_bytes"]) and num(r["ws_cached_before"]) is not None]
    ws_before = median(100 * num(r["ws_cached_before"]) / num(r["ws_bytes"]) for r in measured)
    beyond_before = median(num(r["beyond_before"]) for r in measured)
    lines += ["", f"Before each run (median): working set {fmt(ws_before, 1)} % cached, "
              f"file beyond it {fmt(beyond_before and beyond_before / MiB, 1)} MiB."]
    return lines


def targets(rows, tput):
    """Issue 5's targets, for those whose servers and workloads are in the CSV."""
    present = {(r["workload"], r["config"]) for r in rows}
    lines = []
    for what, workload, config, bases, least in TARGETS:
        if (workload, config) not in present or not any((workload, b) in present for b in bases):
            continue
        x = ratio_by_round(tput, workload, config, bases)
        verdict = "–" if x is None else ("met" if x >= least else "**not met**")
        lines.append(f"| {what} | × ≥ {least:g} | {fmt(x, 2)} | {verdict} |")
    # Footprint: the worst (largest) median over the workloads, per prefetch server.
    for config in (LF_DIRECT_PREFETCH, LF_PREFETCH):
        per_wl = {}
        for r in rows:
            if r["config"] == config and r["status"] == "ok" and footprint(r) is not None:
                per_wl.setdefault(r["workload"], []).append(footprint(r))
        if not per_wl:
            continue
        worst_wl, worst = max(((wl, median(v)) for wl, v in per_wl.items()), key=lambda p: p[1])
        verdict = "met" if worst <= FOOTPRINT_MAX else "**not met**"
        lines.append(f"| {config}: page-cache footprint, worst workload ({worst_wl}) "
                     f"| ≤ {FOOTPRINT_MAX:g} % of bytes read | {fmt(worst, 2)} % | {verdict} |")
        rss = [num(r["server_peak_rss_kib"]) for r in rows
               if r["config"] == config and r["status"] == "ok"]
        rss = [v for v in rss if v is not None]
        if rss:
            lines.append(f"| {config}: peak RSS, largest run | within the buffer's bound "
                         f"(`--prefetch-size`, 64 MiB by default) plus the server's own "
                         f"| {max(rss) / 1024:.1f} MiB | judge |")
    if not lines:
        return []
    return ["### Issue 5 targets (`serve --prefetch`)", "",
            "| target | needs | measured | |", "|---|---|---|---|"] + lines + [
            "", "Ratios: median over rounds, as in the tables above. Footprint: what the run "
            "left cached beyond the working set, over the bytes the client read (median of the "
            "runs, the worst workload shown)."]


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
    goals = targets(rows, tput)
    if goals:
        out += goals + [""]
    out.append("Throughput: median of the runs that succeeded (higher is better). Ratios: median "
               "over rounds of the throughput ratio within the round (above 1: faster). "
               "Only ratios within one run of the benchmark are comparable.")
    text = "\n".join(out) + "\n"
    with open(table_path, "w") as f:
        f.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
