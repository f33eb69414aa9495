"""KV cache types (-ctk / -ctv) and the model placement flags: their ggml ids, the slot
file's SKVT appendix, the state-type proof, the disk tier's model id, and the
llama_model_params / ModelOptions built from the command line."""

from __future__ import annotations

import ctypes
import struct

import llama_cpp as L
import pytest

from server.http.app import kv_label, model_options
from server.kv.audit import kv_type_problem
from server.llama import params
from server.llama.ggml_types import CACHE_TYPE_IDS, CACHE_TYPES
from server.llama.kv_state import read_caches
from server.settings.config import parse_settings
from server.tiers import slot_file
from server.types import CacheCells, Checkpoint

F16, Q8 = CACHE_TYPE_IDS["f16"], CACHE_TYPE_IDS["q8_0"]


def test_cache_type_ids_are_ggmls():
    assert set(CACHE_TYPE_IDS) == set(CACHE_TYPES)
    for name, tid in CACHE_TYPE_IDS.items():
        if name != "bf16":  # the bindings do not export GGML_TYPE_BF16 (30 in ggml.h)
            assert getattr(L, f"GGML_TYPE_{name.upper()}") == tid, name
    assert params.kv_type_name(Q8) == "q8_0" and params.kv_type_name(99) == "type 99"


def _appendices(kv_types, draft=b"", ckpts=()):
    raw = b"".join(bytes(p) for p in slot_file.appendix_parts(list(ckpts), draft, kv_types))
    return slot_file.parse_appendices(bytearray(raw), 0, 100)


def test_skvt_round_trips_after_the_other_appendices():
    c = Checkpoint(10, 0, 9, bytearray(b"tgt"), b"")
    app = _appendices((Q8, F16), draft=b"draft-state", ckpts=[c])
    assert app.kv_types == (Q8, F16)
    assert app.data_dft == b"draft-state" and len(app.checkpoints) == 1
    assert app.warnings == []
    assert _appendices(None).kv_types is None  # a file of before: nothing recorded


def test_truncated_skvt_is_dropped_with_a_warning():
    raw = struct.pack("<IIi", slot_file.SKVT_MAGIC, 1, Q8)  # the V type is missing
    app = slot_file.parse_appendices(bytearray(raw), 0, 10)
    assert app.kv_types is None and "dropped" in app.warnings[0]


def test_skvt_mismatch_names_both_types():
    app = _appendices((Q8, Q8))
    assert slot_file.kv_types_problem(app, (Q8, Q8)) is None
    assert slot_file.kv_types_problem(app, None) is None
    msg = slot_file.kv_types_problem(app, (F16, F16))
    assert "K q8_0, V q8_0" in msg and "K f16, V f16" in msg


def test_state_types_are_proven_per_cache():
    full = CacheCells("full", [0, 1], [(0,), (0,)], {Q8}, {Q8})
    swa = CacheCells("swa", [0, 1], [(0,), (0,)], {Q8}, {F16})
    assert kv_type_problem([full], (Q8, Q8)) is None
    assert kv_type_problem([full, swa], None) is None
    assert "V cache type is f16" in kv_type_problem([full, swa], (Q8, Q8))
    assert "K cache type is q8_0, this server's is f16" in kv_type_problem([full], (F16, F16))
    assert kv_type_problem([CacheCells("full")], (F16, F16)) is None  # no rows: nothing to load


def test_disk_model_id_names_other_types_only():
    assert kv_label(parse_settings([], env={})) == ""
    assert kv_label(parse_settings(["-ctk", "q8_0", "-ctv", "q8_0"], env={})) == ":kv=q8_0/q8_0"
    draft = parse_settings(["--spec-type", "draft-simple", "-ctkd", "q4_0"], env={})
    assert kv_label(draft) == ":kv=f16/f16/q4_0/f16"


@pytest.mark.parametrize(
    "mode, no_mmap, mlock, want",
    [
        ("auto", None, None, "auto"),
        ("dio", None, False, "dio"),
        ("auto", True, None, "none"),
        ("auto", None, True, "mmap+mlock"),
        ("auto", True, True, "mlock"),
        ("none", False, None, "mmap"),
        ("mlock", True, None, "mlock"),
    ],
)
def test_load_mode(mode, no_mmap, mlock, want):
    assert params.load_mode(mode, no_mmap, mlock) == want


def test_tensor_overrides_in_llama_servers_order():
    got = params.tensor_overrides(["exps=CPU", r"blk\.3\.=CUDA0"], True, 2, 1)
    assert got == (
        ("exps", "CPU"),
        (r"blk\.3\.", "CUDA0"),
        (params.MOE_REGEX, "CPU"),
        (r"blk\.0" + params.MOE_REGEX, "CPU"),
        (r"blk\.1" + params.MOE_REGEX, "CPU"),
        (r"blk\.0" + params.FFN_REGEX, "CPU"),
    )
    assert params.tensor_overrides(None) == ()


def test_model_params_reach_llama_model_params():
    over = (("exps", "CPU"), ("attn", "GPU9"))
    mp = params.model_params(
        20, "row", (3.0, 1.0), 1, "mmap+mlock", over, bufts={"CPU": 4096, "GPU9": 8192}
    )
    p = mp.params
    assert p.n_gpu_layers == 20 and p.split_mode == L.LLAMA_SPLIT_MODE_ROW
    assert p.main_gpu == 1 and p.load_mode == 3
    n = L.llama_max_devices()
    assert [p.tensor_split[i] for i in range(n)] == [3.0, 1.0] + [0.0] * (n - 2)
    arr = ctypes.cast(p.tensor_buft_overrides, ctypes.POINTER(params.BuftOverride))
    assert [(arr[i].pattern, arr[i].buft) for i in range(3)] == [
        (b"exps", 4096),
        (b"attn", 8192),
        (None, None),  # the terminator llama.cpp stops at
    ]
    plain = params.model_params(-1).params
    assert plain.n_gpu_layers == 999 and not plain.tensor_split
    assert not plain.tensor_buft_overrides and plain.load_mode == -1


def test_model_params_refuse_what_llama_server_refuses():
    with pytest.raises(ValueError, match="unknown buffer type 'NPU'.*CPU"):
        params.model_params(-1, overrides=(("x", "NPU"),))  # the real device list
    with pytest.raises(ValueError, match="tensor-split"):
        params.model_params(-1, tensor_split=(1.0,) * (L.llama_max_devices() + 1))
    assert "CPU" in params.buffer_types()


def test_flags_reach_the_model_options():
    argv = ["-ctk", "q8_0", "-ctv", "q4_0", "-sm", "none", "-ts", "3,1", "-mg", "1"]
    argv += ["-ot", "exps=CPU", "-ncmoe", "1", "--no-mmap", "--mlock"]
    o = model_options(parse_settings(argv, env={}), "/m.gguf")
    assert (o.type_k, o.type_v, o.split_mode, o.main_gpu) == ("q8_0", "q4_0", "none", 1)
    assert o.tensor_split == (3.0, 1.0) and o.load_mode == "mlock"
    assert o.tensor_overrides == (("exps", "CPU"), (r"blk\.0" + params.MOE_REGEX, "CPU"))
    d = model_options(parse_settings([], env={}), "/m.gguf")
    assert (d.type_k, d.type_v, d.load_mode, d.tensor_overrides) == ("f16", "f16", "auto", ())
    env = {"LLAMA_ARG_NO_MMAP": "1", "LLAMA_ARG_CACHE_TYPE_V": "q8_0"}
    e = model_options(parse_settings([], env=env), "/m.gguf")
    assert e.load_mode == "none" and e.type_v == "q8_0"


@pytest.mark.parametrize("argv", [["-ncmoe", "-1"], ["-ctkd", "q3"], ["-sm", "diagonal"]])
def test_malformed_values_fail(argv):
    with pytest.raises(SystemExit):
        parse_settings(argv, env={})


def _state(k_type: int, v_type: int, v_trans: bool, n: int = 3, n_layer: int = 2) -> bytes:
    """A one-sequence state of ``n`` cells as llama_kv_cache::state_write lays it out, with
    each layer's K/V type (V transposed as without flash attention, or not)."""
    out = struct.pack("<Ii", 0xAF143CD8, 0) + struct.pack("<II", 1, n)
    out += b"".join(struct.pack("<iIi", p, 1, 0) for p in range(n))
    out += struct.pack("<II", int(v_trans), n_layer)
    for _ in range(n_layer):
        out += struct.pack("<iQ", k_type, 34) + b"k" * 34 * n
    for _ in range(n_layer):
        if v_trans:
            out += struct.pack("<iII", v_type, 2, 8) + b"v" * 2 * 8 * n
        else:
            out += struct.pack("<iQ", v_type, 34) + b"v" * 34 * n
    return out


@pytest.mark.parametrize("v_trans", [False, True])
def test_the_state_reader_notes_every_layers_types(v_trans):
    data = _state(Q8, F16, v_trans) + b"SKVT"
    (c,), end = read_caches(data, ("full",))
    assert data[end:] == b"SKVT" and c.pos == [0, 1, 2]
    assert (c.k_types, c.v_types) == ({Q8}, {F16})
    assert kv_type_problem([c], (Q8, F16)) is None
    assert "V cache type is f16, this server's is q8_0" in kv_type_problem([c], (Q8, Q8))


def test_a_quantized_v_cache_without_flash_attention_is_refused_before_loading():
    from server.llama.backend import LlamaBackend, ModelOptions

    opts = ModelOptions(path=__file__, type_v="q8_0", flash_attn="off")  # never loaded
    with pytest.raises(RuntimeError, match="quantized V cache needs flash attention"):
        LlamaBackend(opts)
