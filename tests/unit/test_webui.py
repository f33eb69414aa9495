"""The chat page's routes (server/protocols/webui.py) without a model: / and /webui/* serve the
shipped files with a strict CSP, need no API key, and are off with --no-webui. The page in a
browser: tests/e2e/test_webui_e2e.py."""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

from server.cli.main import parse_settings
from server.http.app import create_app
from server.protocols import webui

pytestmark = pytest.mark.unit


def client(*argv: str) -> TestClient:
    return TestClient(create_app(parse_settings(list(argv), env={})))


def test_page_is_shipped_and_served_with_a_strict_policy():
    assert {"index.html", "app.js", "app.css", "favicon.svg"} <= set(webui.load_assets())
    c = client()
    r = c.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert "frame-ancestors 'none'" in csp and r.headers["x-content-type-options"] == "nosniff"
    assert c.get("/index.html").content == r.content
    js = c.get("/webui/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert c.get("/webui/app.css").headers["content-type"].startswith("text/css")
    # revalidated by ETag
    again = c.get("/webui/app.js", headers={"If-None-Match": js.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    assert c.get("/webui/nope.js").status_code == 404
    assert c.get("/webui/index.html").status_code == 404  # one name for the page: /


def test_page_loads_nothing_from_another_host():
    html = (webui.STATIC / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert refs and all(not re.match(r"^([a-z]+:)?//", ref) for ref in refs if ref != "#prompt")
    assert "<script>" not in html and not re.search(r"\son[a-z]+\s*=", html)  # no inline code
    assert all(ref.startswith(("webui/", "#")) for ref in refs)


def test_no_webui_turns_it_off():
    c = client("--no-webui")
    assert c.get("/").status_code == 404
    assert c.get("/webui/app.js").status_code == 404


def test_page_needs_no_key_the_api_does():
    c = client("--api-key", "k1")
    assert c.get("/").status_code == 200
    assert c.get("/webui/app.js").status_code == 200
    assert c.get("/props").status_code == 401
    assert c.get("/webui/nope.js").status_code == 401  # only the shipped names are public
    assert c.get("/props", headers={"Authorization": "Bearer k1"}).status_code != 401
