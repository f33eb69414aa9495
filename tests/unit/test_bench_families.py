"""bench/families.py without servers: the corpus it walks, its argument check, and the README
table and gap list it writes from a results file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import families as F


def test_the_corpus_is_every_template_with_tools() -> None:
    got = F.corpus(None)
    names = [i.path.stem for i in got]
    assert len(names) > 50
    by = {i.path.stem: i for i in got}
    assert by["Qwen-Qwen3-0.6B"].family == "hermes"
    # thinking the generation prompt opens, in the template's own tag
    assert by["llama-cpp-deepseek-r1"].open_tag == "<think>"
    assert by["Cohere2MoE"].open_tag == "<|START_THINKING|>"
    assert by["Cohere2MoE"].close_tag == "<|END_THINKING|>"
    assert by["Qwen-Qwen3-0.6B"].open_tag == ""
    # --templates: those, in that order
    assert [i.path.stem for i in F.corpus(["Kimi-K3", "GLM-4.6"])] == ["Kimi-K3", "GLM-4.6"]


@pytest.mark.parametrize(
    "arguments,why",
    [
        ('{"city": "Paris", "days": 3}', ""),
        ('{"city": "Paris"}', "keys"),
        ('{"city": "Paris", "days": 9}', "days"),
        ('{"city": "Paris", "days": true}', "days"),
        ('{"city": "' + "x" * 21 + '", "days": 1}', "city"),
        ("{nope", "not JSON"),
    ],
)
def test_arguments_are_checked_against_the_schema(arguments: str, why: str) -> None:
    got = F._args_ok("get_weather", arguments)
    assert (got == "") if not why else why in got
    assert "name" in F._args_ok("other", arguments)


def _server(forced: bool | None, turn: str = "", reasoning: bool | None = None) -> dict:
    return {
        "forced": {"ok": forced, "note": "HTTP 500: boom" if forced is False else ""},
        "streamed": {"ok": forced, "note": ""},
        "next_turn": {"ok": bool(turn), "note": turn} if turn else {"ok": None, "note": ""},
        "reasoning": {"ok": reasoning, "note": "0 chars reasoning"},
    }


def test_table_and_gaps_from_a_results_file(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    results = {
        "B": {
            "family": "glm",
            "thinks": "<think>",
            "servers": {
                "ours": _server(True, "33 computed, 258 cached, 31 after the shared prefix", False),
                "llama-server": _server(False, "", True),
            },
        },
        "A": {"family": "hermes", "thinks": "", "servers": {"ours": _server(True)}},
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    assert F.main(["--from", str(path), "--markdown"]) == 0
    out, err = capsys.readouterr()
    rows = out.splitlines()
    assert rows[0].startswith("| template | family | forced call")
    assert rows[2] == "| A | hermes | ✓ / ? | ✓ / ? | – / ? | – / ? |"
    assert rows[3] == "| B | glm | ✓ / 500 | ✓ / ✗ | ✓ 33/31 / – | ✗ / ✓ |"
    assert err.strip() == "llama-server passes, we do not: B reasoning: ours 0 chars reasoning"
