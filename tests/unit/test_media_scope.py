"""server/media/media_scope.py (issue 56): a request's image pixels bounded from the headers
before anything decodes them (per request: 413; per API key in flight: 429), decoding moved
off the text lanes onto the media lane, image caches kept per tenant, and audio never
advertised while audio inputs are refused."""

from __future__ import annotations

import asyncio
import base64
import threading
from types import SimpleNamespace

import pytest

from server.media import media_scope
from server.media.image_inputs import (
    MAX_JPEG_SCANS,
    MediaInput,
    MediaLimits,
    RecentlyDecoded,
    check_image,
    decode_base64,
)
from server.media.media_scope import InFlight, MediaScope, NeedsMediaLane, run_in
from server.protocols import native, openai
from server.schemas.errors import APIError
from server.service import pools
from server.service.state import media_scope_of
from server.settings.config import Settings
from tests.fake_backend import FakeBackend
from tests.mmproj_gen import pixels, png, scans_jpeg, tiny_gif
from tests.unit.helpers import route_client
from tests.unit.test_render_pools import FakeRequest

W, H = 8192, 4096  # exactly --image-max-pixels' default (32 Mi)


def huge_gif() -> bytes:
    """35 bytes that declare an 8192x4096 logical screen (~0.5-1.25 s for stb_image)."""
    return tiny_gif(W, H)


def gif_url() -> str:
    return "data:image/gif;base64," + base64.b64encode(huge_gif()).decode()


def test_a_requests_pixels_are_bounded_before_any_decode():
    """16 of them pass every per-image check (~20 s of decoding); a request's scope
    refuses the fifth from its header."""
    assert len(huge_gif()) == 35
    media = MediaInput("<m>", MediaLimits(max_count=16))

    def add_all() -> None:
        for j in range(16):
            media.add_url(gif_url(), f"messages.0.content.{j}")

    add_all()
    assert len(media.images) == 16
    scope = MediaScope(request_pixels=4 * W * H)
    media = MediaInput("<m>", MediaLimits(max_count=16))
    with pytest.raises(APIError) as e:
        run_in(scope, add_all)
    assert e.value.status == 413 and e.value.type == "request_too_large"
    assert "messages.0.content.4" in e.value.message  # the fifth is refused
    assert "--image-max-request-pixels" in e.value.message
    assert len(media.images) == 4 and scope.charged == 4 * W * H


def test_a_jpeg_of_many_scans_is_refused_from_its_markers():
    """Each scan is a pass of stb_image over the whole frame: 10,000 near-empty ones over
    4096x4096 took 3.3 s from 110 KB (a 10 MiB file: minutes). Encoders write ~10."""
    limits = MediaLimits()
    usual = scans_jpeg(4096, 4096, 10)
    assert check_image(usual, limits, "x") == usual
    at_limit = scans_jpeg(4096, 4096, MAX_JPEG_SCANS - 1)  # and its DC scan
    assert check_image(at_limit, limits, "x") == at_limit
    with pytest.raises(APIError) as e:
        check_image(scans_jpeg(4096, 4096, 10_000), limits, "messages.0.content.1")
    assert e.value.status == 400
    assert e.value.message == (
        f"messages.0.content.1: the JPEG has 10001 scans, more than {MAX_JPEG_SCANS}"
    )


def test_the_flags_defaults_follow_the_per_image_limit():
    s = Settings(image_max_pixels=1000)
    scope = media_scope_of(SimpleNamespace(settings=s), None, "key:x")  # type: ignore[arg-type]
    assert (scope.request_pixels, scope.key_pixels, scope.tenant) == (4000, 8000, "key:x")
    s = Settings(image_max_request_pixels=10, image_max_key_pixels=15)
    scope = media_scope_of(SimpleNamespace(settings=s), None, "")  # type: ignore[arg-type]
    assert (scope.request_pixels, scope.key_pixels) == (10, 15)


def test_a_keys_pixels_in_flight_are_bounded_and_given_back():
    flight = InFlight()
    a = MediaScope(key="k", key_pixels=100, in_flight=flight, on_media_lane=True)
    b = MediaScope(key="k", key_pixels=100, in_flight=flight, on_media_lane=True)
    other = MediaScope(key="j", key_pixels=100, in_flight=flight, on_media_lane=True)
    a.charge(60, "x")
    a.decoding()
    b.charge(60, "x")
    with pytest.raises(APIError) as e:
        b.decoding()
    assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
    assert b.held == 0 and flight.held("k") == 60
    other.charge(60, "x")
    other.decoding()  # another key's budget
    a.release()
    a.release()  # idempotent
    b.decoding()
    assert flight.held("k") == 60 and flight.held("j") == 60


def test_decoding_on_a_text_lane_moves_the_work_to_the_media_lane():
    """The work charges on the light lane, then asks for the media lane: it runs again
    there, holding its pixels while it waits and runs, and gives them back at its end."""
    flight = InFlight()
    scope = MediaScope(key="k", in_flight=flight)
    seen: list[tuple[str, int]] = []

    def work() -> str:
        scope_now = media_scope.current()
        assert scope_now is scope
        scope.charge(W * H, "img")
        seen.append((threading.current_thread().name, flight.held("k")))
        scope.decoding()
        return threading.current_thread().name

    async def main() -> str:
        return await pools.prepare_in(scope, FakeRequest(), 10, work)

    assert asyncio.run(main()).startswith("prep-media")
    assert seen[0][0].startswith("prep-light") and seen[0][1] == 0
    assert seen[1][0].startswith("prep-media") and seen[1][1] == W * H  # held in the queue
    assert flight.held("k") == 0 and scope.held == 0


def test_the_move_is_refused_past_the_keys_budget():
    flight = InFlight()
    flight.take("k", 90, 100)  # another request of the key holds most of it
    scope = MediaScope(key="k", key_pixels=100, in_flight=flight)
    ran: list[str] = []

    def work() -> None:
        ran.append(threading.current_thread().name)
        scope.charge(20, "img")
        scope.decoding()

    async def main() -> None:
        await pools.prepare_in(scope, FakeRequest(), 10, work)

    with pytest.raises(APIError) as e:
        asyncio.run(main())
    assert e.value.status == 429 and "--image-max-key-pixels" in e.value.message
    assert len(ran) == 1 and flight.held("k") == 90  # never ran on the media lane


def test_without_a_scope_nothing_moves():
    async def main() -> str:
        return await pools.prepare(FakeRequest(), 10, lambda: threading.current_thread().name)

    assert asyncio.run(main()).startswith("prep-light")
    with pytest.raises(NeedsMediaLane):
        MediaScope().decoding()


def test_recently_decoded_texts_are_kept_per_tenant():
    recent = RecentlyDecoded()
    text = base64.b64encode(png(pixels(3, 200))).decode()
    assert len(text) >= RecentlyDecoded.MIN_TEXT
    assert recent.key(text, b"key:a") != recent.key(text, b"key:b") != recent.key(text)
    limits = MediaLimits()
    run_in(MediaScope(tenant="key:a"), decode_base64, text, limits, "x", recent)
    assert recent.get(recent.key(text, b"key:a")) is not None
    assert recent.get(recent.key(text, b"key:b")) is None  # b's request will decode it


class AudioProjector:
    """A projector that reads images and audio (what libmtmd says of e.g. Qwen2.5-Omni's)."""

    marker = "<__media__>"
    key = b"k" * 16
    vision = True
    audio = True


class PropsBackend(FakeBackend):
    """The fake model with the facts /props reports."""

    n_ctx_train = 2048
    n_swa = 0
    kv_unified = True
    chat_template = ""
    bos_text = ""
    eos_text = ""
    model_size = 0
    n_params = 0


def test_props_and_models_never_advertise_audio():
    routers = [native.router, openai.router]
    with route_client(PropsBackend(), Settings(), routers, projector=AudioProjector()) as c:
        assert c.get("/props").json()["modalities"] == {"vision": True, "audio": False}
        arch = c.get("/v1/models").json()["data"][0]["architecture"]
        assert arch["input_modalities"] == ["text", "image"]


def test_the_router_never_lists_audio(tmp_path):
    import gguf

    from server.router.mmproj import input_modalities, projector_caps

    w = gguf.GGUFWriter(str(tmp_path / "mmproj.gguf"), "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_audio_encoder", True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert projector_caps(str(tmp_path / "mmproj.gguf")).audio  # the file says it reads audio
    assert input_modalities(str(tmp_path / "mmproj.gguf")) == ["text", "image"]
