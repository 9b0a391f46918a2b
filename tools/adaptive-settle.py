#!/usr/bin/env python3
"""Settling times of the gateway's adaptive concurrency limit, from adaptive-load's CSV.

Reads the timeline that `adaptive-load --csv` writes (`t_ms,ok,shed,limit,capacity`, one
row per slice, t_ms the end of the slice; `limit` and `capacity` may be empty) and splits
it into phases at each change of the upstream's capacity C (the first row that shows the
new C marks the change: up to one slice plus one poll late). For each phase it takes the
median of the limit over the phase's last TAIL seconds, and the settling time: from the
change until the limit stays within +-BAND of that median to the end of the phase.

Prints one JSON object on stdout: the time-weighted mean of C over the run, the
upstream's capacity in requests per second (mean C / S), and one entry per phase
(`start` for the first, then each change). With --svg it also draws the run: the limit,
C and the ideal in-flight C x (1 + buffer) over time with the changes marked, and below
it the 2xx per second against C / S. Hand-written SVG, Python's standard library only.

Usage: adaptive-settle.py TIMELINE.csv [--service-ms 5] [--buffer 0.25] [--tail 3]
                          [--band 0.2] [--svg out.svg] [--title TEXT]
"""

import argparse
import csv
import json
import statistics
import sys
from xml.sax.saxutils import escape


def number(text):
    """The cell as a float, or None if empty."""
    text = (text or "").strip()
    return float(text) if text else None


def read_rows(path):
    """The timeline's rows as dicts of floats (None for an empty cell)."""
    with open(path, newline="", encoding="utf-8") as f:
        return [
            {key: number(row.get(key)) for key in ("t_ms", "ok", "shed", "limit", "capacity")}
            for row in csv.DictReader(f)
        ]


def phases(rows):
    """(start index, end index) of each run of rows with one capacity; rows whose
    capacity is unknown stay in the phase they fall in."""
    bounds, current = [0], None
    for i, row in enumerate(rows):
        c = row["capacity"]
        if c is None:
            continue
        if current is not None and c != current:
            bounds.append(i)
        current = c
    bounds.append(len(rows))
    return [(bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1) if bounds[k] < bounds[k + 1]]


def settle(rows, start, end, slice_ms, tail_ms, band):
    """Median of the limit over the phase's tail and the time from the phase's start
    until the limit stays within the band around it (None if it never does)."""
    t0 = rows[start]["t_ms"] - slice_ms
    t1 = rows[end - 1]["t_ms"]
    samples = [(r["t_ms"], r["limit"]) for r in rows[start:end] if r["limit"] is not None]
    tail = [v for t, v in samples if t > t1 - tail_ms]
    if not tail:
        return None, None
    median = statistics.median(tail)
    low, high = median * (1 - band), median * (1 + band)
    settled_at = t0
    for i, (t, v) in enumerate(samples):
        if not low <= v <= high:
            if i + 1 == len(samples):
                return median, None
            settled_at = samples[i + 1][0]
    return median, max(0.0, settled_at - t0)


def time_weighted_capacity(rows):
    """Mean C over the rows that know it (each row is one equal slice)."""
    known = [r["capacity"] for r in rows if r["capacity"] is not None]
    return sum(known) / len(known) if known else None


def svg(rows, changes, slice_ms, service_ms, buffer, title):
    """The two-panel chart as SVG text."""
    width, left, right = 900, 70, 20
    top_h, bottom_h, gap, head = 260, 180, 50, 40
    height = head + top_h + gap + bottom_h + 40
    t_max = max((r["t_ms"] for r in rows), default=1.0) or 1.0
    plot_w = width - left - right

    def x(t):
        return left + plot_w * t / t_max

    def nice(v):
        """A round upper bound for an axis."""
        if v <= 0:
            return 1.0
        step = 10 ** (len(str(int(v))) - 1)
        return float(((int(v) // step) + 1) * step)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="15">{escape(title)}</text>',
    ]

    def panel(y0, h, y_max, series, label):
        def y(v):
            return y0 + h - h * min(v, y_max) / y_max

        out.append(f'<rect x="{left}" y="{y0}" width="{plot_w}" height="{h}" fill="none" stroke="#999"/>')
        for k in range(6):
            v = y_max * k / 5
            out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>')
            out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
        out.append(
            f'<text x="16" y="{y0 + h / 2:.0f}" transform="rotate(-90 16 {y0 + h / 2:.0f})" '
            f'text-anchor="middle">{escape(label)}</text>'
        )
        for t_ms, _, _ in changes:
            out.append(
                f'<line x1="{x(t_ms):.1f}" x2="{x(t_ms):.1f}" y1="{y0}" y2="{y0 + h}" '
                'stroke="#d33" stroke-dasharray="5,4"/>'
            )
        for k, (name, points, colour, dash) in enumerate(series):
            segments, current = [], []
            for t, v in points:
                if v is None:
                    if current:
                        segments.append(current)
                    current = []
                else:
                    current.append(f"{x(t):.1f},{y(v):.1f}")
            if current:
                segments.append(current)
            for seg in segments:
                out.append(
                    f'<polyline fill="none" stroke="{colour}" stroke-width="1.6"'
                    f'{f" stroke-dasharray={chr(34)}{dash}{chr(34)}" if dash else ""} points="{" ".join(seg)}"/>'
                )
            lx = left + 10 + 190 * k
            out.append(
                f'<line x1="{lx}" x2="{lx + 24}" y1="{y0 - 8}" y2="{y0 - 8}" stroke="{colour}" stroke-width="2"'
                f'{f" stroke-dasharray={chr(34)}{dash}{chr(34)}" if dash else ""}/>'
            )
            out.append(f'<text x="{lx + 30}" y="{y0 - 4}">{escape(name)}</text>')

    y_top = head + 20
    capacity = [(r["t_ms"], r["capacity"]) for r in rows]
    ideal = [(t, None if c is None else c * (1 + buffer)) for t, c in capacity]
    limit = [(r["t_ms"], r["limit"]) for r in rows]
    top_max = nice(max([v for _, v in limit + ideal if v is not None] + [1.0]))
    panel(
        y_top,
        top_h,
        top_max,
        [
            ("adaptive limit", limit, "#1f5fbf", ""),
            ("capacity C (workers)", capacity, "#222", ""),
            (f"ideal in flight C x {1 + buffer:g}", ideal, "#888", "6,4"),
        ],
        "requests in flight",
    )
    per_s = 1000.0 / slice_ms
    ok = [(r["t_ms"], None if r["ok"] is None else r["ok"] * per_s) for r in rows]
    cap_rate = [(t, None if c is None else c * 1000.0 / service_ms) for t, c in capacity]
    y_bottom = y_top + top_h + gap
    bottom_max = nice(max([v for _, v in ok + cap_rate if v is not None] + [1.0]))
    panel(
        y_bottom,
        bottom_h,
        bottom_max,
        [("2xx per second", ok, "#2a8a3a", ""), ("capacity C / S", cap_rate, "#888", "6,4")],
        "per second",
    )
    axis_y = y_bottom + bottom_h
    step = 5000 if t_max > 20000 else 1000 if t_max > 3000 else 500
    t = 0
    while t <= t_max:
        out.append(f'<text x="{x(t):.1f}" y="{axis_y + 16}" text-anchor="middle">{t / 1000:g}</text>')
        t += step
    out.append(f'<text x="{left + plot_w / 2}" y="{axis_y + 34}" text-anchor="middle">seconds (red: capacity changes)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def markdown(phases_found, tail, band):
    """The phases as a markdown table."""

    def fmt(v, f):
        return "n/a" if v is None else f.format(v)

    lines = [
        f"| phase | at | C | limit median (last {tail:g} s) | settled within +-{band * 100:g} % after |",
        "|---|---:|---|---:|---:|",
    ]
    for e in phases_found:
        c = fmt(e["capacity"], "{:g}")
        if e["capacity_from"] is not None:
            c = f'{e["capacity_from"]:g} -> {c}'
        settled = fmt(e["settle_ms"], "{:.0f} ms")
        if e["settle_ms"] is None and e["limit_median"] is not None:
            settled = "not settled"
        lines.append(
            f'| {e["phase"]} | {e["t_ms"] / 1000:.1f} s | {c} | {fmt(e["limit_median"], "{:.1f}")} | {settled} |'
        )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", help="adaptive-load's timeline CSV")
    p.add_argument("--service-ms", type=float, default=5.0, help="the upstream's S (default 5)")
    p.add_argument("--buffer", type=float, default=0.25, help="the controller's buffer, for the ideal in-flight line")
    p.add_argument("--tail", type=float, default=3.0, help="seconds at a phase's end the median is taken over")
    p.add_argument("--band", type=float, default=0.2, help="settled: within this share of that median")
    p.add_argument("--svg", help="write the chart here")
    p.add_argument("--title", default="adaptive concurrency", help="the chart's title")
    p.add_argument("--markdown", action="store_true", help="after the JSON line, the phases as a markdown table")
    args = p.parse_args()

    rows = read_rows(args.csv)
    if not rows:
        sys.exit(f"adaptive-settle: {args.csv} has no rows")
    slice_ms = rows[1]["t_ms"] - rows[0]["t_ms"] if len(rows) > 1 else rows[0]["t_ms"]
    result = []
    changes = []
    for k, (start, end) in enumerate(phases(rows)):
        median, settle_ms = settle(rows, start, end, slice_ms, args.tail * 1000, args.band)
        t_ms = rows[start]["t_ms"] - slice_ms if k == 0 else rows[start]["t_ms"]
        before = rows[start - 1]["capacity"] if start > 0 else None
        entry = {
            "phase": "start" if k == 0 else f"change {k}",
            "t_ms": t_ms,
            "capacity_from": before,
            "capacity": rows[start]["capacity"],
            "limit_median": median,
            "settle_ms": settle_ms,
        }
        result.append(entry)
        if k > 0:
            changes.append((t_ms, before, rows[start]["capacity"]))
    mean_c = time_weighted_capacity(rows)
    print(
        json.dumps(
            {
                "capacity_mean": mean_c,
                "capacity_per_s": None if mean_c is None else mean_c * 1000.0 / args.service_ms,
                "phases": result,
            }
        )
    )
    if args.markdown:
        print(markdown(result, args.tail, args.band))
    if args.svg:
        with open(args.svg, "w", encoding="utf-8") as f:
            f.write(svg(rows, changes, slice_ms, args.service_ms, args.buffer, args.title))


if __name__ == "__main__":
    main()
