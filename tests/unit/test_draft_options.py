"""The draft model's own flags (-otd, -cmoed, -ncmoed, -td, -tbd) reach its options, and a
bad one fails before the draft model is loaded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.http.app import draft_options
from server.llama.draft import DraftContext, DraftOptions
from server.llama.params import MOE_REGEX
from server.settings.config import ignored_flags, parse_settings

pytestmark = pytest.mark.unit


def test_draft_flags_reach_the_draft_options():
    argv = ["--spec-type", "draft-simple", "-md", "d.gguf", "-otd", "blk\\.0\\.=CPU"]
    argv += ["-cmoed", "-ncmoed", "2", "-td", "3", "-tbd", "5", "-ctkd", "q8_0"]
    s = parse_settings(argv, env={})
    o = draft_options(s)
    assert (o.path, o.n_threads, o.n_threads_batch, o.type_k) == ("d.gguf", 3, 5, "q8_0")
    assert o.tensor_overrides == (
        ("blk\\.0\\.", "CPU"),
        (MOE_REGEX, "CPU"),
        (rf"blk\.0{MOE_REGEX}", "CPU"),
        (rf"blk\.1{MOE_REGEX}", "CPU"),
    )
    assert not {"-otd", "-cmoed", "-ncmoed", "-td", "-tbd"} & set(ignored_flags(s))
    assert draft_options(parse_settings([], env={})) == DraftOptions()


def test_an_unknown_buffer_type_fails_before_the_draft_model_loads(tmp_path):
    target = SimpleNamespace(opts=SimpleNamespace(path=str(tmp_path / "target.gguf")))
    o = DraftOptions(path=str(tmp_path / "draft.gguf"), tensor_overrides=(("x", "NOPE0"),))
    with pytest.raises(ValueError, match="unknown buffer type 'NOPE0'"):
        DraftContext(target, o)  # the draft file does not even exist: nothing was loaded
