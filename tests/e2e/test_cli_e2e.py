"""A llama-server command line starts this server: the flags llama.cpp's own server tests use,
default sampling from the flags, --no-jinja, --props, one warning for the ignored flags."""

from __future__ import annotations

import subprocess
import sys

import openai

from tests.e2e.conftest import ROOT

# What llama.cpp's tools/server/tests/utils.py passes, plus a few ignored ones.
ARGS = ["--temp", "0.3", "--seed", "42", "--no-jinja", "--host", "127.0.0.1"]
ARGS += ["--ctx-size", "2048", "--parallel", "2", "--batch-size", "512", "-cb", "--no-ui"]
ARGS += ["--n-predict", "64", "--props", "--keep", "4", "-ctk", "f16", "--no-mmproj"]
ARGS += ["--path", "/srv/ui", "--yarn-orig-ctx", "5", "--rpc", "localhost:50052"]


def test_llama_server_command_line(make_server, tmp_path):
    log_file = tmp_path / "server.log"
    s = make_server(*ARGS, "--log-file", str(log_file))
    props = s.client.get("/props").json()
    gs = props["default_generation_settings"]
    assert (gs["temperature"], gs["seed"], gs["n_predict"]) == (0.3, 42, 64)
    assert props["chat_template_name"] == "gemma"  # --no-jinja: the built-in template
    assert props["total_slots"] == 2 and props["endpoint_props"] is True
    assert s.client.post("/props", json={}).json() == {"success": True}

    # A request gets the server's defaults for what it leaves out, its own values otherwise.
    body = {"prompt": "Hello", "n_predict": 2}
    r = s.client.post("/completion", json=body).json()
    assert (r["generation_settings"]["temperature"], r["generation_settings"]["seed"]) == (0.3, 42)
    r = s.client.post("/completion", json={**body, "temperature": 0.8}).json()
    assert r["generation_settings"]["temperature"] == 0.8

    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
    chat = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.usage.completion_tokens >= 1

    # Exactly one warning, naming the ignored flags and not those that change nothing here.
    text = log_file.read_text()
    warnings = [ln for ln in text.splitlines() if "ignoring llama-server flags" in ln]
    assert len(warnings) == 1, text
    for name in ("--path", "--yarn-orig-ctx", "--rpc"):
        assert name in warnings[0]
    for name in ("--cont-batching", "--cache-type-k", "--mmproj", "--temp", "--props"):
        assert name not in warnings[0]


def test_malformed_flag_exits_2():
    r = subprocess.run(
        [sys.executable, "-m", "server", "--temp", "0.8", "--top-k", "many"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--top-k" in r.stderr


def test_a_context_beyond_the_training_context_is_capped_per_slot(make_server):
    """As llama-server: -c 65536 on a model trained on 32768 keeps the KV cache, caps slots."""
    s = make_server("-c", "65536", "-np", "1")
    props = s.client.get("/props").json()
    n_train = props["n_ctx_train"]
    assert props["n_ctx"] == 65536 and props["n_ctx_slot"] == n_train < 65536
    assert s.client.get("/slots").json()[0]["n_ctx"] == n_train
    assert "exceeds the training context" in s.log_path.read_text()


def test_several_addresses_aliases_and_tags(make_server):
    """``--host a,b`` listens on each address (as llama-server); ``--alias`` names are a set
    whose first (sorted) one is the model id; ``--tags`` are listed."""
    import httpx

    s = make_server("--host", "127.0.0.1,127.0.0.2", "--alias", "tiny,code,fim", "--tags", "b,a")
    for host in ("127.0.0.1", "127.0.0.2"):
        r = httpx.get(f"http://{host}:{s.port}/v1/models", timeout=30)
        assert r.status_code == 200
        model = r.json()["data"][0]
        assert (model["id"], model["aliases"], model["tags"]) == (
            "code",
            ["code", "fim", "tiny"],
            ["a", "b"],
        )


def test_a_model_that_cannot_load_ends_the_process(tmp_path):
    """As llama-server: a model that fails to load is an exit (status 1), not a server that
    answers 503 forever."""
    from tests.e2e.conftest import free_port

    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    proc = subprocess.run(
        [sys.executable, "-m", "server", "-m", str(bad), "--port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "failed to load the model" in proc.stderr
