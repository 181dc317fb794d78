#!/usr/bin/env python3
"""Turn bench/s3.sh's s3.csv into its tables: per latency, per job, the median figure of
every configuration and lightfoot / peer taken round by round.

    summarize_s3.py s3.csv TABLE.md [NOTE]

Prints the tables (markdown) and writes them to TABLE.md, with NOTE (what was run, where)
above them. Can be re-run on an old s3.csv. Only the standard library.

Medians are over the runs that succeeded. A ratio is lightfoot's figure over the peer's in
the same round and at the same latency (the rounds alternate the order of the
configurations, so a machine that drifts moves both sides of a ratio together), then the
median of those. For MiB/s and IOPS above 1 means lightfoot did better; for trim (seconds)
below 1 does.
"""
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from summarize import MiB, fmt, median, num  # noqa: E402

NBD_JOBS = {
    "nbdcopy": ("nbdcopy URI null: (whole image, sequential)", "MiB/s"),
    "seqread": ("4 KiB sequential readers (fio nbd, 4 jobs x iodepth 1)", "MiB/s"),
    "randwrite": ("random 4 KiB writes (fio nbd, 4 jobs x iodepth 1, FLUSH every 64)", "IOPS"),
    "trim": ("TRIM of the whole device, fully written", "s"),
}
COPY_JOBS = {
    "copy-up": "local file -> s3:// (the local file is the source)",
    "copy-down": "s3:// -> local file (the local file is the destination)",
}
NAMES = {
    "lf-one": "lightfoot one object",
    "nbdkit-one": "nbdkit S3 one object",
    "nbdkit": "nbdkit S3 64K",
    "nbdkit-bs": "nbdkit S3 64K + blocksize",
    "lightfoot": "lightfoot copy",
    "lightfoot-object": "lightfoot copy (one object)",
    "rclone": "rclone copyto",
    "aws": "aws s3 cp",
}


def name(config):
    """lf-SIZE[-prefetch|-coalesce]: lightfoot serve at object size SIZE; else NAMES."""
    if config in NAMES:
        return NAMES[config]
    parts = config.split("-")
    flag = f" --{parts[2]}" if len(parts) > 2 else ""
    return f"lightfoot {parts[1]}{flag}"


def figure(r):
    """The job's figure: the rate, or the seconds for trim."""
    return num(r["seconds"]) if r["job"] == "trim" else num(r["rate"])


def ratio(rows, config, peer):
    """Median over rounds of figure(config) / figure(peer), rounds where both succeeded."""
    by = {}
    for r in rows:
        if r["ok"] == "1":
            by[(r["config"], r["round"])] = figure(r)
    out = []
    for (c, rnd), v in by.items():
        p = by.get((peer, rnd))
        if c == config and v is not None and p:
            out.append(v / p)
    return median(out)


def requests(rows, prefix, keys):
    """Median request counts as "a / b / c", or n/a."""
    vals = []
    for k in keys:
        m = median(num(r[prefix + k]) for r in rows)
        if m is None:
            return "n/a"
        vals.append(f"{m:.0f}")
    return " / ".join(vals)


def per_op(rows, key):
    return median(num(r[key]) / num(r["ops"]) for r in rows if num(r[key]) is not None and num(r["ops"]))


def runs(mine):
    ok = [r for r in mine if r["ok"] == "1"]
    bad = [r["error"] or "failed" for r in mine if r["ok"] != "1"]
    text = f"{len(ok)}/{len(mine)}"
    if bad:
        text += " **" + ", ".join(sorted(set(bad))) + "**"
    return ok, text


def steal(rows):
    s = median(num(r["steal_pct"]) for r in rows)
    return fmt(s, 0)


def nbd_table(rows, job):
    title, unit = NBD_JOBS[job]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    blocks = next((c for c in configs if c.startswith("nbdkit") and c != "nbdkit-one"), None)

    def peer_of(c):
        # Each layout against nbdkit in the same layout.
        return "nbdkit-one" if c.endswith("-one") and "nbdkit-one" in configs else blocks
    better = "below 1: lightfoot faster" if unit == "s" else "above 1: lightfoot faster"
    out = [f"#### {job}: {title}", ""]
    head = f"| configuration | runs ok | {unit} | lightfoot / nbdkit ({better}) | store GET / PUT / DELETE / LIST "
    cols = 5
    if job in ("seqread", "randwrite"):
        head += "| store GETs per client op | store PUTs per client op "
        cols += 2
    if job == "trim":
        head += "| objects left "
        cols += 1
    head += "| lightfoot's own GET / PUT / DELETE / LIST / HEAD | server RSS MiB | server CPU s | host steal % |"
    cols += 4
    out += [head, "|" + "---|" * cols]
    for c in configs:
        mine = [r for r in rows if r["config"] == c]
        ok, text = runs(mine)
        peer = peer_of(c)
        x = "–" if c.startswith("nbdkit") or peer is None else fmt(ratio(rows, c, peer), 3)
        line = (f"| {name(c)} | {text} | {fmt(median(figure(r) for r in ok), 2 if unit != 'IOPS' else 0)} "
                f"| {x} | {requests(ok, '', ['get', 'put', 'delete', 'list'])} ")
        if job in ("seqread", "randwrite"):
            line += f"| {fmt(per_op(ok, 'get'), 2)} | {fmt(per_op(ok, 'put'), 2)} "
        if job == "trim":
            line += f"| {fmt(median(num(r['left_objects']) for r in ok), 0)} "
        rss = median(num(r["rss_kib"]) for r in ok)
        line += (f"| {requests(ok, 'lf_', ['get', 'put', 'delete', 'list', 'head'])} "
                 f"| {fmt(rss and rss / 1024, 1)} | {fmt(median(num(r['cpu_s']) for r in ok), 2)} | {steal(ok)} |")
        out.append(line)
    return out


def copy_table(rows, job):
    configs = list(dict.fromkeys(r["config"] for r in rows))
    peers = [c for c in ("rclone", "aws") if c in configs]
    out = [f"#### {job}: {COPY_JOBS[job]}", ""]
    head = "| tool | runs ok | MiB/s | s |"
    head += "".join(f" lightfoot / {NAMES[p]} (above 1: faster) |" for p in peers)
    head += (" local file cached after, MiB (max) | of it dirty, MiB (max) | peak RSS MiB | CPU s "
             "| store GET / PUT / DELETE / LIST | lightfoot's own GET / PUT / DELETE / LIST / HEAD | host steal % |")
    out += [head, "|" + "---|" * (11 + len(peers))]
    for c in configs:
        mine = [r for r in rows if r["config"] == c]
        ok, text = runs(mine)
        xs = "".join(
            f" {'–' if not c.startswith('lightfoot') else fmt(ratio(rows, c, p), 3)} |" for p in peers)
        cached = max((num(r["cached_bytes"]) for r in ok if num(r["cached_bytes"]) is not None), default=None)
        dirty = max((num(r["dirty_bytes"]) for r in ok if num(r["dirty_bytes"]) is not None), default=None)
        rss = median(num(r["rss_kib"]) for r in ok)
        out.append(
            f"| {NAMES.get(c, c)} | {text} | {fmt(median(num(r['rate']) for r in ok), 1)} "
            f"| {fmt(median(num(r['seconds']) for r in ok), 2)} |{xs} "
            f"{fmt(cached and cached / MiB, 1)} | {fmt(dirty and dirty / MiB, 1)} | {fmt(rss and rss / 1024, 1)} "
            f"| {fmt(median(num(r['cpu_s']) for r in ok), 2)} | {requests(ok, '', ['get', 'put', 'delete', 'list'])} "
            f"| {requests(ok, 'lf_', ['get', 'put', 'delete', 'list', 'head'])} | {steal(ok)} |")
    return out


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: summarize_s3.py s3.csv TABLE.md [NOTE]")
    csv_path, table_path = sys.argv[1], sys.argv[2]
    note = sys.argv[3] if len(sys.argv) == 4 else ""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))

    lines = [note, ""] if note else []
    for lat in dict.fromkeys(r["latency_ms"] for r in rows):
        at = [r for r in rows if r["latency_ms"] == lat]
        heads = [r for r in at if r["job"] == "head"]
        through = median(num(r["seconds"]) for r in heads)
        direct = median(num(r["rate"]) for r in heads)
        how = {"0": "directly, no proxy", "0p": "through Toxiproxy, nothing added"}.get(
            lat, "responses held by Toxiproxy"
        )
        lines += [f"### added latency {lat.rstrip('p')} ms ({how})", ""]
        if heads:
            lines += [f"HEAD requests (curl, median of the rounds' medians): {fmt(through and through * 1000, 2)} ms "
                      f"through the endpoint, {fmt(direct and direct * 1000, 2)} ms directly.", ""]
        for job in NBD_JOBS:
            mine = [r for r in at if r["job"] == job]
            if mine:
                lines += nbd_table(mine, job) + [""]
        for job in COPY_JOBS:
            mine = [r for r in at if r["job"] == job]
            if mine:
                lines += copy_table(mine, job) + [""]
    rounds = len(set(r["round"] for r in rows))
    lines.append(
        f"{rounds} round(s), medians. Ratios: median over rounds of lightfoot's figure over the peer's in the "
        "same round and latency. Store requests: SeaweedFS's counters around the run (a HEAD counts as a "
        "GET, a multipart part as a PUT, a multi-object delete as one DELETE; a writable lightfoot's "
        "lease adds a PUT every 10 s and a DELETE at exit), read after the server started, so they leave "
        "out its opening; lightfoot's own counts include it (the manifest's GET, "
        "the LIST of its objects). Only ratios within one run of the benchmark are comparable.")
    text = "\n".join(lines) + "\n"
    with open(table_path, "w") as f:
        f.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
