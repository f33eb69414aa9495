"""The GPU benchmark's CPU-side logic: the build and server command lines it plans, the
architecture it picks, the report section it writes. (Running it needs a GPU.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench import gpu
from bench.run import parse_args


def _plan(tmp_path: Path, *extra: str) -> gpu.GpuPlan:
    sdist = tmp_path / "llama_cpp_python-x"
    (sdist / "vendor" / "llama.cpp").mkdir(parents=True)
    args = parse_args(["--gpu", "--dry-run", "--sdist", str(sdist), "-t", "16", *extra])
    return gpu.make_plan(args, "/models/m.gguf")


def test_build_is_one_cuda_build_of_the_vendored_sources(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "--cuda-arch", "90-real", "--jobs", "16")
    assert plan.source == tmp_path / "llama_cpp_python-x" / "vendor" / "llama.cpp"
    assert plan.sdist is None  # extracted already: nothing to download or unpack
    configure, build = (s.argv for s in plan.build)
    assert configure[:3] == ["cmake", "-S", str(plan.source)]
    assert "-G" in configure and configure[configure.index("-G") + 1] == "Ninja"
    for flag in ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90-real", "-DBUILD_SHARED_LIBS=ON"):
        assert flag in configure
    assert build[-4:] == ["llama-server", "llama", "-j", "16"]
    assert "90-real" in str(plan.build_dir)


def test_servers_share_flags_and_ours_loads_the_cuda_libraries(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "--cuda-arch", "89-real", "--gpu-slots", "32")
    names = [s.name for s in plan.servers]
    assert names == [gpu.LLAMA, gpu.LLAMA_BS, gpu.OURS]
    common = ["-m", "/models/m.gguf", "-c", "32768", "-np", "32", "-kvu", "-ngl", "99"]
    for s in plan.servers:
        assert s.argv[1 : 1 + len(common)] == common or s.argv[3 : 3 + len(common)] == common
        i = s.argv.index("-fa")
        assert s.argv[i + 1] == "on"
    llama, llama_bs, ours = plan.servers
    assert "-bs" not in llama.argv and "-bs" in llama_bs.argv and "-bs" in ours.argv
    assert llama.argv[0] == str(plan.llama_server)
    assert ours.argv[:3] == [sys.executable, "-m", "server"]
    assert ours.env == {"LLAMA_CPP_LIB_PATH": str(plan.build_dir / "bin")}
    assert plan.streams == [1, 8, 32, 64]


def test_default_arch_from_nvidia_smi() -> None:
    assert gpu.default_arch("NVIDIA H200, 143771 MiB, 580.1, 9.0") == "90-real"
    assert gpu.default_arch("NVIDIA L4, 23034 MiB, 550.5, 8.9\nNVIDIA L4, 1, 2, 8.9") == "89-real"
    assert gpu.default_arch("none found (nvidia-smi: FileNotFoundError)") == "native"


def test_report_section_is_replaced_in_place(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    med = {
        gpu.LLAMA: {"streams_32": {"tps": 736.0}},
        gpu.LLAMA_BS: {"streams_32": {"tps": 1909.0}},
        gpu.OURS: {"streams_32": {"tps": 1950.0}},
    }
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# CPU figures\n\nkept\n")
    gpu.write_report(out, gpu.markdown(plan, med, "d1"))
    gpu.write_report(out, gpu.markdown(plan, med, "d2"))
    text = out.read_text()
    assert text.startswith("# CPU figures\n\nkept\n")
    assert text.count(gpu.MARK_START) == 1 and "d2" in text and "d1" not in text
    assert "| 32 streams, 256 tokens: tok/s | 736 | 1,909 | 1,950 | 2.65 | 1.02 |" in text
    assert plan.gpu in text


def test_dry_run_runs_offline_without_a_gpu() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "bench.run", "--gpu", "--dry-run", "--cuda-arch", "90-real"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert r.returncode == 0, r.stderr
    assert "-DGGML_CUDA=ON" in r.stdout and "llama-server-bs" in r.stdout
