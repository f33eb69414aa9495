"""The front end's protocols (server.engine.model_api): the real backend has every member
the HTTP side reads (``ModelBackend``, its ``Tokenizer``; the draft's ``DraftModel``), and
``ServerState`` holds them typed, with a 503 while no model is loaded."""

from __future__ import annotations

import typing

import pytest

from server.engine.model_api import DraftModel, ModelBackend
from server.engine_api import Tokenizer
from server.llama.backend import LlamaBackend
from server.llama.draft import DraftContext
from server.schemas.errors import APIError
from server.service.state import ServerState
from server.settings.config import Settings
from tests.fake_backend import FakeBackend
from tests.unit.test_backend_protocol import _instance_attrs, _problems

IMPLEMENTATIONS = [
    (ModelBackend, LlamaBackend),
    (Tokenizer, LlamaBackend),
    (DraftModel, DraftContext),
]


@pytest.mark.parametrize(("proto", "cls"), IMPLEMENTATIONS, ids=lambda x: x.__name__)
def test_the_real_backend_has_every_member_the_front_end_reads(proto: type, cls: type) -> None:
    assert _problems(proto, cls, _instance_attrs(cls)) == []


def test_the_server_state_holds_the_model_typed() -> None:
    hints = typing.get_type_hints(ServerState)
    assert hints["backend"] == ModelBackend | None
    assert hints["draft"] == DraftModel | None


def test_no_model_is_a_503_not_an_attribute_error() -> None:
    st = ServerState(settings=Settings())
    with pytest.raises(APIError) as e:
        st.require_backend()
    assert e.value.status == 503
    b = FakeBackend()
    st.backend = b  # the fake implements what the tests use
    assert st.require_backend() is b
