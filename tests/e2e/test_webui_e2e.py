"""The chat page at / in a real headless Chromium (Debian's chromium and chromium-driver,
scripts/system-deps.sh), driven with Selenium, against real servers on the default model.

Generated text is never asserted: answers are checked by their state (streaming, done,
stopped) and by token accounting. The cache panel's numbers are compared with the server's
own: the raw event stream of each chat request, captured in the browser by a ``fetch`` hook
this test installs (through DevTools, before the page's own scripts; the page does not know
it) and parsed here, and ``GET /slots``. The screenshot in the README comes from
``test_cache_panel_reports_the_second_turn_as_cached``: ``WEBUI_SCREENSHOT=docs/webui.png``
writes it there."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from tests.e2e.conftest import ServerProc, long_text

pytestmark = pytest.mark.e2e

CHROME_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,900",
]

# Keeps a copy of every chat request's body and raw response body (the bytes the server
# sent) in window.__sse; the page reads its own branch of the stream as usual.
FETCH_HOOK = """
(() => {
  const orig = window.fetch;
  window.__sse = [];
  window.fetch = async (...args) => {
    const r = await orig(...args);
    const url = String((args[0] && args[0].url) || args[0]);
    if (!url.includes('/v1/chat/completions') || !r.body) return r;
    const [mine, theirs] = r.body.tee();
    const sent = args[1] && typeof args[1].body === 'string' ? args[1].body : null;
    const entry = { url, text: '', done: false, body: sent };
    window.__sse.push(entry);
    (async () => {
      const reader = mine.getReader(), dec = new TextDecoder();
      try {
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          entry.text += dec.decode(value, { stream: true });
        }
      } catch (e) { entry.error = String(e); }
      entry.done = true;
    })();
    return new Response(theirs, { status: r.status, statusText: r.statusText, headers: r.headers });
  };
})();
"""


class Page:
    """The page in one browser, with the steps a user takes."""

    def __init__(self, driver: webdriver.Chrome, server: ServerProc) -> None:
        self.d = driver
        self.server = server

    def open(self, fresh: bool = True) -> Page:
        """Load /; ``fresh``: with this origin's storage emptied first."""
        self.d.get(self.server.url + "/")
        if fresh:
            self.d.execute_script("localStorage.clear()")
            self.d.get(self.server.url + "/")
        self.wait(lambda: self.find("prompt-input").is_displayed())
        return self

    def wait(self, cond, timeout: float = 60, what: str = "") -> object:
        return WebDriverWait(self.d, timeout, poll_frequency=0.05).until(
            lambda _: cond(), message=what
        )

    def find(self, testid: str) -> WebElement:
        return self.d.find_element(By.CSS_SELECTOR, f'[data-testid="{testid}"]')

    def all(self, testid: str) -> list[WebElement]:
        return self.d.find_elements(By.CSS_SELECTOR, f'[data-testid="{testid}"]')

    def settings(self, max_tokens: int, extra: dict | None = None) -> None:
        """Set max tokens and the extra request fields through the settings form."""
        self.d.find_element(By.ID, "toggle-settings").click()
        for testid, value in (
            ("max-tokens", str(max_tokens)),
            ("extra-fields", json.dumps(extra or {})),
        ):
            box = self.find(testid)
            box.clear()
            box.send_keys(value)
        self.d.find_element(By.ID, "toggle-settings").click()

    def type_prompt(self, text: str) -> None:
        box = self.find("prompt-input")
        if len(text) > 200:  # a long text: put in at once (typing it key by key is slow)
            self.d.execute_script("arguments[0].value = arguments[1]", box, text)
            box.send_keys(" ")
        else:
            box.send_keys(text)

    def send(self, text: str) -> None:
        n = len(self.all("message-assistant"))
        self.type_prompt(text)
        self.find("send").click()
        self.wait(lambda: len(self.all("message-assistant")) == n + 1, 10, "no answer appeared")

    def last_answer(self) -> WebElement:
        return self.all("message-assistant")[-1]

    def answer_state(self) -> tuple[str, int]:
        """The last answer's state and its text's length, read in one go (while it streams,
        its parts are replaced at every repaint)."""
        return tuple(
            self.d.execute_script(
                "const a = [...document.querySelectorAll('[data-testid=message-assistant]')].pop();"
                "return a ? [a.dataset.state, a.querySelector('.content').textContent.length]"
                " : ['', 0]"
            )
        )

    def wait_answer(self, timeout: float = 90) -> WebElement:
        """The last answer once it no longer streams."""
        self.wait(lambda: self.answer_state()[0] not in ("streaming", ""), timeout)
        return self.last_answer()

    def user_texts(self) -> list[str]:
        return [m.find_element(By.CSS_SELECTOR, ".content").text for m in self.all("message-user")]

    def turns(self) -> list[dict]:
        rows = self.all("cache-turn")
        return [
            {
                k: int(r.get_attribute(f"data-{k}") or -1)
                for k in ("turn", "cache-n", "prompt-n", "slot")
            }
            for r in rows
        ]

    def captured(self) -> list[dict]:
        """The chat requests' raw response bodies the hook kept, finished ones only."""
        self.wait(lambda: all(e["done"] for e in self.d.execute_script("return window.__sse")), 30)
        return self.d.execute_script("return window.__sse")


def sse_objects(text: str) -> list[dict]:
    """The JSON objects of an SSE body (what the server sent), [DONE] left out."""
    out = []
    for block in text.split("\n\n"):
        data = "".join(ln[5:].strip() for ln in block.split("\n") if ln.startswith("data:"))
        if data and data != "[DONE]":
            out.append(json.loads(data))
    return out


def final_chunk(text: str) -> dict:
    """The chunk that ends the (one) choice: its timings and the slot that ran it."""
    (final,) = [o for o in sse_objects(text) if "id_slot" in o]
    return final


@pytest.fixture(scope="module")
def driver() -> Iterator[webdriver.Chrome]:
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not chromedriver:
        pytest.fail("chromium and chromium-driver are missing: run scripts/system-deps.sh")
    profile = tempfile.mkdtemp(prefix="webui-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in [*CHROME_FLAGS, f"--user-data-dir={profile}"]:
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(chromedriver), options=opts)
    d.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": FETCH_HOOK})
    yield d
    d.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(driver, server) -> Page:
    return Page(driver, server).open()


def test_answer_streams_in(page: Page):
    page.settings(max_tokens=40, extra={"ignore_eos": True})
    page.type_prompt("Tell me about the sea.")
    page.find("prompt-input").send_keys(Keys.ENTER)  # the keyboard sends
    page.wait(lambda: len(page.all("message-assistant")) == 1, 10)
    lengths = set()
    while (now := page.answer_state())[0] == "streaming":
        lengths.add(now[1])
        time.sleep(0.05)
    answer = page.last_answer()
    assert answer.get_attribute("data-state") == "done"
    assert answer.find_elements(By.CSS_SELECTOR, '[data-testid="cut-note"]')  # at max_tokens
    assert len({n for n in lengths if n > 0}) >= 2, lengths  # seen growing, not all at once
    assert len(page.all("message-user")) == 1
    (sent,) = page.captured()
    final = final_chunk(sent["text"])
    assert final["timings"]["predicted_n"] == 40
    assert (
        str(final["timings"]["predicted_n"]) in answer.find_element(By.CSS_SELECTOR, ".stats").text
    )
    (turn,) = page.turns()
    assert (turn["cache-n"], turn["prompt-n"]) == (
        final["timings"]["cache_n"],
        final["timings"]["prompt_n"],
    )
    assert turn["slot"] == final["id_slot"]
    # the live view shows the server's slots
    page.wait(lambda: len(page.all("slot-row")) == len(page.server.slots()), 10)
    # nothing the page loaded came from another host, and it logged no error (CSP included)
    hosts = page.d.execute_script(
        "return performance.getEntriesByType('resource').map(e => new URL(e.name).host)"
    )
    assert set(hosts) <= {page.server.url.split("//")[1]}, hosts
    errors = [e for e in page.d.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors


def _decoding(server) -> int:
    """The most tokens a busy slot of ``server`` has decoded for its current run."""
    return max((x["n_decoded"] for x in server.slots() if x["is_processing"]), default=0)


def test_stop_ends_a_long_answer(page: Page):
    page.settings(max_tokens=4000, extra={"ignore_eos": True})
    page.send("Count to a thousand.")
    # under load (two test workers), a base model's first tokens may be slow or blank: wait
    # for the server to have decoded some tokens of it, or for text on the page
    page.wait(lambda: page.answer_state()[1] > 10 or _decoding(page.server) > 10, 120)
    assert page.answer_state()[0] == "streaming"
    assert page.find("stop").is_displayed() and not page.find("send").is_enabled()
    page.find("stop").click()
    page.wait(lambda: page.answer_state()[0] == "stopped", 5, "not stopped")
    assert not page.find("stop").is_displayed() and page.find("send").is_enabled()
    # the server stopped generating too: its slots are idle long before 4000 tokens
    slots = page.server.wait_idle(timeout=10)
    assert all(s["n_decoded"] < 1000 for s in slots), slots


def test_a_reload_resumes_the_answer(page: Page):
    """The page names each answer's stream by its conversation (X-Conversation-Id): a reload
    mid-answer looks the stream up and replays it from its first byte, then follows it live
    to its end, without asking for a new answer."""
    page.settings(max_tokens=300, extra={"ignore_eos": True})
    page.send("Tell me about the sea.")
    page.wait(lambda: page.answer_state()[1] > 10 or _decoding(page.server) > 10, 120)
    page.open(fresh=False)  # the reload
    page.wait_answer(180)
    assert page.answer_state()[0] == "done"
    # the replay reached the final chunk: 300 tokens, cut at the limit
    page.wait(lambda: len(page.all("cut-note")) == 1, 10, "no final chunk replayed")
    assert page.d.execute_script("return window.__sse") == []  # no new chat request
    page.server.wait_idle(timeout=60)


def test_stopped_answers_are_listed_with_what_they_reused(page: Page):
    """Two answers stopped by the user (their final chunks never come): each is a row of
    the panel with the prompt's figures of the last chunk the page got (every chunk carries
    the run's timings so far); the second reused the first turn's prompt."""
    page.settings(max_tokens=4000, extra={"ignore_eos": True})
    for text in ("Count to a thousand.", "Go on counting."):
        page.send(text)
        page.wait(lambda: page.answer_state()[1] > 10, 60)
        page.find("stop").click()
        page.wait(lambda: page.answer_state()[0] == "stopped", 5, "not stopped")
    page.wait(lambda: len(page.all("cache-turn")) == 2, 5, "stopped answers not listed")
    rows = page.all("cache-turn")
    assert [r.get_attribute("data-state") for r in rows] == ["stopped", "stopped"]
    assert all(r.find_elements(By.CSS_SELECTOR, '[data-testid="turn-stopped"]') for r in rows)
    turns = page.turns()
    for turn, sent in zip(turns, page.captured(), strict=True):
        body = json.loads(sent["body"])
        assert body["timings_per_token"] is True and body["return_progress"] is True
        timed = [o["timings"] for o in sse_objects(sent["text"]) if "timings" in o]
        assert timed, "no chunk with timings before the stop"
        assert (turn["cache-n"], turn["prompt-n"]) == (timed[-1]["cache_n"], timed[-1]["prompt_n"])
    first, second = turns
    assert second["cache-n"] >= first["cache-n"] + first["prompt-n"], turns
    assert "No answers yet" not in page.d.find_element(By.ID, "turns-body").text


def test_base_model_notice(page: Page):
    """The default server's Gemma 3 270M is a base model: no chat template of its own (the
    server formats chats with its built-in gemma template), and the page says so."""
    props = page.server.client.get("/props").json()
    assert props["chat_template_fallback"] is True and props["chat_template_name"] == "gemma"
    notice = page.find("template-notice")
    page.wait(notice.is_displayed, 10, "no notice for a base model")
    assert "no chat template of its own" in notice.text and "base model" in notice.text


def test_first_chat_on_serve_sh_model(driver, make_server):
    """./serve.sh's model (SmolLM2-135M-Instruct) has its own template: no notice; a first
    chat with the page's defaults (greedy here: temperature 0 in the settings) ends by
    itself well before the page's default max_tokens."""
    from tests.e2e.conftest import serve_sh_args

    s = make_server(*serve_sh_args("-np", "1", "-c", "4096"))
    page = Page(driver, s).open()
    page.wait(lambda: page.find("model-name").text.startswith("SmolLM2"), 10)
    assert not page.find("template-notice").is_displayed()
    page.d.find_element(By.ID, "toggle-settings").click()
    page.d.find_element(By.ID, "set-temperature").send_keys("0")
    page.d.find_element(By.ID, "toggle-settings").click()
    page.send("Hello there, who are you?")
    assert page.wait_answer(120).get_attribute("data-state") == "done"
    (sent,) = page.captured()
    body = json.loads(sent["body"])
    assert body["max_tokens"] == 1024 and body["temperature"] == 0
    final = final_chunk(sent["text"])
    assert final["choices"][0]["finish_reason"] == "stop"
    assert final["timings"]["predicted_n"] < 1024
    assert page.last_answer().find_elements(By.CSS_SELECTOR, '[data-testid="cut-note"]') == []
    (turn,) = page.turns()
    assert turn["prompt-n"] == final["timings"]["prompt_n"]


def test_regenerate_reuses_the_prompt(page: Page):
    page.settings(max_tokens=12, extra={"ignore_eos": True})
    page.send("Name three colours.")
    page.wait_answer()
    page.last_answer().find_element(By.CSS_SELECTOR, '[data-testid="regenerate"]').click()
    page.wait(lambda: page.answer_state()[0] == "streaming", 10)
    assert page.wait_answer().get_attribute("data-state") == "done"
    assert len(page.all("message-user")) == 1 and len(page.all("message-assistant")) == 1
    first, second = (final_chunk(c["text"])["timings"] for c in page.captured())
    n_prompt = first["cache_n"] + first["prompt_n"]
    # the same prompt again: all of it from the cache but the last token (re-evaluated for
    # its logits)
    assert second["cache_n"] + second["prompt_n"] == n_prompt
    assert second["prompt_n"] == 1, second
    (turn,) = page.turns()
    assert (turn["cache-n"], turn["prompt-n"]) == (second["cache_n"], second["prompt_n"])


def test_edit_and_reload_find_the_conversation(page: Page):
    page.settings(max_tokens=8, extra={"ignore_eos": True})
    page.send("What is a lighthouse?")
    page.wait_answer()
    # edit the question and send it again: the answer is replaced
    page.find("message-user").find_element(By.CSS_SELECTOR, '[data-testid="edit"]').click()
    box = page.find("edit-input")
    box.clear()
    box.send_keys("What is a harbour?")
    page.find("edit-send").click()
    page.wait(lambda: page.answer_state()[0] == "streaming", 10)
    page.wait_answer()
    assert page.user_texts() == ["What is a harbour?"]
    assert len(page.all("message-assistant")) == 1
    # reload: the conversation is listed and shown again
    page.open(fresh=False)
    titles = [li.text for li in page.all("conversation")]
    assert any("What is a lighthouse?" in t for t in titles), titles
    assert page.user_texts() == ["What is a harbour?"]
    assert page.last_answer().get_attribute("data-state") == "done"
    page.find("new-chat").click()
    assert page.all("message-user") == []
    (old,) = [li for li in page.all("conversation") if "lighthouse" in li.text]
    old.find_element(By.CSS_SELECTOR, ".title").click()
    page.wait(lambda: page.user_texts() == ["What is a harbour?"], 5)


def test_cache_panel_reports_the_second_turn_as_cached(page: Page, tmp_path):
    """A conversation well past the model's 512-token sliding window: its second turn comes
    mostly from the cache, and the panel shows exactly the server's numbers."""
    page.settings(max_tokens=8, extra={"ignore_eos": True})
    page.send(long_text(1100, seed=3) + "\n\nSum this up.")
    page.wait_answer()
    page.send("And in one word?")
    page.wait_answer()
    first, second = (final_chunk(c["text"]) for c in page.captured())
    assert first["timings"]["cache_n"] + first["timings"]["prompt_n"] > 1200
    t = second["timings"]
    assert t["cache_n"] > 0.9 * (t["cache_n"] + t["prompt_n"]), t
    turns = page.turns()
    assert [(x["cache-n"], x["prompt-n"], x["slot"]) for x in turns] == [
        (c["timings"]["cache_n"], c["timings"]["prompt_n"], c["id_slot"]) for c in (first, second)
    ]
    row = page.all("cache-turn")[1]
    shown = row.find_element(By.CSS_SELECTOR, '[data-testid="turn-cache-n"]').text
    assert shown.replace(",", "") == str(t["cache_n"])
    # /slots agrees: the slot that ran it reports the same cached count for its last task
    slot = page.server.slots()[second["id_slot"]]
    assert slot["n_prompt_tokens_cache"] == t["cache_n"]
    page.wait(lambda: page.d.find_element(By.ID, "live-state").text.startswith("(live"), 10)
    shot = Path(os.environ.get("WEBUI_SCREENSHOT") or tmp_path / "webui.png")
    page.d.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


XSS_ANSWER = """Here you go:

<img src=x onerror="window.__xss = 'img'">
<script>window.__xss = 'script'</script>
[click me](javascript:window.__xss='link')
<a href="javascript:window.__xss='a'">or me</a>
<svg onload="window.__xss='svg'"></svg>
<iframe src="javascript:window.__xss='iframe'"></iframe>
<form action="javascript:window.__xss='form'"><button>go</button></form>

**bold** and code:

```python
def f():
    return "<script>window.__xss='code'</script>"
```
"""


def test_imported_answer_cannot_run_script(page: Page, tmp_path):
    conv = {
        "id": "00000000000000aa",
        "title": "<img src=x onerror=\"window.__xss='title'\">",
        "messages": [
            {"role": "user", "content": "<img src=x onerror=\"window.__xss='user'\">"},
            {
                "role": "assistant",
                "content": XSS_ANSWER,
                "reasoning": "<script>window.__xss='reasoning'</script>",
                "tool_calls": [
                    {"function": {"name": "<b>f</b>", "arguments": "<img src=x onerror=alert(1)>"}}
                ],
                "state": "done",
            },
        ],
    }
    f = tmp_path / "conversations.json"
    f.write_text(json.dumps({"format": "llama-slot-server.conversations", "conversations": [conv]}))
    page.find("import-file").send_keys(str(f))
    page.wait(lambda: len(page.all("message-assistant")) == 1, 10)
    answer = page.last_answer()
    content = answer.find_element(By.CSS_SELECTOR, ".content")
    # the markdown was rendered (and highlighted) ...
    assert content.find_elements(By.TAG_NAME, "strong")
    assert content.find_elements(By.CSS_SELECTOR, "pre code.language-python span")
    # ... and nothing that could run survived
    for tag in ("script", "img", "svg", "iframe", "form", "button"):
        assert content.find_elements(By.TAG_NAME, tag) == [], tag
        assert answer.find_elements(By.CSS_SELECTOR, f".reasoning {tag}, .tool-calls {tag}") == []
    hrefs = [a.get_attribute("href") or "" for a in content.find_elements(By.TAG_NAME, "a")]
    assert not any(h.lower().startswith("javascript:") for h in hrefs), hrefs
    for a in content.find_elements(By.TAG_NAME, "a"):
        a.click()
    # the tool call is listed, its name and arguments as text
    (call,) = answer.find_elements(By.CSS_SELECTOR, '[data-testid="tool-call"]')
    assert "<b>f</b>" in call.text and "<img src=x onerror=alert(1)>" in call.text
    reasoning = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert reasoning.get_attribute("open") is None  # folded
    reasoning.click()  # unfold it: shown as text
    assert "<script>" in reasoning.text
    assert "onerror" in page.user_texts()[0]
    # shown again from storage (a reload renders it anew)
    page.open(fresh=False)
    page.wait(lambda: len(page.all("message-assistant")) == 1, 10)
    time.sleep(0.5)  # time for an onerror or a queued script to fire, if any could
    assert page.d.execute_script("return window.__xss") is None
    assert page.last_answer().find_elements(By.CSS_SELECTOR, "img, script, iframe") == []
    _close_extra_tabs(page)


def _close_extra_tabs(page: Page) -> None:
    """Links open in a new tab (target=_blank); close any a click opened, checking that none
    is a javascript: page."""
    main = page.d.current_window_handle
    for h in page.d.window_handles:
        if h != main:
            page.d.switch_to.window(h)
            assert not page.d.current_url.startswith("javascript:")
            page.d.close()
    page.d.switch_to.window(main)


def test_phone_sized_screen_and_keyboard(driver, page: Page):
    """One column on a phone: the list and the cache panel open from the header; the first
    Tab stop is the skip link to the message box."""
    driver.set_window_size(390, 844)
    try:
        page.open()
        assert page.find("prompt-input").is_displayed() and page.find("send").is_displayed()
        assert not page.find("conversation-list").is_displayed()
        assert not page.find("cache-panel").is_displayed()
        toggle = driver.find_element(By.ID, "toggle-sidebar")
        toggle.click()
        assert page.find("conversation-list").is_displayed()
        assert toggle.get_attribute("aria-expanded") == "true"
        toggle.click()
        driver.find_element(By.ID, "toggle-panel").click()
        assert page.find("cache-panel").is_displayed()
        driver.find_element(By.ID, "toggle-panel").click()
        # keyboard: the message box has the focus, Tab goes on to Send; the first stop in
        # the page is the skip link, which leads back to the message box
        page.find("prompt-input").click()
        page.find("prompt-input").send_keys(Keys.TAB)
        assert driver.switch_to.active_element.get_attribute("data-testid") == "send"
        first = driver.execute_script(
            "return [...document.querySelectorAll('a[href], button, input, textarea, select')]"
            ".find(e => e.tabIndex >= 0 && e.offsetParent !== null).className"
        )
        assert first == "skip"
        driver.execute_script("document.querySelector('a.skip').focus()")
        driver.switch_to.active_element.send_keys(Keys.ENTER)
        assert driver.switch_to.active_element.get_attribute("data-testid") == "prompt-input"
    finally:
        driver.set_window_size(1400, 900)


def test_page_behind_an_api_key(driver, make_server):
    s = make_server("--api-key", "k-webui", "-np", "1", "-c", "2048")
    page = Page(driver, s).open()
    form = page.find("auth")
    page.wait(form.is_displayed, 10, "no API key field")
    key = page.find("api-key")
    key.send_keys("wrong", Keys.ENTER)
    page.wait(form.is_displayed, 10, "a wrong key was taken")
    page.find("api-key").send_keys("k-webui", Keys.ENTER)
    page.wait(lambda: not form.is_displayed(), 5)
    page.wait(lambda: page.find("model-name").text != "", 10)
    page.settings(max_tokens=6, extra={"ignore_eos": True})
    page.send("Hello")
    assert page.wait_answer().get_attribute("data-state") == "done"
    assert final_chunk(page.captured()[0]["text"])["timings"]["predicted_n"] == 6
    # kept in the browser: a reload needs no key again
    page.open(fresh=False)
    page.wait(lambda: page.find("model-name").text != "", 10)
    assert not page.find("auth").is_displayed()
    page.wait(lambda: len(page.all("slot-row")) == 1, 10)  # /slots with the key


def test_router_mode_picker_switches_models(driver, tmp_path):
    """Router mode: the picker lists the router's models with their status; each answer
    comes from the model picked (the router starts it on first use, so /models says which
    instance answered)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import Select

    from tests.e2e.conftest import gemma_path, smollm2_path

    models = tmp_path / "models"
    models.mkdir()
    (models / "gemma.gguf").symlink_to(gemma_path())
    (models / "smollm2.gguf").symlink_to(smollm2_path())
    r = ServerProc("--models-dir", str(models), "-c", "2048", "-np", "1")
    try:
        page = Page(driver, r).open()

        def options() -> dict[str, str]:  # read at once: the live view relabels them
            return dict(
                page.d.execute_script(
                    "return [...document.querySelector('[data-testid=model-picker]').options]"
                    ".map(o => [o.value, o.dataset.status])"
                )
            )

        def pick(name: str) -> None:  # as a user does; the list may be rebuilt meanwhile
            for _ in range(10):
                try:
                    Select(page.find("model-picker")).select_by_value(name)
                    return
                except StaleElementReferenceException:
                    time.sleep(0.1)
            raise AssertionError(f"could not pick {name}")

        page.wait(lambda: options() == {"gemma": "unloaded", "smollm2": "unloaded"}, 30)

        def status() -> dict[str, str]:
            return {m["id"]: m["status"]["value"] for m in r.client.get("/models").json()["data"]}

        page.settings(max_tokens=8, extra={"ignore_eos": True})
        pick("smollm2")
        page.send("Hello, small model")
        assert page.wait_answer(180).get_attribute("data-state") == "done"
        assert status() == {"gemma": "unloaded", "smollm2": "loaded"}  # it answered
        page.wait(lambda: options()["smollm2"] == "loaded", 30, "picker status")
        notice = page.find("template-notice")
        assert not notice.is_displayed()  # SmolLM2 has a chat template of its own
        pick("gemma")
        page.send("Hello, gemma")
        assert page.wait_answer(180).get_attribute("data-state") == "done"
        assert status() == {"gemma": "loaded", "smollm2": "loaded"}
        page.wait(lambda: options()["gemma"] == "loaded", 30, "picker status")
        # the picked model's /props, read once it runs: Gemma 3 270M is a base model
        page.wait(notice.is_displayed, 10, "no notice for the base model")
        pick("smollm2")
        page.wait(lambda: not notice.is_displayed(), 10, "the notice stayed")
        # each request named its model, and the panel's live view reads that model's slots
        sent = [json.loads(e["body"]) for e in page.captured()]
        assert [b["model"] for b in sent] == ["smollm2", "gemma"]
        page.wait(lambda: len(page.all("slot-row")) == 1, 10)
    finally:
        r.stop()
