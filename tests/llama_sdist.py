"""Files of the llama.cpp that the pinned llama-cpp-python sdist vendors (its
``vendor/llama.cpp``): ``tools/server/README.md`` (llama-server's flag table), its server tests.

``bench/build_llama_server.sh`` (run by ``./test.sh``) unpacks the sdist into
``$LLAMA_SERVER_CACHE`` (default ``~/.cache/llama-slot-server``)
``/llama-server-<version>/src/llama_cpp_python-<version>/``. ``vendored`` finds a file there;
when it is missing it downloads the sdist with pip (as the build script does) and unpacks that
one file into the same place, so a test never depends on the order tests run in."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def llama_cpp_python_version() -> str:
    """The ``llama-cpp-python==`` pin of requirements.txt."""
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.startswith("llama-cpp-python=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError("requirements.txt has no llama-cpp-python== pin")


def sdist_dir(version: str | None = None) -> Path:
    """Where build_llama_server.sh unpacks the sdist."""
    v = version or llama_cpp_python_version()
    cache = Path(os.environ.get("LLAMA_SERVER_CACHE", Path.home() / ".cache/llama-slot-server"))
    return cache / f"llama-server-{v}" / "src" / f"llama_cpp_python-{v}"


def _unpack_one(version: str, member: str, dest_root: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check"]
        cmd += [
            "--no-deps",
            "--no-binary",
            "llama-cpp-python",
            "-d",
            tmp,
            f"llama-cpp-python=={version}",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise AssertionError(f"pip download of the sdist failed:\n{r.stderr[-2000:]}")
        (tarball,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(tarball) as tar:
            info = tar.getmember(member)
            f = tar.extractfile(info)
            assert f is not None, member
            out = dest_root / member
            out.parent.mkdir(parents=True, exist_ok=True)
            part = out.with_name(out.name + ".part")
            part.write_bytes(f.read())
            part.replace(out)  # atomic: a concurrent reader sees all of it or nothing


def vendored(rel: str) -> Path:
    """``vendor/llama.cpp/<rel>`` of the pinned sdist; AssertionError saying what was tried
    when it can be neither found nor fetched."""
    version = llama_cpp_python_version()
    base = sdist_dir(version)
    path = base / "vendor" / "llama.cpp" / rel
    if not path.is_file():
        member = f"llama_cpp_python-{version}/vendor/llama.cpp/{rel}"
        try:
            _unpack_one(version, member, base.parent)
        except (AssertionError, OSError, KeyError, ValueError, subprocess.SubprocessError) as e:
            raise AssertionError(
                f"{path} is missing and could not be fetched ({type(e).__name__}: {e}); "
                "run ./test.sh or bench/build_llama_server.sh once to unpack the sdist"
            ) from e
    assert path.is_file(), f"{path} is missing after unpacking the sdist"
    return path
