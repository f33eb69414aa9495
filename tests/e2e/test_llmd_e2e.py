"""llm-d on the default model, end to end: the model-server protocol's metrics under load,
and the KV-cache events read with pyzmq + msgpack exactly as llm-d's subscriber and vLLM
adapter parse them (three frames; ``[ts, [event...], dp_rank]``; events by position).

The prompts are several sliding windows (512) long, so the slot, RAM-cache and disk paths
run with their checkpoints."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import pytest
import zmq

from server.kv_events.kv_blocks import BlockHasher
from tests import zmtp_peer

from .conftest import ServerProc, free_port, long_text

BS = 16


def metrics(s: ServerProc) -> dict[str, float]:
    out = {}
    for line in s.client.get("/metrics").text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
            out[name] = float(value)
    return out


def wait_for(pred, what: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def complete(s: ServerProc, prompt: str, n: int = 4, slot: int = -1) -> dict:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True}
    body["return_tokens"] = True
    if slot >= 0:
        body["id_slot"] = slot
    r = s.client.post("/completion", json=body)
    r.raise_for_status()
    return r.json()


# ---------------------------------------------------------------- protocol metrics


@pytest.mark.serial  # catches a moment of 2 running and 2 waiting: runs alone
def test_protocol_metrics_under_load_and_kv_use(make_server, tmp_path):
    s = make_server(
        "--metrics", "-np", "2", "-c", "2048", "--slot-save-path", str(tmp_path),
        "--no-cache-idle-slots",
    )  # fmt: skip
    m = metrics(s)
    info = 'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="128"}'
    assert m[info] == 1.0
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0
    # four long generations on two slots: two run, two wait
    seen: list[tuple[float, float, int]] = []
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(complete, s, f"Story {i}: once", 48) for i in range(4)]

        def loaded() -> bool:
            m = metrics(s)
            busy = sum(1 for x in s.slots() if x["is_processing"])
            seen.append((m["vllm:num_requests_running"], m["vllm:num_requests_waiting"], busy))
            return seen[-1][:2] == (2.0, 2.0)

        wait_for(loaded, "2 running and 2 waiting", 30)
        assert seen[-1][2] == 2  # running is the busy slots
        for f in futs:
            f.result()
    m = metrics(s)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    # KV use: the share of the 2048 cells the slots' sequences hold, rising with a long
    # prompt and falling after an erase
    before = m["vllm:kv_cache_usage_perc"]
    held = sum(x["n_tokens"] for x in s.slots())
    assert before == pytest.approx(held / 2048)
    complete(s, long_text(700, seed=3), 4, slot=0)
    held = {x["id"]: x["n_tokens"] for x in s.slots()}
    assert held[0] > 750
    up = metrics(s)["vllm:kv_cache_usage_perc"]
    assert up == pytest.approx(sum(held.values()) / 2048) and up > before + 0.3
    r = s.client.post("/slots/0?action=erase")
    assert r.status_code == 200
    down = metrics(s)["vllm:kv_cache_usage_perc"]
    assert down == pytest.approx(held[1] / 2048) and down < up - 0.3


# ---------------------------------------------------------------- KV events


@dataclass
class Subscriber:
    """llm-d's subscriber, in Python: SUB on the pod's endpoint, topic filter ``kv@``."""

    endpoint: str
    msgs: list[tuple[str, int, float, list]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sock.connect(self.endpoint)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            topic, seq, payload = self.sock.recv_multipart()
            ts, events, _dp_rank = msgpack.unpackb(payload, raw=False)
            self.msgs.append((topic.decode(), int.from_bytes(seq, "big"), ts, events))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.sock.close(0)
        self.ctx.term()

    def events(self) -> list[list]:
        return [e for m in list(self.msgs) for e in m[3]]


class View:
    """What a pod holds per medium, rebuilt from the events as llm-d's index does."""

    def __init__(self, events: list[list]) -> None:
        self.blocks: dict[str, dict[int, tuple[int | None, list[int]]]] = {}
        self.stored: dict[str, set[int]] = {}
        self.removed: dict[str, set[int]] = {}
        for ev in events:
            tag = ev[0]
            if tag == "AllBlocksCleared":
                self.blocks.clear()
            elif tag == "BlockStored":
                hashes, parent, toks, bs, medium = ev[1], ev[2], ev[3], ev[4], ev[6]
                assert bs == BS and len(toks) == BS * len(hashes), ev
                held = self.blocks.setdefault(medium, {})
                for i, h in enumerate(hashes):
                    assert h not in held, ("stored twice", medium, h)
                    held[h] = (parent if i == 0 else hashes[i - 1], toks[i * BS : (i + 1) * BS])
                self.stored.setdefault(medium, set()).update(hashes)
            elif tag == "BlockRemoved":
                held = self.blocks.setdefault(ev[2], {})
                for h in ev[1]:
                    assert held.pop(h, None) is not None, ("removed but not held", ev[2], h)
                self.removed.setdefault(ev[2], set()).update(ev[1])

    def chain(self, medium: str, tokens: list[int]) -> list[int]:
        """The hashes of the held blocks that spell ``tokens`` from the start, block by
        block, each the child of the one before."""
        by_link = {(p, tuple(t)): h for h, (p, t) in self.blocks.get(medium, {}).items()}
        out: list[int] = []
        parent = None
        for i in range(len(tokens) // BS):
            h = by_link.get((parent, tuple(tokens[i * BS : (i + 1) * BS])))
            if h is None:
                break
            out.append(h)
            parent = h
        return out


@pytest.fixture
def sub_endpoint():
    port = free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    yield sub, port
    sub.close()


def test_events_follow_slots_ram_and_disk_then_a_restart_clears(
    make_server, tmp_path, sub_endpoint
):
    sub, port = sub_endpoint
    disk = tmp_path / "disk"
    disk.mkdir()
    # a long conversation's entry is 19.4 MiB (its state and one checkpoint), a short one's
    # 3.3: RAM holds a long one but not it and a short one; the disk a long and a short one
    # but not a long and two short ones
    args = ("-np", "1", "--cache-ram", "21", "--cache-disk", str(disk), "--cache-disk-mib", "24",
            "--slot-save-path", str(tmp_path), "--kv-events-endpoint", f"tcp://127.0.0.1:{port}",
            "-a", "gemma")  # fmt: skip
    s = make_server(*args)
    wait_for(lambda: sub.msgs, "the start-up message")
    topic, seq0, _, events = sub.msgs[0]
    assert topic.startswith("kv@") and topic.endswith("@gemma") and seq0 == 0
    assert events == [["AllBlocksCleared"]]
    # a prompt three windows long: the slot's chain spells it block by block
    a = f"Conversation A. {long_text(1300, seed=1)} What next?"
    out = complete(s, a, 4)
    toks = s.tokenize(a)
    held = toks + out["tokens"][:-1]  # the last sampled token is not in the KV yet
    wait_for(lambda: len(View(sub.events()).chain("GPU", held)) == len(held) // BS, "A's chain")
    view = View(sub.events())
    chain_a = view.chain("GPU", toks)
    assert len(chain_a) == len(toks) // BS >= 90
    assert set(view.blocks["GPU"]) == set(view.chain("GPU", held))  # nothing else held
    assert chain_a == BlockHasher(BS, "gemma").hashes(toks)  # llm-d's request keys
    # B and C (short) push A out of the slot into RAM, then out of RAM onto disk
    for i in range(2):
        complete(s, f"Conversation {'BC'[i]}. {long_text(150, seed=i + 2)}", 4)
    wait_for(lambda: set(chain_a) <= View(sub.events()).removed.get("CPU", set()), "A left RAM")
    wait_for(lambda: set(chain_a) <= set(View(sub.events()).blocks.get("DISK", {})), "A on disk")
    view = View(sub.events())
    assert set(chain_a) <= view.stored["CPU"] and not set(chain_a) & set(view.blocks["CPU"])
    assert not set(chain_a) & set(view.blocks["GPU"])  # the slot lost it first
    # another long one, then a short one: D reaches RAM, B and C the disk, A is evicted there
    complete(s, f"Conversation D. {long_text(1300, seed=5)} What next?", 4)
    complete(s, f"Conversation E. {long_text(150, seed=6)}", 4)
    wait_for(lambda: s.client.get("/cache").json()["disk"]["counters"]["evictions"] >= 1, "evict")
    wait_for(lambda: not set(chain_a) & set(View(sub.events()).blocks.get("DISK", {})), "A gone")
    # erase: the slot's blocks are removed
    slot_chain = set(View(sub.events()).blocks["GPU"])
    assert slot_chain
    assert s.client.post("/slots/0?action=erase").status_code == 200
    wait_for(lambda: not View(sub.events()).blocks.get("GPU"), "the erase's removal")
    assert slot_chain <= View(sub.events()).removed["GPU"]
    # sequence numbers: one more each time, no gap
    seqs = [m[1] for m in sub.msgs]
    assert seqs == list(range(len(seqs)))
    # a restart: the old process says AllBlocksCleared as it unloads, the new one at start
    s.stop()
    n = len(sub.msgs)
    assert sub.msgs[-1][3] == [["AllBlocksCleared"]]
    s2 = ServerProc(*args)
    try:
        wait_for(lambda: len(sub.msgs) > n, "the new process's first message")
        assert sub.msgs[n][1] == 0 and sub.msgs[n][3] == [["AllBlocksCleared"]]

        # the disk tier's files (written by the first process) are announced again
        def fresh() -> View:
            return View([e for m in sub.msgs[n:] for e in m[3]])

        wait_for(lambda: fresh().blocks.get("DISK"), "the disk files", 20)
    finally:
        s2.stop()


# ---------------------------------------------------------------- exposure (issue 40)


def _refused(*args: str) -> str:
    """The start-up error of a server that must not start (stopped if it does)."""
    try:
        s = ServerProc(*args)
    except RuntimeError as e:
        return str(e)
    s.stop()
    raise AssertionError(f"the server started with {args}")


def test_a_bind_beyond_the_loopback_is_refused_at_start():
    port = free_port()
    t0 = time.time()
    err = _refused("--kv-events-endpoint", f"tcp://*:{port}")
    assert "exited (2)" in err and "--kv-events-allow-remote" in err
    err = _refused("--kv-events-endpoint", f"tcp://0.0.0.0:{port}")
    assert "exited (2)" in err and "every interface" in err
    assert time.time() - t0 < 60  # refused before the model loads


def test_a_keyed_tenants_prompt_is_not_published(make_server, sub_endpoint):
    sub, port = sub_endpoint
    key = "tenant-key-1"
    s = make_server("-np", "1", "--api-key", key, "--cache-isolation", "key",
                    "--kv-events-endpoint", f"tcp://127.0.0.1:{port}", "-a", "gemma")  # fmt: skip
    s.client.headers["Authorization"] = f"Bearer {key}"
    wait_for(lambda: sub.msgs, "the start-up message")
    prompt = f"My secret diary. {long_text(200, seed=3)} The end."
    toks = s.tokenize(prompt)
    complete(s, prompt, 4)

    def stored() -> list[list]:
        return [e for e in sub.events() if e[0] == "BlockStored" and e[6] == "GPU"]

    n_blocks = len(toks) // BS
    wait_for(lambda: sum(len(e[1]) for e in stored()) >= n_blocks, "the prompt's blocks")
    for e in stored():  # hashes only: the blocks are there, their tokens are not
        assert len(e[1]) >= 1 and e[3] == [], e[:4]
        assert e[8] and all(x[0].startswith("tenant:") for x in e[8])  # the tenant's extra key


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.mark.serial  # the server's memory, measured: runs alone
def test_oversize_subscriptions_leave_the_server_flat(make_server, sub_endpoint):
    """A raw ZMTP peer's 1 MiB subscriptions (four rounds of 50) once grew the server by
    150 MB for good; each is now refused at its frame's header (ZMQ_MAXMSGSIZE) and the
    real subscriber keeps receiving."""
    sub, port = sub_endpoint
    s = make_server("-np", "1", "--kv-events-endpoint", f"tcp://127.0.0.1:{port}")
    wait_for(lambda: sub.msgs, "the start-up message")
    complete(s, "Warm up the server once.", 2)
    before = _rss_mb(s.proc.pid)
    payload = b"x" * (1 << 20)
    for r in range(4):  # 50 peers at once, while the server publishes
        peers = [zmtp_peer.connect(port) for _ in range(50)]
        for i, peer in enumerate(peers):
            zmtp_peer.send_quietly(peer, zmtp_peer.subscribe(f"{r}-{i}-".encode() + payload))
        complete(s, f"Round {r}. {long_text(40, seed=r)}", 2)
        time.sleep(0.5)
        for peer in peers:
            peer.close()
    time.sleep(2)
    grown = _rss_mb(s.proc.pid) - before
    assert grown < 40, f"the server grew by {grown:.0f} MB"
    n = len(sub.msgs)
    complete(s, f"After the flood. {long_text(40, seed=4)}", 2)
    wait_for(lambda: len(sub.msgs) > n, "events after the flood", 20)
