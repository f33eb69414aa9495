"""A quick check, before the long test run, that the build works: llama-cpp-python loads the
libraries built by scripts/build_llama.sh, the default model loads and one decode gives
finite logits, and the llama-server of the same build starts (``--version``). Exits non-zero
with a message naming the step that failed."""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _decode_once(model_path: str) -> None:
    import llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(model_path.encode(), mp)
    if not model:
        raise SystemExit(f"smoke: the model did not load: {model_path}")
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 256, 64, 2, 2
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_model_get_vocab(model)
    text = b"The capital of France is"
    toks = (L.llama_token * 64)()
    n = L.llama_tokenize(vocab, text, len(text), toks, 64, True, False)
    if n <= 0:
        raise SystemExit("smoke: tokenizing failed")
    if L.llama_decode(ctx, L.llama_batch_get_one(toks, n)) != 0:
        raise SystemExit("smoke: llama_decode failed")
    n_vocab = L.llama_vocab_n_tokens(vocab)
    row = ctypes.cast(L.llama_get_logits_ith(ctx, -1), ctypes.POINTER(ctypes.c_float))
    if not all(math.isfinite(row[i]) for i in range(0, n_vocab, 997)):
        raise SystemExit("smoke: the logits are not finite")
    L.llama_free(ctx)
    L.llama_model_free(model)


def _quiet_decode(model_path: str) -> None:
    """``_decode_once`` with llama.cpp's load log (thousands of lines on fd 2) kept out."""
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        _decode_once(model_path)
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


def main() -> None:
    t = time.time()
    from server.http.app import default_model_path

    _quiet_decode(default_model_path())
    print(f"[smoke] model loaded and decoded in {time.time() - t:.1f} s")
    server = subprocess.run(
        [str(ROOT / "scripts/build_llama.sh"), "--server"], capture_output=True, text=True
    ).stdout.strip()
    r = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise SystemExit(f"smoke: {server} --version failed:\n{r.stderr[-2000:]}")
    version = next(x for x in (r.stdout + r.stderr).splitlines() if x.startswith("version"))
    print(f"[smoke] {Path(server).name}: {version}")


if __name__ == "__main__":
    sys.exit(main())
