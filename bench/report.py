"""Medians, ratios, BENCHMARKS.md, the JSON dump and the ratio/TTFT chart."""

from __future__ import annotations

import importlib
import json
import re
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .copyedit import LLAMA_NGRAM, OURS_NGRAM
from .cpu import NOISY_CORES
from .servers import LCP, LLAMA_SERVER, OURS
from .workloads import WORKLOADS, Metric, Sample, VariantRatio, Workload

# (the -ngram configurations are workload 11's speculative llama-server and ours)
SERVER_ORDER = (LLAMA_SERVER, LLAMA_NGRAM, OURS, OURS_NGRAM, LCP)
SLOWER_THRESHOLD = 0.05  # worse by more than 5 % -> named in the "where we are slower" line


@dataclass
class Results:
    """samples[workload id][server name] = one Sample per repeat."""

    samples: dict[int, dict[str, list[Sample]]] = field(default_factory=dict)
    # Workloads merged from an earlier run's JSON: id -> that run's description, date, mode.
    origin: dict[int, dict[str, Any]] = field(default_factory=dict)

    def add(self, wid: int, server: str, sample: Sample) -> None:
        self.samples.setdefault(wid, {}).setdefault(server, []).append(sample)

    def servers(self, wid: int) -> list[str]:
        present = self.samples.get(wid, {})
        # configurations not in SERVER_ORDER (a workload's variants) after the known ones
        return [s for s in SERVER_ORDER if s in present] + sorted(set(present) - set(SERVER_ORDER))

    def na(self, wid: int, server: str) -> str | None:
        reasons = [s.na for s in self.samples.get(wid, {}).get(server, []) if s.na]
        return reasons[0] if reasons else None

    def median(self, wid: int, server: str, key: str) -> float | None:
        vals = [
            s.metrics.get(key)
            for s in self.samples.get(wid, {}).get(server, [])
            if s.na is None and s.metrics.get(key) is not None
        ]
        return statistics.median(v for v in vals if v is not None) if vals else None

    def ttfts(self, wid: int, server: str) -> list[float]:
        return [t for s in self.samples.get(wid, {}).get(server, []) for t in s.ttft_ms]


def ratio(results: Results, wid: int, key: str) -> float | None:
    ours = results.median(wid, OURS, key)
    ref = results.median(wid, LLAMA_SERVER, key)
    if ours is None or ref is None or ref == 0:
        return None
    return ours / ref


def variant_ratio(results: Results, wid: int, vr: VariantRatio) -> float | None:
    num = results.median(wid, vr.num, vr.key)
    den = results.median(wid, vr.den, vr.key)
    return None if num is None or den is None or den == 0 else num / den


def variant_lines(results: Results, w: Workload) -> list[str]:
    """One line per configuration ratio the workload names, with its target when it has one."""
    labels = {m.key: m.label for m in w.metrics}
    out = []
    for vr in w.variant_ratios:
        r = variant_ratio(results, w.id, vr)
        line = f"- {vr.num} / {vr.den}, {labels[vr.key]}: " + ("n/a" if r is None else f"{r:.2f}x")
        if vr.target is not None:
            met = "n/a" if r is None else ("met" if r >= vr.target else "NOT met")
            line += f" (target ≥ {vr.target:g}: {met})"
        out.append(line)
    return out


def worse_by(r: float, m: Metric) -> float:
    """How much worse ours is, as a fraction (negative = better)."""
    return (1.0 / r - 1.0) if m.higher_is_better else (r - 1.0)


# --- markdown -----------------------------------------------------------------------------


def fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "n/a"
    if unit in ("tok", "") and float(v).is_integer():
        return f"{int(v):,}"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def _cell(results: Results, wid: int, server: str, m: Metric) -> str:
    if results.na(wid, server):
        return "n/a"
    return fmt(results.median(wid, server, m.key), m.unit)


def _table(results: Results, w: Workload) -> list[str]:
    servers = results.servers(w.id)
    has_ratio = OURS in servers and LLAMA_SERVER in servers
    head = ["metric", *servers] + (["ours / llama-server"] if has_ratio else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in w.metrics:
        row = [f"{m.label}, {m.unit} {'↑' if m.higher_is_better else '↓'}"]
        row += [_cell(results, w.id, s, m) for s in servers]
        if has_ratio:
            r = ratio(results, w.id, m.key)
            row.append("n/a" if r is None else f"{r:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def verdict(results: Results, w: Workload) -> str:
    """One honest sentence: where ours is slower than llama-server, by how much."""
    servers = results.servers(w.id)
    if OURS not in servers or LLAMA_SERVER not in servers:
        return ""
    if results.na(w.id, OURS):
        return f"Ours could not run this workload: {results.na(w.id, OURS)}."
    slower = []
    compared = 0
    for m in w.metrics:
        r = ratio(results, w.id, m.key)
        if r is None:
            continue
        compared += 1
        if worse_by(r, m) > SLOWER_THRESHOLD:
            slower.append(f"{m.label} {r:.2f}x llama-server's")
    if compared == 0:
        return ""
    if not slower:
        return "Ours is within 5 % of llama-server or better on every metric here."
    return "We are slower than llama-server here: " + "; ".join(slower) + "."


def noise_note(results: Results, wid: int) -> str:
    """Name the servers whose samples ran while other processes were using the CPUs."""
    hits = []
    for server in results.servers(wid):
        loads = [
            s.info.get("foreign_cores") or 0.0 for s in results.samples[wid][server] if not s.na
        ]
        noisy = [x for x in loads if x > NOISY_CORES]
        if noisy:
            hits.append(f"{server} {len(noisy)}/{len(loads)} (up to {max(noisy):.2f} cores)")
    if not hits:
        return ""
    return (
        "Disturbed samples (other processes busy on the CPUs while measuring): "
        + "; ".join(hits)
        + ". Compare these numbers with care."
    )


def _foreign_line(results: Results) -> str:
    loads = [
        s.info["foreign_cores"]
        for per_server in results.samples.values()
        for samples in per_server.values()
        for s in samples
        if s.info.get("foreign_cores") is not None
    ]
    if not loads:
        return "- other processes' CPU use while measuring: not measured"
    return (
        f"- other processes' CPU use while measuring (from /proc): median "
        f"{statistics.median(loads):.2f}, max {max(loads):.2f} cores; samples above "
        f"{NOISY_CORES} cores were re-run and, if still disturbed, are named below"
    )


def _server_lines(meta: dict[str, Any]) -> list[str]:
    out = []
    for name, cmd in meta.get("commands", {}).items():
        out.append(f"- `{name}`: `{cmd}`")
    for name, why in meta.get("unavailable", {}).items():
        out.append(f"- `{name}`: not run ({why})")
    if LCP in meta.get("commands", {}):
        out.append(
            f"- `{LCP}` serves one request at a time (no slots) and reports no `timings`; "
            "its other settings are its defaults"
        )
    return out


def markdown(results: Results, meta: dict[str, Any]) -> str:
    mode = "quick" if meta["quick"] else "full"
    lines = [
        "# Benchmarks: llama-slot-server vs llama.cpp's llama-server",
        "",
        "Generated by `.venv/bin/python -m bench.run` (see `bench/README.md`); numbers are medians "
        f"over {meta['repeats']} repeat(s) ({mode} mode). ↑: higher is better, ↓: lower is "
        "better. Ratios are ours / llama-server: above 1 on a ↓ metric, or below 1 on a ↑ one, "
        "means we are slower.",
        "",
        f"- date: {meta['date']}",
        f"- machine: {meta['cpu']}, {meta['cores']} cores",
        f"- model: `{meta['model']}` ({meta['model_mib']:.0f} MiB)",
        f"- llama-cpp-python {meta['llama_cpp_python']} (both servers use its vendored "
        f"llama.cpp; llama-server {meta['llama_server_version']})",
        f"- workloads: {', '.join(str(w) for w in meta['workloads'])}",
        *_server_lines(meta),
        _foreign_line(results),
        "",
    ]
    if meta.get("note"):
        lines += [f"> {meta['note']}", ""]
    for wid in meta["workloads"]:
        w = WORKLOADS[wid]
        origin = results.origin.get(wid)
        desc = origin["description"] if origin else w.describe(meta["sizes_obj"])
        lines += [f"## {w.id}. {w.title}", "", desc + ".", ""]
        if origin and origin.get("date") != meta["date"]:
            mode = "quick" if origin.get("quick") else "full"
            lines += [
                f"_Merged from the run of {origin.get('date')} ({mode} mode, "
                f"{origin.get('repeats')} repeat(s))._",
                "",
            ]
        lines += _table(results, w)
        if w.variant_ratios:
            lines += ["", *variant_lines(results, w)]
        for s in results.servers(w.id):
            if results.na(w.id, s) and s != OURS:
                lines += ["", f"{s}: n/a ({results.na(w.id, s)})."]
        noisy = noise_note(results, w.id)
        if noisy:
            lines += ["", noisy]
        v = verdict(results, w)
        if v:
            lines += ["", v]
        lines.append("")
    if meta.get("chart"):
        lines += [f"![ratios and TTFT]({meta['chart']})", ""]
    return "\n".join(lines)


# --- JSON ---------------------------------------------------------------------------------


def _origin_of(results: Results, wid: int, meta: dict[str, Any]) -> dict[str, Any]:
    if wid in results.origin:
        return results.origin[wid]
    keys = ("date", "quick", "repeats", "loadavg")
    return {"description": WORKLOADS[wid].describe(meta["sizes_obj"])} | {k: meta[k] for k in keys}


def json_dump(results: Results, meta: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"meta": {k: v for k, v in meta.items() if k != "sizes_obj"}}
    out["workloads"] = {}
    for wid, per_server in sorted(results.samples.items()):
        w = WORKLOADS[wid]
        out["workloads"][str(wid)] = {
            "title": w.title,
            "origin": _origin_of(results, wid, meta),
            "medians": {
                s: {m.key: results.median(wid, s, m.key) for m in w.metrics} for s in per_server
            },
            "ratios": {m.key: ratio(results, wid, m.key) for m in w.metrics},
            "variant_ratios": {
                f"{vr.num} / {vr.den} {vr.key}": variant_ratio(results, wid, vr)
                for vr in w.variant_ratios
            },
            "samples": {s: [asdict(x) for x in xs] for s, xs in per_server.items()},
        }
    return out


def merge_json(path: Path, results: Results, skip: set[int]) -> list[int]:
    """Add the workloads of an earlier run's JSON that this run did not measure."""
    data = json.loads(path.read_text())
    merged = []
    for key, wl in data.get("workloads", {}).items():
        wid = int(key)
        if wid in skip or wid not in WORKLOADS or "origin" not in wl:
            continue
        for server, samples in wl["samples"].items():
            for x in samples:
                results.add(wid, server, Sample(**x))
        results.origin[wid] = wl["origin"]
        merged.append(wid)
    return sorted(merged)


def write_json(path: Path, results: Results, meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_dump(results, meta), indent=2, default=str) + "\n")


# --- chart --------------------------------------------------------------------------------


def ensure_matplotlib() -> Any | None:
    """Import matplotlib (Agg), installing it into this venv with pip if it is missing."""
    try:
        return _import_pyplot()
    except ImportError:
        pass
    print("[bench] matplotlib missing: pip install matplotlib (for bench/ratios.png)", flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if subprocess.run([*cmd, "matplotlib"]).returncode != 0:
        return None
    importlib.invalidate_caches()
    try:
        return _import_pyplot()
    except ImportError:
        return None


def _import_pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(r: float, m: Metric) -> str:
    w = worse_by(r, m)
    if w > SLOWER_THRESHOLD:
        return "tab:red"
    return "tab:green" if w < -SLOWER_THRESHOLD else "tab:gray"


def _ratio_rows(results: Results, wids: list[int]) -> list[tuple[str, float, str]]:
    rows = []
    for wid in wids:
        w = WORKLOADS[wid]
        for m in w.metrics:
            r = ratio(results, wid, m.key)
            if m.chart and r is not None:
                arrow = "↑" if m.higher_is_better else "↓"
                rows.append((f"{wid}: {m.label} {arrow}", r, _color(r, m)))
    return rows


def write_chart(path: Path, results: Results, wids: list[int]) -> bool:
    plt = ensure_matplotlib()
    if plt is None:
        print("[bench] no matplotlib: chart skipped", flush=True)
        return False
    rows = _ratio_rows(results, wids)
    boxes = [
        (f"{wid} {s}", results.ttfts(wid, s))
        for wid in wids
        for s in results.servers(wid)
        if results.ttfts(wid, s)
    ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, max(4.0, 0.45 * max(len(rows), 6))))
    if rows:
        labels, vals, colors = zip(*rows, strict=True)
        ax1.barh(labels, vals, color=colors)
        ax1.axvline(1.0, color="black", lw=1)
        ax1.invert_yaxis()
        ax1.set_xscale("log")
    ax1.set_title("ours / llama-server (red: ours >5 % worse, green: >5 % better)")
    if boxes:
        ax2.boxplot([b[1] for b in boxes], vert=False)
        ax2.set_yticks(range(1, len(boxes) + 1), [b[0] for b in boxes])
        ax2.invert_yaxis()
    ax2.set_xscale("log")
    ax2.set_xlabel("ms (log scale)")
    ax2.set_title("time to first token per request (workload, server)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


_KEPT = re.compile(r"<!-- ([a-z0-9-]+):start -->.*?<!-- \1:end -->\n?", re.S)


def with_kept_sections(path: Path, rendered: str) -> str:
    """``rendered`` followed by the marked sections of the report at ``path`` (those other
    benchmarks write between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``: the GPU run,
    bench.ceiling), so a bench.run rewrite keeps them."""
    old = path.read_text() if path.exists() else ""
    kept = [m.group(0).rstrip("\n") for m in _KEPT.finditer(old)]
    return "\n\n".join([rendered.rstrip("\n"), *kept]) + "\n"
