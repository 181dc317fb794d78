#!/usr/bin/env python3
"""Draw the plots of docs/benchmarks.md from the figures checked in beside them.

    python3 bench/plot.py            # docs/benchmarks/runs/data/NAME.csv -> docs/benchmarks/runs/plots/NAME.svg
    python3 bench/plot.py --check    # exit 1 if a checked-in SVG differs from what the data gives

Each CSV holds one run of a benchmark, copied by hand from its log in docs/benchmarks/runs/.
Lines starting with "# KEY: VALUE" describe the run (title, date, machine, lightfoot, command,
source; "note" may repeat); the rest is a CSV table with the columns

    panel   one group of bars (a workload, or one measure of a run)
    axis    the label of that panel's x axis; panels with the same axis share its scale
    bar     the configuration (server, job, tool)
    kind    lightfoot, peer or reference (a yardstick that is not a peer: a bare loop, fio
            on the device, nbdkit null); sets the colour
    value   the bar's length, a number in the axis's unit, as the log gives it
    label   the text printed after the bar, copied from the log (the value if empty)

Output is a horizontal bar chart per CSV, written by hand as SVG with the standard library
only (no matplotlib on these machines). Same input, same bytes: no dates, no randomness,
coordinates printed with one decimal.
"""

import csv
import math
import sys
import textwrap
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "benchmarks" / "runs" / "data"
PLOTS = ROOT / "docs" / "benchmarks" / "runs" / "plots"

COLOURS = {"lightfoot": "#1f6fb2", "peer": "#9aa5b1", "reference": "#e0a43a"}
LEGEND = {"lightfoot": "lightfoot", "peer": "peer", "reference": "reference (not a peer)"}
COLUMNS = ["panel", "axis", "bar", "kind", "value", "label"]

FONT = "DejaVu Sans, Verdana, Arial, sans-serif"
CHAR = 6.6  # estimated width of one 12 px character; text is laid out from it
BAR_AREA = 420  # width of the longest bar
ROW = 18  # height of one bar's row
PAD = 16


def read(path):
    """Return (metadata dict, notes list, rows) of one data file."""
    meta, notes, body = {}, [], []
    for count, entry in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if entry.startswith("#"):
            key, sep, value = entry[1:].partition(":")
            if not sep:
                sys.exit(f"{path}:{count}: a comment line must read '# key: value'")
            key, value = key.strip(), value.strip()
            if key == "note":
                notes.append(value)
            else:
                meta[key] = value
        elif entry.strip():
            body.append(entry)
    for key in ("title", "date", "source"):
        if key not in meta:
            sys.exit(f"{path}: no '# {key}:' line")
    reader = csv.DictReader(body)
    if reader.fieldnames != COLUMNS:
        sys.exit(f"{path}: columns must be {','.join(COLUMNS)}")
    rows = list(reader)
    for row in rows:
        if row["kind"] not in COLOURS:
            sys.exit(f"{path}: kind {row['kind']!r} is not one of {', '.join(COLOURS)}")
        row["number"] = float(row["value"])
        if row["number"] < 0:
            sys.exit(f"{path}: negative value {row['value']}")
    return meta, notes, rows


def ticks(top):
    """A round scale end and its ticks: 1, 2, 2.5 or 5 times a power of ten, at most 6 steps."""
    if top <= 0:
        return 1.0, [0.0, 1.0]
    power = 10.0 ** math.floor(math.log10(top / 6))
    for factor in (1, 2, 2.5, 5, 10):
        step = factor * power
        if top / step <= 6:
            break
    count = math.ceil(top / step - 1e-9)
    return count * step, [i * step for i in range(count + 1)]


def number(x):
    return f"{x:.10g}"


def f(x):
    return f"{x:.1f}"


def text(x, y, content, size=12, anchor="start", weight=None, fill="#222"):
    attrs = f'x="{f(x)}" y="{f(y)}" font-size="{size}"'
    if anchor != "start":
        attrs += f' text-anchor="{anchor}"'
    if weight:
        attrs += f' font-weight="{weight}"'
    if fill != "#222":
        attrs += f' fill="{fill}"'
    return f"<text {attrs}>{escape(content)}</text>"


def line(x1, y1, x2, y2, colour="#222"):
    return f'<line x1="{f(x1)}" y1="{f(y1)}" x2="{f(x2)}" y2="{f(y2)}" stroke="{colour}"/>'


def render(meta, notes, rows):
    panels = []  # (name, axis, rows) in file order
    for row in rows:
        if not panels or panels[-1][0] != row["panel"]:
            panels.append((row["panel"], row["axis"], []))
        panels[-1][2].append(row)
    scale = {}
    for _, axis, group in panels:
        scale[axis] = max([scale.get(axis, 0.0)] + [r["number"] for r in group])
    scale = {axis: ticks(top) for axis, top in scale.items()}

    names = max(len(r["bar"]) for r in rows)
    labels = max(len(r["label"] or r["value"]) for r in rows)
    left = PAD + names * CHAR + 10
    width = math.ceil(left + BAR_AREA + 8 + labels * CHAR * 0.92 + PAD)
    wrap = max(60, int((width - 2 * PAD) / (CHAR * 0.92)))

    out = []
    y = PAD
    for piece in textwrap.wrap(f"{meta['title']} ({meta['date']})", int((width - 2 * PAD) / (CHAR * 1.3))):
        y += 19
        out.append(text(PAD, y, piece, size=15, weight="bold"))
    for key in ("machine", "lightfoot"):
        if key in meta:
            for piece in textwrap.wrap(f"{key}: {meta[key]}", wrap):
                y += 16
                out.append(text(PAD, y, piece, size=11, fill="#444"))
    y += 20
    x = PAD
    for kind in COLOURS:
        if any(r["kind"] == kind for r in rows):
            out.append(f'<rect x="{f(x)}" y="{f(y - 10)}" width="12" height="12" fill="{COLOURS[kind]}"/>')
            out.append(text(x + 17, y, LEGEND[kind], size=11))
            x += 17 + len(LEGEND[kind]) * CHAR * 0.92 + 18

    for name, axis, group in panels:
        end, marks = scale[axis]
        y += 28
        out.append(text(PAD, y, name, size=13, weight="bold"))
        y += 8
        top = y
        bottom = top + len(group) * ROW + 4
        for mark in marks:
            gx = left + BAR_AREA * mark / end
            out.append(line(gx, top, gx, bottom, "#e2e2e2"))
        for i, row in enumerate(group):
            row_top = top + 4 + i * ROW
            length = BAR_AREA * row["number"] / end
            out.append(text(left - 8, row_top + 11, row["bar"], anchor="end"))
            if length > 0:
                out.append(
                    f'<rect x="{f(left)}" y="{f(row_top)}" width="{f(length)}" height="13" '
                    f'fill="{COLOURS[row["kind"]]}"><title>{escape(row["bar"])}: '
                    f'{escape(row["value"])}</title></rect>'
                )
            out.append(text(left + length + 5, row_top + 11, row["label"] or row["value"], size=11))
        out.append(line(left, top, left, bottom))
        out.append(line(left, bottom, left + BAR_AREA, bottom))
        for mark in marks:
            gx = left + BAR_AREA * mark / end
            out.append(line(gx, bottom, gx, bottom + 4))
            out.append(text(gx, bottom + 16, number(mark), size=10, anchor="middle"))
        y = bottom + 32
        out.append(text(left + BAR_AREA / 2, y, axis, size=11, anchor="middle"))

    y += 8
    footer = [f"source: {meta['source']}"]
    if "command" in meta:
        footer.append(f"command: {meta['command']}")
    for entry in footer + notes:
        for piece in textwrap.wrap(entry, wrap):
            y += 14
            out.append(text(PAD, y, piece, size=10, fill="#555"))
    height = math.ceil(y + PAD)

    head = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family={quoteattr(FONT)}>\n'
        f"<title>{escape(meta['title'])} ({escape(meta['date'])})</title>\n"
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>\n'
    )
    return head + "\n".join(out) + "\n</svg>\n"


def main(argv):
    check = argv[1:] == ["--check"]
    if argv[1:] and not check:
        sys.exit(__doc__.strip().splitlines()[0] + "\nusage: python3 bench/plot.py [--check]")
    # A plot's CSV starts with its '# key: value' lines; the runs' raw tables kept beside them
    # (copied from bench logs, no header) are not plots.
    sources = [p for p in sorted(DATA.glob("*.csv")) if p.read_text(encoding="utf-8").startswith("#")]
    if not sources:
        sys.exit(f"no data in {DATA}")
    stale = []
    for source in sources:
        svg = render(*read(source))
        target = PLOTS / (source.stem + ".svg")
        if check:
            if not target.exists() or target.read_text(encoding="utf-8") != svg:
                stale.append(target)
            continue
        PLOTS.mkdir(parents=True, exist_ok=True)
        with open(target, "w", encoding="utf-8", newline="\n") as out:
            out.write(svg)
        print(target.relative_to(ROOT))
    for target in stale:
        print(f"out of date: {target.relative_to(ROOT)} (run python3 bench/plot.py)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
