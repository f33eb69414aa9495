"""The design lives in the repository: docs/ARCHITECTURE.md's folder map (§2.1) and README's
"Architecture" section name every folder of ``server/``; every ``server/...`` path and every
``<folder>/<module>.py`` either names exists; and no file cites a design document outside the
repository (comments cite "ARCHITECTURE §N")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "server"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
README = ROOT / "README.md"

# a path under server/, not one inside another tree (llama.cpp's tools/server/)
SERVER_PATH = re.compile(r"(?<![\w./-])server/[\w./]*\w")
# what citing the outside design looked like (built, so that this file holds none of them)
OUTSIDE = tuple(a + b for a, b in [("DESIGN", " §"), ("DESIGN", ".md"), ("../", "shared")])
SCANNED = ("server", "tests", "bench", "scripts")
TEXT = {".py", ".md", ".sh", ".txt", ".toml", ".cfg", ".ini", ".json", ".yaml", ".yml"}
TEXT |= {".js", ".html", ".css", ".cmake"}


def _folders() -> set[str]:
    """The folders of ``server/``: each directory holding a file other than bytecode (the
    packages, and ``server/webui``, the chat page's built files)."""
    return {
        d.name
        for d in PKG.iterdir()
        if d.is_dir()
        and not d.name.startswith((".", "__"))
        and any(f.is_file() and "__pycache__" not in f.parts for f in d.rglob("*"))
    }


def _section(path: Path, heading: str) -> str:
    """The text under ``heading`` (a line starting with it) up to the next heading of the
    same or a higher level."""
    lines = path.read_text().splitlines()
    level = len(heading) - len(heading.lstrip("#"))
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    out = []
    for line in lines[start + 1 :]:
        hashes = len(line) - len(line.lstrip("#"))
        if 0 < hashes <= level and line[hashes : hashes + 1] == " ":
            break
        out.append(line)
    return "\n".join(out)


def _folder_map() -> str:
    return _section(DOC, "### 2.1 ")


def _readme_architecture() -> str:
    return _section(README, "## Architecture")


def _missing_folders(text: str) -> list[str]:
    return sorted(f for f in _folders() if f"server/{f}/" not in text)


def _missing_paths(text: str) -> list[str]:
    """``server/...`` paths, and ``<folder>/<module>.py`` names of a server folder, that
    ``text`` names and the tree lacks."""
    named = {m.group(0) for m in SERVER_PATH.finditer(text)}
    folders = "|".join(sorted(_folders()))
    modules = re.compile(rf"(?<![\w./-])(?:{folders})/[\w/]*\w\.py\b")
    named |= {"server/" + m.group(0) for m in modules.finditer(text)}
    return sorted(p for p in named if not (ROOT / p).exists())


def test_the_checks_see_folders_and_paths() -> None:
    assert {"engine", "llama", "settings", "webui"} <= _folders()
    assert "__pycache__" not in _folders()
    text = "`server/engine/engine.py`, engine/runner.py, tools/server/x, server/nowhere/x.py"
    assert _missing_paths(text) == ["server/nowhere/x.py"]
    assert _missing_paths("tiers/gone.py and llama/backend.py") == ["server/tiers/gone.py"]
    assert _missing_folders("server/engine/ server/llama") and "engine" not in _missing_folders(
        "server/engine/"
    )
    assert "## 2.2" not in _folder_map() and "server/engine/" in _folder_map()
    assert "## How it works" not in _readme_architecture()


def test_the_folder_map_names_every_folder() -> None:
    assert _missing_folders(_folder_map()) == []


def test_the_readme_architecture_names_every_folder() -> None:
    section = _readme_architecture()
    assert _missing_folders(section) == []
    assert "docs/ARCHITECTURE.md" in section


def test_every_path_named_exists() -> None:
    assert _missing_paths(DOC.read_text()) == []
    assert _missing_paths(_readme_architecture()) == []


def _scanned() -> list[Path]:
    files = [README, ROOT / "BENCHMARKS.md"]
    for top in SCANNED:
        for p in (ROOT / top).rglob("*"):
            parts = p.relative_to(ROOT).parts
            if (
                p.suffix in TEXT
                and p.is_file()
                and not any(x.startswith((".", "__py")) for x in parts)
            ):
                files.append(p)
    return files


def test_nothing_cites_a_design_outside_the_repository() -> None:
    files = _scanned()
    assert ROOT / "server" / "engine" / "engine.py" in files
    found = [
        f"{p.relative_to(ROOT)}:{i} {s!r}"
        for p in files
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        for s in OUTSIDE
        if s in line
    ]
    assert found == []
