#!/usr/bin/env python3
"""The sampler, the per-window analysis and the plot of tools/bench-regions.sh.

  sample    scrapes every instance's /metrics once per one-second window, OFFSET ms
            before the window ends (the instances in parallel, one thread each, on
            kept-alive connections), and polls the global redis-server directly (not
            through the delay proxy) every POLL ms, and every 2 ms in the last 60 ms of
            each window, for the run's fixed-window state keys (SCAN, MGET), keeping
            each window's highest count. JSON lines on --out.
  windows   turns one run's samples and h2load --log-file logs into one CSV row per
            window (and per-phase latency rows): see tools/bench-regions.sh's header
            for the columns.
  plot      draws the partition runs' admitted-per-second as an SVG.

Stdlib only (Python 3.8+).
"""

import argparse
import csv
import http.client
import json
import math
import re
import socket
import struct
import sys
import threading
import time

# ---------------------------------------------------------------------------- sample

SERIES = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
# Counters summed per descriptor (of the run's domain) and in total.
PER_DESCRIPTOR = ("tollgate_within_limit_total", "tollgate_over_limit_total",
                  "tollgate_total_hits_total")
TOTALS = ("tollgate_global_store_calls_total", "tollgate_global_store_failures_total",
          "tollgate_global_fallback_seconds_total",
          "tollgate_leases_total", "tollgate_redis_calls_total", "tollgate_store_errors_total",
          "tollgate_store_fallbacks_total", "tollgate_global_lease_duration_seconds_count",
          "tollgate_global_lease_duration_seconds_sum")


def parse_metrics(text, domain):
    out = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = SERIES.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(LABEL.findall(m.group(2) or "")), m.group(3)
        try:
            v = float(value)
        except ValueError:
            continue
        if "domain" in labels and labels["domain"] != domain:
            continue
        if name in PER_DESCRIPTOR:
            k = name + "|" + labels.get("descriptor", "")
            out[k] = out.get(k, 0.0) + v
        elif name in TOTALS:
            out[name] = out.get(name, 0.0) + v
        elif name == "tollgate_decision_duration_seconds_bucket":
            k = "decision_le|" + labels.get("le", "")
            out[k] = out.get(k, 0.0) + v
    return out


def scrape_loop(inst, port, targets, domain, sink, lock):
    conn = None
    for target in targets:
        delay = target - time.time()
        if delay > 0:
            time.sleep(delay)
        sent = time.time()
        body = None
        for _ in range(2):
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/metrics")
                resp = conn.getresponse()
                body = resp.read().decode(errors="replace")
                if resp.getheader("connection", "").lower() == "close":
                    conn.close()
                    conn = None
                break
            except (OSError, http.client.HTTPException):
                if conn is not None:
                    conn.close()
                conn = None
        recv = time.time()
        rec = {"kind": "metrics", "instance": inst[0], "region": inst[1], "target": target,
               "sent": sent, "recv": recv,
               "values": parse_metrics(body, domain) if body is not None else None}
        with lock:
            sink.write(json.dumps(rec) + "\n")


def resp_command(sock, fh, *args):
    buf = b"*%d\r\n" % len(args)
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        buf += b"$%d\r\n%s\r\n" % (len(a), a)
    sock.sendall(buf)
    return resp_read(fh)


def resp_read(fh):
    line = fh.readline()
    if not line:
        raise ConnectionError("redis closed the connection")
    t, rest = line[:1], line[1:-2]
    if t in (b"+", b"-"):
        return rest
    if t == b":":
        return int(rest)
    if t == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = fh.read(n + 2)
        return data[:-2]
    if t == b"*":
        n = int(rest)
        return None if n < 0 else [resp_read(fh) for _ in range(n)]
    raise ValueError("unexpected RESP: %r" % line)


def poll_global(port, match, until, poll_s, result):
    """Max count seen per (key, window end), of the 32-byte fixed-window states."""
    sock = socket.create_connection(("127.0.0.1", port))
    fh = sock.makefile("rb")
    seen = {}
    polls = 0
    while time.time() < until:
        polls += 1
        keys, cursor = [], b"0"
        while True:
            cursor, batch = resp_command(sock, fh, "SCAN", cursor, "COUNT", "1000")
            keys += [k for k in batch if match.encode() in k]
            if cursor == b"0":
                break
        if keys:
            values = resp_command(sock, fh, "MGET", *keys)
            now = time.time()
            for k, v in zip(keys, values):
                # A fixed window's state: 4 native doubles {window end s, end ns, count, -}.
                if v is None or len(v) != 32:
                    continue
                end_s, end_ns, count, _ = struct.unpack("<dddd", v)
                w = (k.decode(errors="replace"), int(end_s))
                e = seen.setdefault(w, {"count": 0.0, "first": now, "last_change": now})
                if count != e["count"]:
                    e["count"], e["last_change"] = max(count, e["count"]), now
        # Every 2 ms in the last 60 ms of a window: the state key is reset by the next
        # window's first call, so a window's last count must be read before it ends.
        now = time.time()
        frac = now % 1
        time.sleep(0.002 if frac > 0.94 else min(poll_s, max(0.0, 0.94 - frac) + 0.001))
    sock.close()
    result["seen"], result["polls"] = seen, polls


def cmd_sample(a):
    targets = [a.start + k - a.offset_ms / 1000 for k in range(a.windows + 1)]
    lock = threading.Lock()
    with open(a.out, "w") as sink:
        threads = []
        for spec in a.instance:
            name, region, port = spec.split(":")
            t = threading.Thread(target=scrape_loop,
                                 args=((name, region), int(port), targets, a.domain, sink, lock))
            t.start()
            threads.append(t)
        result = {}
        if a.global_redis:
            g = threading.Thread(target=poll_global,
                                 args=(a.global_redis, a.match, targets[-1], a.poll_ms / 1000, result))
            g.start()
            threads.append(g)
        for t in threads:
            t.join()
        for (key, end_s), e in sorted(result.get("seen", {}).items(), key=lambda x: x[0][1]):
            sink.write(json.dumps({"kind": "global", "key": key, "window_end": end_s,
                                   "count": e["count"], "first_seen": e["first"],
                                   "last_change": e["last_change"]}) + "\n")
        sink.write(json.dumps({"kind": "polls", "polls": result.get("polls", 0)}) + "\n")


# --------------------------------------------------------------------------- windows

def percentile(sorted_values, p):
    if not sorted_values:
        return float("nan")
    # Nearest rank.
    i = max(0, math.ceil(p / 100 * len(sorted_values)) - 1)
    return sorted_values[i]


def read_h2load_log(path):
    """(start s, status, latency ms) per request."""
    rows = []
    with open(path) as f:
        for line in f:
            parts = line.split("\t")
            if len(parts) < 3:
                continue
            rows.append((int(parts[0]) / 1e6, int(parts[1]), int(parts[2]) / 1000))
    return rows


def cmd_windows(a):
    samples, global_counts = [], {}
    with open(a.samples) as f:
        for line in f:
            r = json.loads(line)
            if r["kind"] == "metrics":
                samples.append(r)
            elif r["kind"] == "global":
                w = r["window_end"]
                global_counts[w] = global_counts.get(w, 0) + r["count"]
    regions = sorted({s["region"] for s in samples})
    instances = sorted({s["instance"] for s in samples})
    # value[instance][k] = the k-th sample's counters (k = 0: before the run's first window).
    by_inst = {i: {} for i in instances}
    skew = []
    for s in samples:
        k = round(s["target"] + a.offset_ms / 1000 - a.start)
        by_inst[s["instance"]][k] = s
        skew.append(s["sent"] - s["target"])
    region_of = {s["instance"]: s["region"] for s in samples}

    def delta(inst, k, key):
        a0, a1 = by_inst[inst].get(k - 1), by_inst[inst].get(k)
        if not a0 or not a1 or a0["values"] is None or a1["values"] is None:
            return None
        return a1["values"].get(key, 0.0) - a0["values"].get(key, 0.0)

    # Latencies per (region, descriptor, window) from the h2load logs.
    lat = {}
    failed = {}
    for spec in a.log:
        region, desc, path = spec.split(":", 2)
        for start, status, ms in read_h2load_log(path):
            w = math.floor(start - a.start)
            if status != 200:
                failed[(region, desc, w)] = failed.get((region, desc, w), 0) + 1
                continue
            lat.setdefault((region, desc, w), []).append(ms)
    for v in lat.values():
        v.sort()

    def phase(w):
        lo, hi = a.start + w, a.start + w + 1
        if a.partition_at is None:
            return "run"
        if hi <= a.partition_at:
            return "before"
        if lo >= a.partition_at and hi <= a.heal_at:
            return "during"
        if lo >= a.heal_at:
            return "after"
        return "cut" if lo < a.partition_at else "heal"

    g, r = a.global_descriptor, a.region_descriptor
    within, over = "tollgate_within_limit_total|", "tollgate_over_limit_total|"
    out = csv.writer(sys.stdout, lineterminator="\n")
    if a.header:
        cols = ["run", "window", "window_start", "phase"]
        for reg in regions:
            cols += [f"{reg}_admitted", f"{reg}_limited", f"{reg}_region_admitted",
                     f"{reg}_p50_ms", f"{reg}_p99_ms", f"{reg}_failed"]
        cols += ["admitted", "admitted_per_limit", "over", "global_store_count",
                 "global_store_calls", "global_store_failures", "fallback_s",
                 "global_calls_timed", "global_call_seconds", "scrape_skew_ms"]
        out.writerow(cols)
    for w in range(a.windows):
        k = w + 1  # the sample taken just before window w ends
        row = [a.run, w, int(a.start) + w, phase(w)]
        total, ok = 0.0, True
        for reg in regions:
            adm = lim = radm = 0.0
            for inst in instances:
                if region_of[inst] != reg:
                    continue
                d = [delta(inst, k, within + g), delta(inst, k, over + g), delta(inst, k, within + r)]
                if None in d:
                    ok = False
                    continue
                adm, lim, radm = adm + d[0], lim + d[1], radm + d[2]
            v = lat.get((reg, g, w), [])
            row += [f"{adm:.0f}", f"{lim:.0f}", f"{radm:.0f}", f"{percentile(v, 50):.3f}",
                    f"{percentile(v, 99):.3f}", failed.get((reg, g, w), 0)]
            total += adm
        calls = fails = fb = lc = ls = 0.0
        for inst in instances:
            calls += delta(inst, k, "tollgate_global_store_calls_total") or 0.0
            fails += delta(inst, k, "tollgate_global_store_failures_total") or 0.0
            fb += delta(inst, k, "tollgate_global_fallback_seconds_total") or 0.0
            lc += delta(inst, k, "tollgate_global_lease_duration_seconds_count") or 0.0
            ls += delta(inst, k, "tollgate_global_lease_duration_seconds_sum") or 0.0
        skews = [by_inst[i][k]["sent"] - by_inst[i][k]["target"] for i in instances if k in by_inst[i]]
        # The state key's window ends at the window's end, whole seconds (epoch).
        gc = global_counts.get(int(a.start) + w + 1)
        row += [f"{total:.0f}", f"{total / a.limit:.4f}",
                "OVER" if total > a.limit else ("?" if not ok else "ok"),
                "" if gc is None else f"{gc:.0f}", f"{calls:.0f}", f"{fails:.0f}", f"{fb:.3f}",
                f"{lc:.0f}", f"{ls:.6f}",
                f"{1000 * max(skews):.1f}" if skews else ""]
        out.writerow(row)

    # Latency per region and phase (the whole run: phase "all").
    if a.latency_out:
        with open(a.latency_out, "a") as f:
            lw = csv.writer(f, lineterminator="\n")
            for reg in regions:
                for desc in (g, r):
                    groups = {"all": []}
                    nfail = {"all": 0}
                    for (rg, d, w), v in lat.items():
                        if rg != reg or d != desc:
                            continue
                        groups["all"] += v
                        groups.setdefault(phase(w), []).extend(v)
                    for (rg, d, w), n in failed.items():
                        if rg == reg and d == desc:
                            nfail["all"] += n
                            nfail[phase(w)] = nfail.get(phase(w), 0) + n
                    for ph, v in groups.items():
                        v.sort()
                        n = len(v) or 1
                        lw.writerow([a.run, reg, desc, ph, len(v), nfail.get(ph, 0),
                                     f"{percentile(v, 50):.3f}", f"{percentile(v, 99):.3f}",
                                     f"{percentile(v, 99.9):.3f}", f"{(v[-1] if v else float('nan')):.3f}",
                                     f"{sum(1 for x in v if x > 1) / n:.4f}",
                                     f"{sum(1 for x in v if x > 50) / n:.4f}"])
                # The server's own histogram of decision durations over the run (every
                # decision of the region's instances, g and r): the upper bound of the
                # bucket holding the median and the 99th percentile.
                buckets = {}
                for inst in instances:
                    if region_of[inst] != reg:
                        continue
                    first, last = by_inst[inst].get(0), by_inst[inst].get(a.windows)
                    if not first or not last or first["values"] is None or last["values"] is None:
                        continue
                    for key, v1 in last["values"].items():
                        if key.startswith("decision_le|"):
                            le = key.split("|", 1)[1]
                            le = math.inf if le == "+Inf" else float(le)
                            buckets[le] = buckets.get(le, 0.0) + v1 - first["values"].get(key, 0.0)
                if buckets:
                    bounds = sorted(buckets)
                    total = buckets[bounds[-1]]

                    def upper(q):
                        for b in bounds:
                            if total and buckets[b] >= q * total:
                                return b * 1000
                        return float("nan")
                    lw.writerow([a.run, reg, "server", "all", f"{total:.0f}", 0,
                                 f"{upper(0.5):.3f}", f"{upper(0.99):.3f}", f"{upper(0.999):.3f}", "", "", ""])


# ------------------------------------------------------------------------------ plot

def cmd_plot(a):
    everything = load_csv(a.csv)
    rows = [x for x in everything if x["run"] == a.run]
    if not rows:
        sys.exit(f"no rows of run {a.run} in {a.csv}")
    regions = sorted({c[:-len("_admitted")] for c in rows[0] if c.endswith("_admitted")
                      and not c.endswith("region_admitted") and c != "admitted"})
    W, H, L, R, T, B = 860, 400, 64, 250, 40, 50
    pw, ph = W - L - R, H - T - B
    n = len(rows)
    overlays = []
    for spec in a.overlay:
        run, label = spec.split(":", 1)
        overlays.append(([x for x in everything if x["run"] == run], label))
    top = max([a.limit * 2.1] + [float(x["admitted"]) for x in rows]
              + [float(x["admitted"]) for o, _ in overlays for x in o])
    top = math.ceil(top / 500) * 500

    def xs(i):
        return L + pw * i / n

    def ys(v):
        return T + ph * (1 - v / top)

    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="22" font-size="14">{esc(a.title)}</text>']
    # The partition, shaded.
    if a.partition_from is not None:
        x0, x1 = xs(a.partition_from), xs(a.partition_to)
        svg.append(f'<rect x="{x0:.1f}" y="{T}" width="{x1 - x0:.1f}" height="{ph}" fill="#f3d9d9"/>')
        svg.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{T + 14}" text-anchor="middle" '
                   f'fill="#a33">global store unreachable</text>')
    # Axes and grid.
    step = 250 if top <= 2500 else 500
    v = 0
    while v <= top:
        y = ys(v)
        svg.append(f'<line x1="{L}" y1="{y:.1f}" x2="{L + pw}" y2="{y:.1f}" stroke="#ddd"/>')
        svg.append(f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end">{v}</text>')
        v += step
    for i in range(0, n + 1, 5):
        svg.append(f'<text x="{xs(i):.1f}" y="{T + ph + 16}" text-anchor="middle">{i}</text>')
    svg.append(f'<text x="{L + pw / 2}" y="{H - 10}" text-anchor="middle">'
               f'second of the run (1 s fixed windows)</text>')
    svg.append(f'<text transform="translate(16 {T + ph / 2}) rotate(-90)" '
               f'text-anchor="middle">admitted per window</text>')
    svg.append(f'<rect x="{L}" y="{T}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    # The limit.
    y = ys(a.limit)
    svg.append(f'<line x1="{L}" y1="{y:.1f}" x2="{L + pw}" y2="{y:.1f}" stroke="#000" '
               f'stroke-dasharray="6 4"/>')
    legend = []
    if a.bound:
        value, label = a.bound.split(":", 1)
        y = ys(float(value))
        svg.append(f'<line x1="{L}" y1="{y:.1f}" x2="{L + pw}" y2="{y:.1f}" stroke="#1f77b4" '
                   f'stroke-dasharray="2 3"/>')
        legend.append((label, "#1f77b4", 1, "2 3"))
    series = [(rows, "admitted", a.label or "total", "#222", 2.5, None)]
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]
    for i, reg in enumerate(regions):
        owner = f"{a.label.split(':')[0]}: " if a.label else ""
        series.append((rows, f"{reg}_admitted", f"{owner}region {reg}", colors[i % len(colors)], 1.8, None))
    for (o, label), (color, dash) in zip(overlays, [("#2ca02c", "7 3"), ("#d62728", "2 2"), ("#9467bd", "4 4")]):
        series.append((o, "admitted", label, color, 1.6, dash))
    for data, col, label, color, width, dash in series:
        pts = " ".join(f"{xs(i + 0.5):.1f},{ys(float(x[col])):.1f}" for i, x in enumerate(data))
        d = f' stroke-dasharray="{dash}"' if dash else ""
        svg.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="{width}"{d}/>')
        legend.append((label, color, width, dash))
    legend.append((f"global limit {a.limit:g}", "#000", 1, "6 4"))
    # Legend.
    ly = T + 10
    for label, color, width, dash in legend:
        d = f' stroke-dasharray="{dash}"' if dash else ""
        svg.append(f'<line x1="{L + pw + 12}" y1="{ly}" x2="{L + pw + 36}" y2="{ly}" '
                   f'stroke="{color}" stroke-width="{width}"{d}/>')
        svg.append(f'<text x="{L + pw + 42}" y="{ly + 4}" font-size="11">{esc(label)}</text>')
        ly += 18
    if a.note:
        for j, line in enumerate(a.note.split("|")):
            svg.append(f'<text x="{L + pw + 12}" y="{ly + 12 + 15 * j}" font-size="10" '
                       f'fill="#555">{esc(line)}</text>')
    svg.append("</svg>")
    with open(a.out, "w") as f:
        f.write("\n".join(svg) + "\n")


# ---------------------------------------------------------------------- brief, report

def load_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def median(xs):
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def full_windows(rows):
    """A run's windows without the first and the last (the clients ran 0.8 s of each)."""
    return rows[1:-1]


def regions_of(row):
    return sorted(c[:-len("_admitted")] for c in row if c.endswith("_admitted")
                  and not c.endswith("_region_admitted") and c != "admitted")


def cmd_brief(a):
    rows = [r for r in load_csv(a.windows) if r["run"] == a.run]
    lat = [r for r in load_csv(a.latency) if r["run"] == a.run and r["phase"] == "all"]
    full = full_windows(rows)
    regs = regions_of(rows[0])
    per = [num(r["admitted_per_limit"]) for r in full]
    decided = sum(num(r[f"{g}_admitted"]) + num(r[f"{g}_limited"]) for r in rows for g in regs)
    calls = sum(num(r["global_store_calls"]) for r in rows)
    parts = [f"  run {a.run} {a.label}: admitted ÷ L per window median {median(per):.3f} max {max(per):.3f}"
             f" ({sum(1 for r in full if r['over'] == 'OVER')} OVER)"]
    for g in regs:
        adm = median([num(r[f"{g}_admitted"]) for r in full])
        lr = [x for x in lat if x["region"] == g and x["descriptor"] == "g"]
        if lr:
            parts.append(f"{g} {adm:.0f}/window p50 {num(lr[0]['p50_ms']):.2f} p99 {num(lr[0]['p99_ms']):.2f} ms")
    parts.append(f"global-store calls/decision {calls / decided if decided else float('nan'):.4f}")
    print(", ".join(parts))


def fmt(x, f="{:.2f}"):
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f.format(x)


def cmd_report(a):
    windows = load_csv(a.windows)
    latency = load_csv(a.latency)
    runs = load_csv(a.runs)
    by_run = {}
    for r in windows:
        by_run.setdefault(r["run"], []).append(r)
    run_info = {}
    for r in runs:
        run_info.setdefault(r["run"], []).append(r)

    def lat(run, region, phase="all", desc="g"):
        for x in latency:
            if x["run"] == run and x["region"] == region and x["phase"] == phase and x["descriptor"] == desc:
                return x
        return None

    p = print
    p(f"## bench-regions: 2 regions, global limit {a.limit:g}/s, region limit {a.region_limit:g}/s ({a.context})")
    p()
    lat_runs = sorted({r["run"] for r in runs if r["kind"] == "latency"})
    if lat_runs:
        regs = regions_of(by_run[lat_runs[0]][0])
        p("### Latency runs: the global limit (g) with and without the distant store (medians over rounds)")
        p()
        p("| split | delay each way | region | g offered /s | g decisions/s | p50 ms | p99 ms | Δ p99 vs no delay | g decisions over 1 ms / 50 ms | server p99 ≤ ms (g and r) | r p99 ms | share of admitted | r admitted ÷ region limit |")
        p("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        combos = []
        for r in runs:
            if r["kind"] == "latency" and (r["split"], r["delay_ms"]) not in combos:
                combos.append((r["split"], r["delay_ms"]))
        combos.sort(key=lambda c: (c[0] != "80/20", -int(c[1])))
        fleet = []
        for split, delay in combos:
            ids = sorted({r["run"] for r in runs if r["kind"] == "latency" and r["split"] == split and r["delay_ms"] == delay})
            for g in regs:
                offered, dps, p50, p99, dp99, share, radm, sp99, rp99, o1, o50 = [], [], [], [], [], [], [], [], [], [], []
                for i in ids:
                    info = [x for x in run_info[i] if x["region"] == g][0]
                    offered.append(num(info["offered_g_per_s"]))
                    dps.append(num(info["g_answered_per_s"]))
                    l = lat(i, g)
                    p50.append(num(l["p50_ms"]))
                    p99.append(num(l["p99_ms"]))
                    o1.append(100 * num(l["over_1ms"]))
                    o50.append(100 * num(l["over_50ms"]))
                    sv = lat(i, g, desc="server")
                    sp99.append(num(sv["p99_ms"]) if sv else float("nan"))
                    rp99.append(num(lat(i, g, desc="r")["p99_ms"]))
                    # The baseline of the same split and round.
                    base = [x["run"] for x in runs if x["kind"] == "latency" and x["split"] == split
                            and x["round"] == info["round"] and x["delay_ms"] == "0" and x["region"] == g]
                    if delay != "0" and base:
                        dp99.append(num(l["p99_ms"]) - num(lat(base[0], g)["p99_ms"]))
                    full = full_windows(by_run[i])
                    tot = sum(num(w["admitted"]) for w in full)
                    share.append(100 * sum(num(w[f"{g}_admitted"]) for w in full) / tot if tot else float("nan"))
                    radm.append(median([num(w[f"{g}_region_admitted"]) / a.region_limit for w in full]))
                p(f"| {split} | {delay} ms | {g} | {median(offered):.0f} | {median(dps):.0f} | {fmt(median(p50))} | {fmt(median(p99))} | "
                  f"{fmt(median(dp99), '{:+.2f}') if dp99 else '–'} | {fmt(median(o1), '{:.1f} %')} / {fmt(median(o50), '{:.1f} %')} | {fmt(median(sp99), '{:g}')} | {fmt(median(rp99))} | {fmt(median(share), '{:.1f} %')} | {fmt(median(radm), '{:.3f}')} |")
            per, mx, over, nwin, cpd, rpd, rtt, whole, gmax, vs_store = [], [], 0, 0, [], [], [], [], [], []
            lagmax, late5, chunks = 0.0, 0, 0
            for i in ids:
                full = full_windows(by_run[i])
                v = [num(w["admitted_per_limit"]) for w in full]
                per.append(median(v))
                mx.append(max(v))
                over += sum(1 for w in full if w["over"] == "OVER")
                nwin += len(full)
                rows = by_run[i]
                decided = sum(num(w[f"{g}_admitted"]) + num(w[f"{g}_limited"]) for w in rows for g in regs)
                cpd.append(sum(num(w["global_store_calls"]) for w in rows) / decided if decided else float("nan"))
                rpd.append(num(run_info[i][0]["global_requests"]) / decided if decided else float("nan"))
                adm = sum(num(w["admitted"]) for w in rows)
                whole.append(adm / (a.limit * len(rows)))
                counts = [num(w["global_store_count"]) for w in rows if w["global_store_count"]]
                gmax.append(max(counts) / a.limit if counts else float("nan"))
                vs_store.append(adm / sum(counts) if counts and sum(counts) else float("nan"))
                info0 = run_info[i][0]
                lagmax = max(lagmax, num(info0["proxy_max_lag_ms"]))
                late5 += int(num(info0["proxy_late_5ms"]))
                chunks += int(num(info0["proxy_chunks"]))
                timed = sum(num(w["global_calls_timed"]) for w in rows)
                rtt.append(1000 * sum(num(w["global_call_seconds"]) for w in rows) / timed if timed else float("nan"))
            fleet.append((split, delay, median(per), max(mx), over, nwin, median(cpd), median(rpd), median(rtt), len(ids),
                          median(whole), max(gmax), median(vs_store), lagmax, late5, chunks))
        p()
        p("| split | delay each way | admitted ÷ limit per window by answer time, median (max) | windows over, by answer time | whole run: admitted ÷ (limit × windows) | highest global-store count ÷ limit | admitted ÷ global-store count | global-store calls / decision (metric) | global Redis requests / decision | mean global call ms | proxy: chunks > 5 ms late, of all (worst ms) | runs |")
        p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for split, delay, med, mx, over, nwin, cpd, rpd, rtt, n, whole, gmax, vs_store, lagmax, late5, chunks in fleet:
            p(f"| {split} | {delay} ms | {med:.3f} ({mx:.3f}) | {over} of {nwin} | {whole:.3f} | {fmt(gmax, '{:.3f}')} | {fmt(vs_store, '{:.3f}')} | {cpd:.4f} | {rpd:.4f} | {fmt(rtt)} | {late5} of {chunks} ({lagmax:.1f}) | {n} |")
        p()
    part_runs = sorted({r["run"] for r in runs if r["kind"] == "partition"})
    if part_runs:
        regs = regions_of(by_run[part_runs[0]][0])
        p("### Partition runs: the global store unreachable mid-run")
        p()
        fb = a.limit / (a.divisor * a.regions)
        p(f"Mean admitted per window by phase (before / during / after the cut; the windows the cut and the heal fall in apart); local_fallback's bound while cut: {fb:g} per instance (limit ÷ (divisor {a.divisor:g} × regions {a.regions:g})).")
        p()
        p("| failure mode | phase | windows | " + " | ".join(f"{g} admitted" for g in regs) + " | total ÷ limit | max total ÷ limit | " +
          " | ".join(f"{g} p50 / p99 / max ms" for g in regs) + " | failed | global-store count ÷ admitted | global-store calls (failed) | fallback s |")
        p("|---|---|---:|" + "---:|" * len(regs) + "---:|---:|" + "---:|" * len(regs) + "---:|---:|---:|---:|")
        for i in part_runs:
            mode = run_info[i][0]["failure_mode"]
            rows = by_run[i]
            for ph in ("before", "cut", "during", "heal", "after"):
                ws = [w for w in rows if w["phase"] == ph]
                if ph in ("before", "after"):
                    ws = [w for w in ws if w is not rows[0] and w is not rows[-1]]
                if not ws:
                    continue
                adm = [sum(num(w[f"{g}_admitted"]) for w in ws) / len(ws) for g in regs]
                tot = [num(w["admitted"]) for w in ws]
                gc = [num(w["global_store_count"]) if w["global_store_count"] else 0.0 for w in ws]
                lats = []
                for g in regs:
                    l = lat(i, g, ph)
                    lats.append(f"{fmt(num(l['p50_ms']))} / {fmt(num(l['p99_ms']))} / {fmt(num(l['max_ms']))}" if l else "–")
                failed = sum(int(w[f"{g}_failed"]) for w in ws for g in regs)
                fbs = sum(num(w["fallback_s"]) for w in ws)
                ratio = sum(gc) / sum(tot) if sum(tot) else float("nan")
                p(f"| {mode} | {ph} | {len(ws)} | " + " | ".join(f"{x:.0f}" for x in adm) +
                  f" | {sum(tot) / len(ws) / a.limit:.3f} | {max(tot) / a.limit:.3f} | " + " | ".join(lats) +
                  f" | {failed} | {fmt(ratio, '{:.3f}')} | {sum(num(w['global_store_calls']) for w in ws):.0f} "
                  f"({sum(num(w['global_store_failures']) for w in ws):.0f}) | {fbs:.1f} |")
        p()
        for i in part_runs:
            mode = run_info[i][0]["failure_mode"]
            info0 = run_info[i][0]
            p(f"#### {mode}, per window (run {i})")
            p()
            p(f"The delay proxy wrote {info0['proxy_late_5ms']} of {info0['proxy_chunks']} chunks more than 5 ms late "
              f"({info0['proxy_late_1ms']} more than 1 ms, worst {num(info0['proxy_max_lag_ms']):.1f} ms; chunks held by the partition left out).")
            p()
            p("| second | phase | " + " | ".join(f"{g} admitted" for g in regs) + " | total | total ÷ limit | global-store count | " +
              " | ".join(f"{g} p99 ms" for g in regs) + " | global-store calls (failed) | fallback s |")
            p("|---:|---|" + "---:|" * len(regs) + "---:|---:|---:|" + "---:|" * len(regs) + "---:|---:|")
            for w in by_run[i]:
                p(f"| {w['window']} | {w['phase']} | " + " | ".join(w[f'{g}_admitted'] for g in regs) +
                  f" | {w['admitted']} | {num(w['admitted_per_limit']):.3f} | {w['global_store_count'] or '–'} | " +
                  " | ".join(fmt(num(w[f'{g}_p99_ms'])) for g in regs) + f" | {w['global_store_calls']} ({w['global_store_failures']}) | {num(w['fallback_s']):.2f} |")
            p()
    p("Commands (ports chosen at run time):")
    p()
    p("```sh")
    p(a.commands)
    p("```")
    p()
    p("Rules:")
    p()
    p("```yaml")
    p(a.rules)
    p("```")
    p()
    p(f"Raw numbers: windows.csv (one row per run and window), latency.csv, runs.csv, the samples (JSON lines) and the plots beside this file.")


def esc(s):
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("--out", required=True)
    s.add_argument("--start", type=float, required=True, help="epoch s of the first window")
    s.add_argument("--windows", type=int, required=True, help="windows to sample (N + 1 scrapes)")
    s.add_argument("--offset-ms", type=float, default=10)
    s.add_argument("--domain", required=True)
    s.add_argument("--instance", action="append", default=[], help="NAME:REGION:HTTP_PORT")
    s.add_argument("--global-redis", type=int)
    s.add_argument("--match", default="", help="only keys containing this")
    s.add_argument("--poll-ms", type=float, default=20)
    w = sub.add_parser("windows")
    w.add_argument("--samples", required=True)
    w.add_argument("--run", required=True)
    w.add_argument("--start", type=float, required=True)
    w.add_argument("--windows", type=int, required=True)
    w.add_argument("--offset-ms", type=float, default=10)
    w.add_argument("--limit", type=float, required=True)
    w.add_argument("--global-descriptor", default="g")
    w.add_argument("--region-descriptor", default="r")
    w.add_argument("--log", action="append", default=[], help="REGION:DESCRIPTOR:PATH")
    w.add_argument("--partition-at", type=float)
    w.add_argument("--heal-at", type=float)
    w.add_argument("--header", action="store_true")
    w.add_argument("--latency-out")
    p = sub.add_parser("plot")
    p.add_argument("--csv", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--limit", type=float, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="")
    p.add_argument("--note", default="")
    p.add_argument("--partition-from", type=float)
    p.add_argument("--partition-to", type=float)
    p.add_argument("--label", default="", help="the run's total's legend")
    p.add_argument("--overlay", action="append", default=[], help="RUN:LABEL, another run's total")
    p.add_argument("--bound", help="VALUE:LABEL, a dotted line")
    b = sub.add_parser("brief")
    b.add_argument("--windows", required=True)
    b.add_argument("--latency", required=True)
    b.add_argument("--run", required=True)
    b.add_argument("--label", default="")
    r = sub.add_parser("report")
    r.add_argument("--windows", required=True)
    r.add_argument("--latency", required=True)
    r.add_argument("--runs", required=True)
    r.add_argument("--limit", type=float, required=True)
    r.add_argument("--region-limit", type=float, required=True)
    r.add_argument("--divisor", type=float, default=1)
    r.add_argument("--regions", type=float, default=2)
    r.add_argument("--context", default="")
    r.add_argument("--commands", default="")
    r.add_argument("--rules", default="")
    a = ap.parse_args()
    {"sample": cmd_sample, "windows": cmd_windows, "plot": cmd_plot, "brief": cmd_brief,
     "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    main()
