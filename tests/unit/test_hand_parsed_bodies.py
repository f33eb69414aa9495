"""Bodies a route reads by hand (issue 40): ``/predict``, ``POST /lora-adapters`` and the slot
actions parse through ``server.schemas.json_body``, so a deeply nested body is a 400, never a
500 ``RecursionError``, and the server keeps answering. The engine runs on the fake backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from server.protocols import lora_adapters, native, slots, vertex
from server.service.adapters import Adapter, AdapterRegistry
from server.settings.config import GcpCompat, Settings
from tests.fake_backend import FakeBackend
from tests.unit.helpers import route_client

# deeper than Python's json decoder can recurse: RecursionError when parsed unguarded
DEEP = b"[" * 200_000 + b"]" * 200_000
DEEP_OBJ = b'{"instances": ' + DEEP + b"}"


@pytest.fixture
def client(tmp_path) -> Iterator[TestClient]:
    registry = AdapterRegistry([Adapter(0, "a.gguf", "0" * 32, 1.0, 1.0)])
    settings = Settings(slot_save_path=str(tmp_path))
    routers = [lora_adapters.router, slots.router, native.router]
    with route_client(FakeBackend(), settings, routers, adapters=registry) as c:
        vertex.install(c.app, GcpCompat())
        yield c


def _post(c: TestClient, path: str, body: bytes) -> tuple[int, str]:
    r = c.post(path, content=body, headers={"content-type": "application/json"})
    return r.status_code, r.json()["error"]["message"] if r.status_code >= 400 else ""


@pytest.mark.parametrize("body", [DEEP, DEEP_OBJ])
def test_deep_bodies_are_400s_on_every_hand_parsed_route(client, body):
    for path in ("/lora-adapters", "/slots/0?action=save", "/predict"):
        status, msg = _post(client, path, body)
        assert status == 400, (path, status, msg)
        assert "nests deeper" in msg, (path, msg)
    # the server still answers, and a well-formed body still works
    assert client.post("/lora-adapters", json=[{"id": 0, "scale": 0.5}]).json() == {"success": True}
    r = client.post("/completion", json={"prompt": [1, 2, 3], "n_predict": 2})
    assert r.status_code == 200


def test_malformed_bodies_stay_400s(client):
    assert _post(client, "/lora-adapters", b"{nope")[0] == 400
    assert _post(client, "/slots/0?action=save", b"[1")[0] == 400
    assert _post(client, "/predict", b"")[0] == 400
    assert _post(client, "/predict", b'{"instances": 3}')[0] == 400
