"""Workload 11 (copy-edit, speculative decoding): its deterministic texts and prompts, the
copied-share measure, the server configurations it runs and the ratios the report gives.
(Running it needs the servers: `python -m bench.run --only 11`.)"""

from __future__ import annotations

import re
import sys

from bench import copyedit
from bench.report import Results, variant_lines
from bench.run import parse_args, variant_specs
from bench.servers import LCP, LLAMA_SERVER, OURS, ServerSpec
from bench.workloads import WORKLOADS, Sample


def test_texts_are_deterministic_natural_and_distinct_per_key() -> None:
    a = copyedit.copy_text("w11-r0-0", 8, "Mara")
    assert a == copyedit.copy_text("w11-r0-0", 8, "Mara")
    assert a != copyedit.copy_text("w11-r1-0", 8, "Mara")  # another order
    paragraphs = a.split("\n\n")
    assert len(paragraphs) == len(set(paragraphs)) == 8
    assert "{" not in a and a.count("Mara") >= 8
    assert copyedit.copy_text("w11-r0-0", 8, "Jonas") == a.replace("Mara", "Jonas")


def test_no_long_phrase_repeats_inside_a_text() -> None:
    # A copy that meets a repeated phrase has two places to continue from.
    words = re.findall(r"\S+", copyedit.copy_text("k", len(copyedit.PARAGRAPHS), "Elena"))
    grams = [" ".join(words[i : i + 6]) for i in range(len(words) - 5)]
    assert len(grams) == len(set(grams))


def test_task_primes_the_rewritten_first_sentence() -> None:
    t = copyedit.copy_task("w11-r2-0", 8, "Tobias", "Lucia")
    text = copyedit.copy_text("w11-r2-0", 8, "Tobias")
    assert t.prompt.startswith("<start_of_turn>user\nRewrite this text exactly, changing the name")
    assert "Tobias to Lucia" in t.prompt and text in t.prompt
    head, primed = t.prompt.rsplit("<start_of_turn>model\n", 1)
    assert primed + t.source == text.replace("Tobias", "Lucia", primed.count("Lucia"))
    assert primed.endswith(".") and t.source.startswith(" ")  # no dangling space token


def test_copied_share() -> None:
    t = copyedit.copy_task("x", 4, "Priya", "Samuel")
    assert copyedit.copied_share(t.source.replace("Priya", "Samuel"), t) == 1.0
    assert copyedit.copied_share(t.source, t) == 1.0  # the old name still counts as a copy
    half = t.source[: len(t.source) // 2]
    other = "zq " * (len(half) // 3)
    assert abs(copyedit.copied_share(half + other, t) - 0.5) < 0.05
    assert copyedit.copied_share(other, t) == 0.0
    assert copyedit.copied_share("", t) == 0.0


def test_w11_runs_each_server_plain_and_with_ngram_simple() -> None:
    w = WORKLOADS[11]
    assert parse_args(["--only", "11"]).only == [11]
    base = [
        ServerSpec(LLAMA_SERVER, ["llama-server", "-m", "m.gguf"]),
        ServerSpec(OURS, [sys.executable, "-m", "server", "-m", "m.gguf"]),
        ServerSpec(LCP, ["python", "-m", "llama_cpp.server"]),
    ]
    specs = variant_specs(base, w.variants)
    names = [s.name for s in specs]
    assert names == [LLAMA_SERVER, copyedit.LLAMA_NGRAM, OURS, copyedit.OURS_NGRAM]
    for s in specs:
        spec_flag = s.argv[-2:] == ["--spec-type", "ngram-simple"]
        assert spec_flag == s.name.endswith("-ngram")
    assert base[0].argv == ["llama-server", "-m", "m.gguf"]  # the base specs are not changed


def _results(ours_ngram: float, ours: float, llama_ngram: float) -> Results:
    r = Results()
    for name, tps in (
        (copyedit.OURS_NGRAM, ours_ngram),
        (OURS, ours),
        (copyedit.LLAMA_NGRAM, llama_ngram),
        (LLAMA_SERVER, 60.0),
    ):
        r.add(11, name, Sample(metrics={"decode_tps_server": tps, "wall_s": 1000.0 / tps}))
    return r


def test_report_gives_the_target_ratios() -> None:
    w = WORKLOADS[11]
    lines = variant_lines(_results(120.0, 60.0, 110.0), w)
    first, second = lines[0], lines[1]
    assert first.startswith(f"- {copyedit.OURS_NGRAM} / {OURS}, decode")
    assert "2.00x (target ≥ 1.5: met)" in first
    assert "1.09x (target ≥ 1: met)" in second
    lines = variant_lines(_results(80.0, 60.0, 110.0), w)
    assert "1.33x (target ≥ 1.5: NOT met)" in lines[0]
    assert "0.73x (target ≥ 1: NOT met)" in lines[1]
    r = _results(80.0, 60.0, 110.0)
    r.samples[11][copyedit.OURS_NGRAM] = [Sample(na="did not start")]
    assert "n/a (target ≥ 1.5: n/a)" in variant_lines(r, w)[0]
