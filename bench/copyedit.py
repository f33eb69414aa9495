"""Workload 11: copy-edit, an answer that mostly copies the prompt (speculative decoding).

A ~600-token story (deterministic, natural prose: distinct hand-written paragraphs in a seeded
order, so no long phrase repeats inside a text and a copy never has two places to jump to) and
the instruction to rewrite it exactly with one name changed. The prompt is raw Gemma 3 turn
markup on /v1/completions: the default model's GGUF has no chat template, and llama-server
would fall back to ChatML, which the model does not follow. The answer's first sentence is
primed (already rewritten), so the model starts copying at once instead of echoing the
instruction.

The default 270M base model copies the text well (it sometimes skips a paragraph) but does not
apply the name change; ``copied_share`` says how much of each answer is a copy of the source.
Every server runs twice: without speculation and with ``--spec-type ngram-simple`` (drafts
from n-grams already in the slot's context), and the report gives speculative / plain decode
speed and ours / llama-server's with speculation.
"""

from __future__ import annotations

import difflib
import random
import statistics
from dataclasses import dataclass
from typing import Any

import httpx

from .client import completion_payload, stream_completion
from .servers import LLAMA_SERVER, OURS

SPEC_FLAGS = ("--spec-type", "ngram-simple")
SPEC_SUFFIX = "-ngram"  # server name suffix of the speculative configurations
LLAMA_NGRAM = LLAMA_SERVER + SPEC_SUFFIX
OURS_NGRAM = OURS + SPEC_SUFFIX

# (old name, new name) per text; a text's key picks its paragraphs and their order.
NAME_PAIRS = (("Mara", "Jonas"), ("Tobias", "Lucia"), ("Elena", "Henrik"), ("Priya", "Samuel"))

PARAGRAPHS = (
    "{name} grew up in a narrow stone house at the edge of a fishing town. Every morning the "
    "smell of salt and tar came through the kitchen window, and the gulls argued on the roof "
    "before sunrise. {name}'s grandmother kept a ledger of every boat that left the harbor, "
    "and she taught the child to read the tides from the marks on the pier.",
    "When the old clock in the market hall stopped one winter, nobody in the council knew how "
    "to repair it. {name} climbed the wooden ladder with a bag of tools, opened the brass case "
    "and found a bent spring wrapped in dust. Two days later the bells rang again, a little "
    "late at first, and the baker across the square sent up a warm loaf as thanks.",
    "The library was {name}'s favorite place in the rainy months. Its shelves leaned slightly "
    "to the left, the floor creaked near the atlas table, and the librarian wore green gloves "
    "to protect the oldest maps. {name} spent whole afternoons copying the coastlines by hand, "
    "learning the names of capes and islands that no tourist had ever visited.",
    "In the spring of that year a traveling painter arrived with a cart full of canvases. He "
    "asked {name} to show him the best view of the valley, and together they walked up the "
    "goat path behind the orchard. At the top he set up his easel and worked in silence until "
    "the light turned orange, while {name} collected wild thyme for supper.",
    "The bridge over the river had been built by engineers from the capital, but the local "
    "carpenters maintained it. Each autumn they replaced a few planks, tightened the iron "
    "bolts and painted the railings a deep red. {name} joined them at fourteen, carrying "
    "buckets and learning which knots would hold a scaffold in a strong wind.",
    "Letters arrived only twice a week, brought by a postman on a tired gray horse. {name} "
    "waited by the gate for news from a cousin who had sailed to the southern ports. The "
    "letters were short and full of spelling mistakes, yet they described markets selling "
    "oranges, lanterns made of colored glass, and a lighthouse taller than any church.",
    "One evening a storm pushed three boats onto the rocks below the cliffs. The whole town ran "
    "down with ropes and lamps, and {name} helped to pull a young sailor out of the cold water. "
    "For weeks afterwards people stopped {name} in the street to shake hands, although the "
    "rescue had really been the work of a dozen neighbors.",
    "The school had only two rooms and a stove that smoked whenever the wind came from the "
    "east. Their teacher, a patient woman with a loud laugh, believed that arithmetic was best "
    "learned by measuring real things. So {name} and the other pupils measured the length of "
    "the pier, the height of the bell tower and the weight of a sack of flour.",
    "Years later {name} opened a small workshop near the station, repairing watches, radios and "
    "the occasional bicycle. The door was always open, and farmers often came in just to talk "
    "about the weather or the price of grain. A shelf by the window held objects that nobody "
    "had ever collected, each with a paper label written in careful handwriting.",
    "Most people remember {name} for the garden behind the workshop. It was not large, but it "
    "held plum trees, rows of beans, a bench under a vine and a copper bowl where birds bathed "
    "in summer. On Sunday mornings visitors from the city would stop at the gate, and {name} "
    "would cut them a few roses to take home on the train.",
    "During the long winter of the flood, the lower streets filled with brown water for nine "
    "days. {name} rowed a borrowed boat from door to door, delivering candles, dry socks and "
    "jars of soup. The mayor later wrote in the town chronicle that no house had been "
    "forgotten, and he underlined that sentence twice.",
    "Late in life {name} began to write down the stories of the old fishermen before they were "
    "lost. The notebooks filled a whole cupboard: recipes for smoked eel, songs sung while "
    "mending nets, and the names of winds that blew only in March. A museum in the capital now "
    "keeps them behind glass, open at a page about herring.",
)


def copy_text(key: str, n_paragraphs: int, name: str) -> str:
    """``n_paragraphs`` distinct paragraphs in an order seeded by ``key``, naming ``name``."""
    order = random.Random(key).sample(PARAGRAPHS, n_paragraphs)
    return "\n\n".join(p.format(name=name) for p in order)


@dataclass(frozen=True)
class CopyTask:
    prompt: str  # instruction, text, and the answer's first sentence (rewritten)
    source: str  # the text the rest of the answer should copy
    old: str
    new: str


def copy_task(key: str, n_paragraphs: int, old: str, new: str) -> CopyTask:
    """The instruction in Gemma 3 turn markup, the answer primed with its first sentence."""
    text = copy_text(key, n_paragraphs, old)
    first = text[: text.index(". ") + 1]  # no trailing space: " Every" is one token
    prompt = (
        f"<start_of_turn>user\nRewrite this text exactly, changing the name {old} to {new}."
        f"\n\n{text}<end_of_turn>\n<start_of_turn>model\n{first.replace(old, new)}"
    )
    return CopyTask(prompt, text[len(first) :], old, new)


def copied_share(answer: str, task: CopyTask, min_run: int = 24) -> float:
    """Share of the answer's characters in runs of >= ``min_run`` characters copied from the
    source (either name counts as copied)."""
    out = answer.replace(task.new, task.old)
    if not out:
        return 0.0
    sm = difflib.SequenceMatcher(None, out, task.source, autojunk=False)
    copied = sum(b.size for b in sm.get_matching_blocks() if b.size >= min_run)
    return copied / len(out)


async def _count_tokens(client: httpx.AsyncClient, url: str, text: str) -> int:
    resp = await client.post(f"{url}/tokenize", json={"content": text})
    resp.raise_for_status()
    return len(resp.json()["tokens"])


def _sum_timing(results: list[Any], key: str) -> float | None:
    vals = [r.timing(key) for r in results]
    return None if any(v is None for v in vals) else float(sum(v for v in vals if v is not None))


async def run_copy_edit(
    client: httpx.AsyncClient, url: str, tag: str, n_texts: int, n_paragraphs: int, first: int = 0
) -> dict[str, float | None]:
    """``n_texts`` copy-edits, one at a time; each generates as many tokens as its source
    (ignore_eos, so every server generates the same count). Decode rates are medians over the
    texts; draft counts (llama-server's ``timings.draft_n``/``draft_n_accepted``) are sums,
    None when the server reports none (no speculation). Text i takes name pair first + i."""
    results, shares = [], []
    for i in range(n_texts):
        old, new = NAME_PAIRS[(first + i) % len(NAME_PAIRS)]
        task = copy_task(f"{tag}-{i}", n_paragraphs, old, new)
        n = await _count_tokens(client, url, task.source)
        # cache_prompt off: each server prefills the whole prompt in the same ubatches, so both
        # generate the same greedy text and the speeds compare like for like. With the cache
        # on, the servers reuse different prefixes of the previous text's prompt (llama.cpp is
        # not batch-invariant), their answers drift apart, and so do their draft acceptances.
        payload = completion_payload(task.prompt, n, cache_prompt=False)
        r = await stream_completion(client, url, payload)
        results.append(r)
        shares.append(copied_share(r.text, task))
    drafted = _sum_timing(results, "draft_n")
    accepted = _sum_timing(results, "draft_n_accepted")
    server_tps = [r.timing("predicted_per_second") for r in results]
    client_tps = [r.decode_tps for r in results if r.decode_tps is not None]
    return {
        "decode_tps_server": None
        if None in server_tps
        else statistics.median(v for v in server_tps if v is not None),
        "decode_tps": statistics.median(client_tps) if client_tps else None,
        "wall_s": sum(r.total_s for r in results),
        "draft_n": drafted,
        "draft_n_accepted": accepted,
        "acceptance": accepted / drafted if drafted and accepted is not None else None,
        "copied_share": statistics.fmean(shares),
        "predicted_n": float(sum(r.predicted_n for r in results)),
    }
