"""GPU side by side: llama-server, llama-server -bs and ours (-bs), all CUDA builds of the
same vendored llama.cpp, on the same GPU, one server at a time.

    .venv/bin/python -m bench.run --gpu                      # build (once) and run
    .venv/bin/python -m bench.run --gpu --dry-run            # print the plan, run nothing
    .venv/bin/python -m bench.run --gpu --cuda-arch 90-real  # H100/H200 only: fast build

Offline: the sources come from the pinned llama-cpp-python sdist (``--sdist``, or the copy
bench/build_llama_server.sh extracted, or one in the cache), the model from the PyPI model
package's files. One CMake build (Ninja, ``-DGGML_CUDA=ON``, the architectures of
``--cuda-arch``, shared libraries) gives both ``llama-server`` and the ``libllama`` /
``libggml*`` that llama-cpp-python loads: ours runs on the project's venv with
``LLAMA_CPP_LIB_PATH`` pointing at that build, so the Python bindings and the C code match.
(``LLAMA_GPU=cuda ./serve.sh`` is the separate, pip-built way to run ours on a GPU.)

Workloads: N concurrent streams (short prompts, 256 tokens each, greedy, ignore_eos) for N
in ``--streams``, a shared ~1,600-token prefix (64 requests, 16 at a time) and multi-turn
conversations (24 x 3 turns). The report names the GPU (nvidia-smi) and goes into
BENCHMARKS.md between GPU markers; the raw figures into bench/out/gpu-results-*.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from .client import completion_payload, make_client, run_concurrent, stream_completion
from .prompts import PromptBook, http_tokenizer, short_text
from .servers import CACHE_ROOT, ServerSpec, llama_version, start, stop, wait_ready
from .workloads import FULL, Ctx, Sample, w3_shared_system, w4_multi_turn

LLAMA = "llama-server"
LLAMA_BS = "llama-server-bs"
OURS = "ours"
SERVERS = (LLAMA, LLAMA_BS, OURS)
MARK_START = "<!-- gpu-bench:start -->"
MARK_END = "<!-- gpu-bench:end -->"


def log(msg: str) -> None:
    print(f"[bench-gpu] {msg}", flush=True)


# --- the plan -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """A command of the build."""

    what: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


@dataclass(frozen=True)
class GpuPlan:
    gpu: str  # nvidia-smi's description, or why there is none
    arch: str  # CMAKE_CUDA_ARCHITECTURES
    source: Path  # the vendored llama.cpp
    sdist: Path | None  # where the source comes from when it is not extracted yet
    build_dir: Path
    build: list[Step]
    servers: list[ServerSpec]
    streams: list[int]
    slots: int
    ctx: int
    repeats: int

    @property
    def llama_server(self) -> Path:
        return self.build_dir / "bin" / "llama-server"

    def describe(self) -> str:
        lines = [
            f"GPU: {self.gpu}",
            f"CUDA architectures: {self.arch}",
            f"source: {self.source}" + (f" (from {self.sdist})" if self.sdist else ""),
            "build:",
            *(f"  {s.what}: {s.shell()}" for s in self.build),
            "servers (one at a time):",
            *(f"  {s.name}: {_spec_line(s)}" for s in self.servers),
            f"workloads: streams {self.streams} x 256 tokens; shared 1600-token prefix, "
            "64 requests, 16 at a time; multi-turn 24 conversations x 3 turns",
            f"repeats: {self.repeats}",
        ]
        return "\n".join(lines)


def _spec_line(s: ServerSpec) -> str:
    env = " ".join(f"{k}={v}" for k, v in s.env.items())
    return (env + " " if env else "") + shlex.join(s.argv)


def gpu_description() -> str:
    """The GPU(s) as nvidia-smi names them, with memory, driver and compute capability."""
    q = "name,memory.total,driver_version,compute_cap"
    try:
        r = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"none found (nvidia-smi: {e.__class__.__name__})"
    out = r.stdout.strip()
    return out if r.returncode == 0 and out else f"none found (nvidia-smi exit {r.returncode})"


def default_arch(gpu: str) -> str:
    """The first GPU's compute capability as a CMake architecture ("9.0" -> "90-real"): a
    one-architecture build stays within minutes. "native" when nvidia-smi says nothing."""
    try:
        cap = gpu.splitlines()[0].rsplit(",", 1)[1].strip()
        major, minor = cap.split(".")
        return f"{int(major)}{int(minor)}-real"
    except (IndexError, ValueError):
        return "native"


def find_source(version: str, sdist: Path | None) -> tuple[Path, Path | None]:
    """The vendored llama.cpp to build, and the sdist to extract it from (None when it is
    extracted already). Never downloads: bench/build_llama_server.sh's extracted copy, or
    an sdist given or cached under the cache root."""
    extracted = CACHE_ROOT / f"llama-server-{version}" / "src"
    name = f"llama_cpp_python-{version}"
    if sdist is not None and sdist.is_dir():
        return sdist / "vendor" / "llama.cpp", None
    vendored = extracted / name / "vendor" / "llama.cpp"
    if sdist is None and (vendored / "CMakeLists.txt").is_file():
        return vendored, None
    candidates = [sdist] if sdist else [CACHE_ROOT / "sdist" / f"{name}.tar.gz"]
    return vendored, next((c for c in candidates if c.is_file()), candidates[0])


def build_steps(source: Path, build_dir: Path, arch: str, jobs: int) -> list[Step]:
    """Configure and build llama-server and the shared libraries llama-cpp-python loads."""
    configure = [
        "cmake",
        "-S",
        str(source),
        "-B",
        str(build_dir),
        "-G",
        "Ninja",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_CUDA=ON",
        f"-DCMAKE_CUDA_ARCHITECTURES={arch}",
        "-DBUILD_SHARED_LIBS=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
    ]
    build = ["cmake", "--build", str(build_dir), "--target", "llama-server", "llama"]
    return [
        Step("configure", configure),
        Step("build", [*build, "-j", str(jobs)]),
    ]


def server_specs(
    model: str, build_dir: Path, slots: int, ctx: int, threads: int
) -> list[ServerSpec]:
    """The three servers, identically configured; -bs on llama-server-bs and ours."""
    common = ["-m", model, "-c", str(ctx), "-np", str(slots), "-kvu"]
    common += ["-ngl", "99", "-fa", "on", "-t", str(threads)]
    binary = str(build_dir / "bin" / "llama-server")
    lib_env = {"LLAMA_CPP_LIB_PATH": str(build_dir / "bin")}
    return [
        ServerSpec(LLAMA, [binary, *common, "--no-webui"]),
        ServerSpec(LLAMA_BS, [binary, *common, "--no-webui", "-bs"]),
        ServerSpec(OURS, [sys.executable, "-m", "server", *common, "-bs"], env=lib_env),
    ]


def make_plan(args: argparse.Namespace, model: str) -> GpuPlan:
    gpu = gpu_description()
    arch = args.cuda_arch or default_arch(gpu)
    version = llama_version()
    source, sdist = find_source(version, Path(args.sdist) if args.sdist else None)
    build_dir = CACHE_ROOT / f"llama-cuda-{version}-{arch.replace(';', '_')}" / "build"
    jobs = args.jobs or os.cpu_count() or 1
    return GpuPlan(
        gpu=gpu,
        arch=arch,
        source=source,
        sdist=sdist,
        build_dir=build_dir,
        build=build_steps(source, build_dir, arch, jobs),
        servers=server_specs(model, build_dir, args.gpu_slots, args.gpu_ctx, args.threads),
        streams=args.streams,
        slots=args.gpu_slots,
        ctx=args.gpu_ctx,
        repeats=args.repeats or 2,
    )


# --- building -----------------------------------------------------------------------------


def build(plan: GpuPlan) -> None:
    """Extract the sources if needed and build once (skipped when both outputs exist)."""
    lib = plan.build_dir / "bin" / "libllama.so"
    if plan.llama_server.is_file() and lib.is_file():
        log(f"using the build in {plan.build_dir}")
        return
    if not (plan.source / "CMakeLists.txt").is_file():
        if plan.sdist is None or not plan.sdist.is_file():
            raise SystemExit(
                f"no llama.cpp sources at {plan.source} and no sdist at {plan.sdist}: pass "
                "--sdist PATH (llama_cpp_python-<version>.tar.gz, from `pip download "
                "--no-deps --no-binary :all: llama-cpp-python==<version>`)"
            )
        dest = plan.source.parents[2]
        log(f"extracting {plan.sdist} into {dest}")
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(plan.sdist) as tf:
            tf.extractall(dest, filter="data")
    for step in plan.build:
        log(f"{step.what}: {step.shell()}")
        subprocess.run(step.argv, check=True, env={**os.environ, **step.env})


# --- workloads ----------------------------------------------------------------------------

STREAM_OUT = 256
# no cold re-runs with log-probs: they would sample on the CPU inside the timed run
SHARED = dataclasses.replace(
    FULL, w3_system=1600, w3_questions=64, w3_concurrency=16, w3_cold_checks=0
)
TURNS = dataclasses.replace(FULL, w4_convs=24, w4_turns=3, w4_concurrency=24, w4_out=48)


async def streams(ctx: Ctx, url: str, n: int, rep: int) -> dict[str, float | None]:
    """``n`` concurrent greedy streams of STREAM_OUT tokens: aggregate tok/s, TTFT p50."""
    payloads = [
        completion_payload(short_text(f"gpu-s{n}-r{rep}-{i}", 12), STREAM_OUT) for i in range(n)
    ]
    wall, results = await run_concurrent(ctx.client, url, payloads, n)
    ttfts = [r.ttft_s * 1e3 for r in results if r.ttft_s is not None]
    return {
        "tps": sum(r.predicted_n for r in results) / wall,
        "ttft_p50_ms": statistics.median(ttfts) if ttfts else None,
    }


async def run_server(plan: GpuPlan, url: str, rep: int) -> dict[str, dict[str, float | None]]:
    """Every workload once against the server at ``url``."""
    out: dict[str, dict[str, float | None]] = {}
    async with make_client() as client:
        await stream_completion(client, url, completion_payload("Warm up: one two three", 8))
        book = PromptBook(http_tokenizer(client, lambda: url))
        for n in plan.streams:
            out[f"streams_{n}"] = await streams(Ctx(client, book, FULL, {}), url, n, rep)
        sp = _UrlOnly(url)
        shared: Sample = await w3_shared_system(Ctx(client, book, SHARED, {}), sp, rep)  # type: ignore[arg-type]
        out["shared_prefix"] = {
            k: shared.metrics.get(k) for k in ("wall_s", "ttft_p50_ms", "ttft_max_ms")
        }
        turns: Sample = await w4_multi_turn(Ctx(client, book, TURNS, {}), sp, rep)  # type: ignore[arg-type]
        out["multi_turn"] = {k: turns.metrics.get(k) for k in ("wall_s", "ttft_later_p50_ms")}
    return out


@dataclass
class _UrlOnly:
    """What the shared workloads read of a server: its URL."""

    url: str


def measure(plan: GpuPlan, log_dir: Path) -> dict[str, list[dict]]:
    """Each server alone on the GPU, ``plan.repeats`` times through every workload."""
    runs: dict[str, list[dict]] = {}
    for spec in plan.servers:
        sp = start(spec, log_dir)
        try:
            log(f"starting {spec.name}: {_spec_line(spec)} (log {sp.log_path})")
            wait_ready(sp)
            runs[spec.name] = [
                asyncio.run(run_server(plan, sp.url, r)) for r in range(plan.repeats)
            ]
            log(f"{spec.name}: {json.dumps(runs[spec.name][-1])}")
        finally:
            stop(sp)
    return runs


# --- report -------------------------------------------------------------------------------


def rows(streams: list[int]) -> list[tuple[str, str, str]]:
    """(workload, metric, label) of the report's rows."""
    sh, tu = SHARED, TURNS
    return [
        *[
            (f"streams_{n}", "tps", f"{n} stream{'s' if n > 1 else ''}, {STREAM_OUT} tokens: tok/s")
            for n in streams
        ],
        (
            "shared_prefix",
            "wall_s",
            f"shared ~{sh.w3_system:,}-token prefix, {sh.w3_questions} requests, "
            f"{sh.w3_concurrency} at a time: wall s",
        ),
        ("shared_prefix", "ttft_p50_ms", "same: TTFT p50 ms"),
        ("shared_prefix", "ttft_max_ms", "same: TTFT max ms"),
        (
            "multi_turn",
            "wall_s",
            f"multi-turn, {tu.w4_convs} conversations x {tu.w4_turns} turns: wall s",
        ),
        ("multi_turn", "ttft_later_p50_ms", "same: turn-2/3 TTFT p50 ms"),
    ]


def medians(runs: dict[str, list[dict]]) -> dict[str, dict[str, dict[str, float]]]:
    """server -> workload -> metric -> median over the repeats."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for server, reps in runs.items():
        for w in reps[0]:
            for k in reps[0][w]:
                xs = [r[w][k] for r in reps if r.get(w, {}).get(k) is not None]
                if xs:
                    out.setdefault(server, {}).setdefault(w, {})[k] = statistics.median(xs)
    return out


def markdown(plan: GpuPlan, med: dict[str, dict[str, dict[str, float]]], date: str) -> str:
    def cell(server: str, w: str, k: str) -> float | None:
        return med.get(server, {}).get(w, {}).get(k)

    def fmt(x: float | None) -> str:
        return "—" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.2f}"

    lines = [
        MARK_START,
        "## GPU: llama-server, llama-server -bs and ours (-bs)",
        "",
        f"GPU: **{plan.gpu}**; CUDA architectures `{plan.arch}`; {date}; "
        f"{plan.slots} slots, context {plan.ctx}, `-ngl 99 -fa on -kvu`; medians of "
        f"{plan.repeats} repeats; each server alone on the GPU. Commands:",
        "",
        *(f"- {s.name}: `{_spec_line(s)}`" for s in plan.servers),
        "",
        "| workload | llama-server | llama-server -bs | ours | ours / llama-server | ours / llama-server -bs |",
        "|---|---|---|---|---|---|",
    ]
    for w, k, label in rows(plan.streams):
        a, b, o = (cell(s, w, k) for s in SERVERS)
        if a is None and b is None and o is None:
            continue
        r1 = f"{o / a:.2f}" if o and a else "—"
        r2 = f"{o / b:.2f}" if o and b else "—"
        lines.append(f"| {label} | {fmt(a)} | {fmt(b)} | {fmt(o)} | {r1} | {r2} |")
    lines += ["", "tok/s: higher is better; wall and TTFT: lower is better.", MARK_END]
    return "\n".join(lines) + "\n"


def write_report(path: Path, section: str) -> None:
    """Replace the GPU section of ``path`` (or append one), leaving the rest as it is."""
    text = path.read_text() if path.exists() else ""
    if MARK_START in text and MARK_END in text:
        head, rest = text.split(MARK_START, 1)
        text = head + section + rest.split(MARK_END, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    path.write_text(text)


def run_gpu(args: argparse.Namespace, model: str) -> int:
    plan = make_plan(args, model)
    print(plan.describe(), flush=True)
    if args.dry_run:
        return 0
    if plan.gpu.startswith("none found"):
        log("no GPU: nothing to measure (--dry-run prints the plan)")
        return 2
    build(plan)
    runs = measure(plan, args.out_dir / "logs")
    med = medians(runs)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    raw = {"gpu": plan.gpu, "arch": plan.arch, "runs": runs, "medians": med}
    (args.out_dir / f"gpu-results-{stamp}.json").write_text(json.dumps(raw, indent=1))
    write_report(args.output, markdown(plan, med, stamp))
    log(f"wrote {args.output} (GPU section) and {args.out_dir}/gpu-results-{stamp}.json")
    return 0
