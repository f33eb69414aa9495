"""The chat page with images (issue 42) in headless Chromium (Selenium; the patterns of
test_webui_e2e.py): behind ``--api-prefix``, on a server with the generated projector, an
image attached with the file input, by a drop and by a paste is shown as a thumbnail in the
message, sent as an ``image_url`` part, and answered; a server without a projector offers
no image button. Generated text is never asserted: states, the request the page sent and the
server's token accounting are."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from selenium.webdriver.common.by import By

from tests.mmproj_gen import N_IMAGE_TOKENS, pixels, png, write_gemma3_mmproj

from .conftest import ServerProc
from .test_images_e2e import metric
from .test_webui_e2e import Page, driver, final_chunk  # noqa: F401 (the driver fixture)

pytestmark = pytest.mark.e2e

PREFIX = "/llm"

# a File of the PNG (base64 in arguments[0]) dispatched as a drop on the composer, or as a
# paste into the message box (arguments[1])
SYNTHETIC = """
const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
const dt = new DataTransfer();
dt.items.add(new File([bytes], 'pic.png', { type: 'image/png' }));
if (arguments[1] === 'drop') {
  document.getElementById('composer').dispatchEvent(
    new DragEvent('drop', { dataTransfer: dt, bubbles: true, cancelable: true }));
} else {
  document.getElementById('prompt').dispatchEvent(
    new ClipboardEvent('paste', { clipboardData: dt, bubbles: true, cancelable: true }));
}
"""


class PrefixedServer(ServerProc):
    """A server under --api-prefix: its client and readiness probe use the prefix."""

    def wait_ready(self, timeout: float = 120) -> None:
        self.client = httpx.Client(base_url=self.url + PREFIX, timeout=120)
        super().wait_ready(timeout)


class PrefixedPage(Page):
    def open(self, fresh: bool = True) -> Page:
        self.d.get(self.server.url + PREFIX + "/")
        if fresh:
            self.d.execute_script("localStorage.clear()")
            self.d.get(self.server.url + PREFIX + "/")
        self.wait(lambda: self.find("prompt-input").is_displayed())
        return self


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("webui-images")
    mm = write_gemma3_mmproj(d / "mmproj.gguf")
    s = PrefixedServer("--mmproj", str(mm), "--api-prefix", PREFIX, "-np", "1", "-c", "2048", "--metrics")  # fmt: skip
    yield s
    s.stop()


def sent_parts(page: Page) -> list[list[str]]:
    """The content part types of each user message of the last chat request the page sent."""
    body = json.loads(page.captured()[-1]["body"])
    return [
        [p["type"] for p in m["content"]] if isinstance(m["content"], list) else ["text"]
        for m in body["messages"]
        if m["role"] == "user"
    ]


def test_an_image_by_button_drop_and_paste_behind_an_api_prefix(driver, vision_server, tmp_path):  # noqa: F811
    page = PrefixedPage(driver, vision_server).open()
    page.wait(lambda: page.find("attach").is_displayed(), 10, "no image button")
    page.wait(lambda: page.find("model-name").text != "", 10)  # /props under the prefix
    decoded = metric(vision_server, "llamaslot_images_decoded")
    pic = tmp_path / "pic.png"
    pic.write_bytes(png(pixels(41)))
    page.find("attach-file").send_keys(str(pic))  # the button's file picker
    page.wait(lambda: len(page.all("attachment")) == 1, 10, "no thumbnail in the composer")
    page.settings(max_tokens=6, extra={"ignore_eos": True})
    page.send("What is in this picture?")
    answer = page.wait_answer()
    assert answer.get_attribute("data-state") == "done", answer.text
    assert len(page.all("message-image")) == 1 and not page.all("attachment")
    assert sent_parts(page) == [["image_url", "text"]]
    t = final_chunk(page.captured()[-1]["text"])["timings"]
    assert t["cache_n"] + t["prompt_n"] > N_IMAGE_TOKENS and t["predicted_n"] == 6
    assert metric(vision_server, "llamaslot_images_decoded") == decoded + 1
    # a second turn: one image dropped, one pasted (then removed), one pasted
    b64 = base64.b64encode(png(pixels(42))).decode()
    page.d.execute_script(SYNTHETIC, b64, "drop")
    page.d.execute_script(SYNTHETIC, b64, "paste")
    page.wait(lambda: len(page.all("attachment")) == 2, 10, "drop and paste not taken")
    page.all("attachment-remove")[1].click()
    page.wait(lambda: len(page.all("attachment")) == 1, 10)
    page.send("And this one?")
    assert page.wait_answer().get_attribute("data-state") == "done"
    assert sent_parts(page) == [["image_url", "text"], ["image_url", "text"]]
    t2 = final_chunk(page.captured()[-1]["text"])["timings"]
    assert t2["cache_n"] >= t["cache_n"] + t["prompt_n"]  # the first turn, image too, reused
    # kept in this browser: a reload shows both thumbnails; the live view works under the prefix
    page.open(fresh=False)
    page.wait(lambda: len(page.all("message-image")) == 2, 10)
    page.wait(lambda: len(page.all("slot-row")) == 1, 10)
    errors = [e for e in page.d.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors


def test_no_image_button_without_a_projector(driver, server):  # noqa: F811
    page = Page(driver, server).open()
    page.wait(lambda: page.find("model-name").text != "", 10)
    assert not page.find("attach").is_displayed()
    assert page.d.find_element(By.ID, "attachments").get_attribute("hidden") is not None
