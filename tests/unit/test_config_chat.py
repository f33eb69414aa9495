"""Flags and environment variables; chat templates in the sandbox."""

from __future__ import annotations

import pytest

from server.settings.config import load_api_keys, parse_settings
from server.templates.chat_template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    TemplateError,
    pick_template,
)


def test_defaults_are_llama_servers():
    s = parse_settings([], env={})
    assert (s.ctx_size, s.parallel, s.batch_size, s.ubatch_size) == (8192, 4, 2048, 512)
    assert (s.kv_unified, s.slot_prompt_similarity, s.n_predict, s.cache_ram) == (
        True,
        0.10,
        -1,
        8192,
    )
    assert (s.host, s.port, s.ctx_checkpoints, s.prefix_share_min) == ("127.0.0.1", 8080, 32, 128)


def test_flags_win_over_environment():
    env = {"LLAMA_ARG_CTX_SIZE": "4096", "LLAMA_ARG_N_PARALLEL": "2", "LLAMA_ARG_KV_UNIFIED": "0"}
    s = parse_settings(["-c", "1024"], env=env)
    assert (s.ctx_size, s.parallel, s.kv_unified) == (1024, 2, False)
    assert parse_settings(["--kv-unified"], env=env).kv_unified is True
    assert parse_settings(["--no-cache-idle-slots", "--no-slots"], env={}).cache_idle_slots is False


def test_bad_values_are_refused(capsys):
    # Like argparse: exit status 2 and a message naming the flag or variable.
    for argv, env, named in (
        ([], {"LLAMA_ARG_KV_UNIFIED": "maybe"}, "LLAMA_ARG_KV_UNIFIED"),
        (["-np", "0"], {}, "--parallel"),
        (["--flash-attn", "sometimes"], {}, "--flash-attn"),
    ):
        with pytest.raises(SystemExit) as e:
            parse_settings(argv, env=env)
        assert e.value.code == 2
        assert named in capsys.readouterr().err


def test_api_keys_from_flag_env_and_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nfile-key\n\n")
    s = parse_settings(["--api-key-file", str(f)], env={"LLAMA_API_KEY": "a, b"})
    assert load_api_keys(s) == ["a", "b", "file-key"]


def test_gemma_template_and_last_user_offset():
    t = ChatTemplate(BUILTIN_TEMPLATES["gemma"], bos_token="<bos>")
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    r = t.render_chat(msgs)
    assert r.prompt == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    assert r.prompt[r.last_user_offset :].startswith("<start_of_turn>user\nBye")


def test_model_template_wins_then_architecture():
    assert (
        pick_template(
            name=None,
            file=None,
            model_template="{{ 'x' }}",
            architecture="gemma3",
            bos_token="",
            eos_token="",
        ).name
        == "model"
    )
    assert (
        pick_template(
            name=None,
            file=None,
            model_template=None,
            architecture="gemma3",
            bos_token="",
            eos_token="",
        ).name
        == "gemma"
    )
    assert (
        pick_template(
            name="chatml",
            file=None,
            model_template="{{ 'x' }}",
            architecture="gemma3",
            bos_token="",
            eos_token="",
        ).name
        == "chatml"
    )
    with pytest.raises(ValueError):
        pick_template(
            name="nope",
            file=None,
            model_template=None,
            architecture="x",
            bos_token="",
            eos_token="",
        )


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('true') }}",
        "{{ messages.__class__.__base__ }}",
    ],
)
def test_sandbox_refuses_python_internals(source):
    with pytest.raises(TemplateError) as e:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert not e.value.client


def test_syntax_error_is_reported_at_load():
    with pytest.raises(TemplateError, match="does not parse"):
        ChatTemplate("{% for %}")
