#!/usr/bin/env python3
"""Turn the invocations of bench/ab.sh into one table per benchmark: old against new.

    summarize_ab.py DIR [BAR]

Reads DIR/ab-runs.csv (one row per invocation of a benchmark script: benchmark, round, side,
its directory, exit status, seconds, host steal) and each invocation's own CSV, prints the
tables (markdown) and writes them to DIR/ab.md, with DIR/ab-meta.txt (what was compared,
where) above them. Can be re-run on an old DIR. Only the standard library.

Per benchmark, per job and workload: the median of the old binary's runs, the median of the
new one's, and "new rel. old", always oriented so that above 1 means the new binary is better:
new / old for throughputs (MiB/s, IOPS), old / new for times (seconds). Then the median and the
range (min-max) of the same ratio taken round by round (the two runs of a round follow each
other). A ratio of medians below BAR (default 0.95) is marked. Failed runs, as each script
marks them (status, error, or a script that stopped), are listed and left out of the medians;
MISSING tools are listed too.
"""
import csv
import os
import statistics
import sys
from collections import defaultdict

# benchmark: (its CSV, what is measured, higher is better)
BENCHES = {
    "copy": ("results.csv", "wall time (s)", False),
    "serve": ("results.csv", "throughput", True),
    "prefetch": ("results.csv", "throughput", True),
    "coalesce": ("results.csv", "IOPS", True),
    "nbd": ("nbd.csv", "wall time (s)", False),
}


def num(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def coalesce_name(key):
    """coalesce.sh's CSV has the server's key: its name as in coalesce.sh's table."""
    if key == "coalesce":
        return "lightfoot --coalesce"
    if key.startswith("coalesce-"):
        return "lightfoot --coalesce --coalesce-block " + key[len("coalesce-"):]
    return key


def runs_of(bench, path):
    """Yields (job, workload, unit, value or None, problem or None) per run in one CSV.
    problem: None for a good run, "missing:TOOL", or what went wrong."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        if bench == "copy":
            status = r["status"]
            problem = None if status == "ok" else status
            yield r["job"], "", "s", num(r["wall_s"]), problem
        elif bench in ("serve", "prefetch"):
            if r["config"] == "sleep (control)":
                continue  # no throughput: it only sleeps
            status = r["status"]
            value = num(r["throughput"])
            problem = None if status == "ok" else status
            if problem is None and value is None:
                problem = "no throughput"
            unit = r["unit"] or ("MiB/s" if r["workload"] in ("seqread", "seqwrite") else "IOPS")
            yield r["config"], r["workload"], unit, value, problem
        elif bench == "coalesce":
            if r["traced"] != "0":
                continue  # a counting run, under perf: not timed
            value = num(r["iops"])
            problem = r["error"] or (None if value is not None else "no IOPS")
            yield coalesce_name(r["config"]), r["workload"], "IOPS", value, problem
        elif bench == "nbd":
            # nbd.sh stops at the first failure: every row it wrote is a good run.
            yield r["tool"], r["transfer"], "s", num(r["seconds"]), None


def fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def value_fmt(x, unit):
    if x is None:
        return "–"
    if unit == "IOPS":
        return f"{x:.0f}"
    if unit == "s":
        return f"{x:.2f}"
    return f"{x:.1f}"


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: summarize_ab.py DIR [BAR]")
    top = sys.argv[1]
    bar = float(sys.argv[2]) if len(sys.argv) == 3 else 0.95
    with open(os.path.join(top, "ab-runs.csv"), newline="") as f:
        invocations = list(csv.DictReader(f))
    out = []
    meta = os.path.join(top, "ab-meta.txt")
    if os.path.exists(meta):
        out += [line.rstrip("\n") for line in open(meta)] + [""]

    below_all, failed_all = [], 0
    for bench in dict.fromkeys(i["bench"] for i in invocations):
        csv_name, what, higher = BENCHES[bench]
        mine = [i for i in invocations if i["bench"] == bench]
        rounds = sorted({int(i["round"]) for i in mine})
        # (job, workload) -> side -> round -> value ; unit per key; problems per key
        values = defaultdict(lambda: {"old": {}, "new": {}})
        units, problems, missing = {}, defaultdict(list), defaultdict(set)
        notes = []
        for inv in mine:
            side, rnd = inv["side"], int(inv["round"])
            path = os.path.join(top, inv["dir"], csv_name)
            rc = inv["exit"]
            log = os.path.join(inv["dir"], "ab.log")
            if not os.path.exists(path):
                notes.append(f"round {rnd}, {side}: no {csv_name} (exit {rc}); see {log}")
                failed_all += 1
                continue
            if rc != "0":
                notes.append(f"round {rnd}, {side}: the script exited with {rc}; see {log}")
            for job, wl, unit, value, problem in runs_of(bench, path):
                key = (job, wl)
                units.setdefault(key, unit)
                values[key]  # keep the job in the table, even with no good run
                if problem is None:
                    values[key][side][rnd] = value
                elif problem.startswith("missing:"):
                    missing[key].add(problem.split(":", 1)[1])
                else:
                    problems[key].append(f"{side} r{rnd}: {problem}")
                    failed_all += 1
            if rc != "0" and bench == "nbd":
                # nbd.sh dies at a failed run without a row: that run is gone, not counted.
                failed_all += 1

        ratio_name = "new / old" if higher else "old / new"
        out.append(f"### {bench}: {what}, {'higher' if higher else 'lower'} is better; "
                   f"new rel. old = {ratio_name} (above 1: new is better)")
        out.append("")
        has_wl = any(wl for _, wl in values)
        head = ["job"] + (["workload"] if has_wl else []) + [
            "unit", "runs ok old, new", "old median", "new median", "new rel. old",
            "same-round median", "same-round min-max", f"≥ {bar:g}"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for (job, wl), sides in values.items():
            unit = units[(job, wl)]
            old, new = sides["old"], sides["new"]
            cells = [job] + ([wl] if has_wl else []) + [unit]
            runs = f"{len(old)}/{len(rounds)}, {len(new)}/{len(rounds)}"
            if problems[(job, wl)]:
                runs += f" **{len(problems[(job, wl)])} failed**"
            if missing[(job, wl)]:
                runs += " MISSING: " + ", ".join(sorted(missing[(job, wl)]))
            mo = statistics.median(old.values()) if old else None
            mn = statistics.median(new.values()) if new else None
            ratio = None
            if mo and mn:
                ratio = mn / mo if higher else mo / mn
            per_round = [(new[r] / old[r] if higher else old[r] / new[r])
                         for r in rounds if r in old and r in new and old[r] and new[r]]
            same = statistics.median(per_round) if per_round else None
            span = f"{min(per_round):.3f}-{max(per_round):.3f}" if per_round else "–"
            if ratio is None:
                verdict = "**no data**"
                why = ("MISSING: " + ", ".join(sorted(missing[(job, wl)]))
                       if missing[(job, wl)] else "no data")
                below_all.append(f"{bench}: {job}{' / ' + wl if wl else ''} ({why})")
            elif ratio < bar:
                verdict = f"**BELOW {bar:g}**"
                below_all.append(f"{bench}: {job}{' / ' + wl if wl else ''} ({ratio:.3f})")
            else:
                verdict = "ok"
            cells += [runs, value_fmt(mo, unit), value_fmt(mn, unit), fmt(ratio, 3), fmt(same, 3),
                      span, verdict]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        for (job, wl), ps in problems.items():
            if not ps:
                continue
            out.append(f"- failed, left out: {job}{' / ' + wl if wl else ''}: " + "; ".join(ps))
        for n in notes:
            out.append(f"- {n}")
        secs = [num(i["seconds"]) for i in mine if num(i["seconds"]) is not None]
        steal = [num(i["steal_pct"]) for i in mine if num(i["steal_pct"]) is not None]
        order = ", ".join(f"{i['round']}:{i['side']}" for i in mine)
        out.append(f"- {len(rounds)} round(s); order of the invocations: {order}; "
                   f"{sum(secs) / 60:.1f} min in all"
                   + (f"; host steal per invocation: median {statistics.median(steal):.0f} %, "
                      f"max {max(steal):.0f} %" if steal else ""))
        out.append("")

    out.append(f"Medians over the rounds of each binary's good runs; \"new rel. old\" is the ratio "
               f"of those medians (the acceptance figure, bar {bar:g}); the same-round columns take "
               f"the ratio within each round (both runs of a round follow each other), then its "
               f"median and range.")
    if failed_all:
        out.append(f"\n**{failed_all} failed run(s) or invocation(s)**: listed above, left out.")
    if below_all:
        out.append(f"\n**Below {bar:g} or without data**: " + "; ".join(below_all) + ".")
    else:
        out.append(f"\nEvery job: new rel. old ≥ {bar:g}.")
    text = "\n".join(out) + "\n"
    with open(os.path.join(top, "ab.md"), "w") as f:
        f.write(text)
    sys.stdout.write(text)
    sys.exit(1 if failed_all else (2 if below_all else 0))


if __name__ == "__main__":
    main()
