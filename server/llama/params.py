"""llama.cpp parameters that llama-server builds from its command line: the KV cache data
types (``-ctk``/``-ctv``), and the model's placement and loading (``llama_model_params``:
``-sm``, ``-ts``, ``-mg``, ``-lm``/``--no-mmap``/``--mlock``, and the tensor buffer type
overrides of ``-ot``, ``--cpu-moe``, ``--n-cpu-moe``, ``--n-cpu-ffn``).

The overrides name ggml buffer types ("CPU", "CUDA0", ...): the bindings do not wrap ggml's
device registry, so the names are looked up through ggml's own shared libraries (those that
llama-cpp-python ships and libllama has already loaded), as llama-server's
``parse_tensor_buffer_overrides`` does.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Protocol

import llama_cpp as L

from .ggml_types import CACHE_TYPE_IDS, QUANTIZED, cache_type_name

# ggml type ids of the KV cache types llama-server accepts (ggml.h's enum ggml_type)
KV_TYPES: dict[str, int] = dict(CACHE_TYPE_IDS)
kv_type_name = cache_type_name

SPLIT_MODES = {
    "none": L.LLAMA_SPLIT_MODE_NONE,
    "layer": L.LLAMA_SPLIT_MODE_LAYER,
    "row": L.LLAMA_SPLIT_MODE_ROW,
    "tensor": L.LLAMA_SPLIT_MODE_TENSOR,
}
# llama.h's enum llama_load_mode
LOAD_MODES = {"auto": -1, "none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3, "dio": 4}

# common.h's LLM_FFN_EXPS_REGEX / LLM_FFN_DENSE_REGEX
MOE_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
FFN_REGEX = r"\.ffn_(up|down|gate)\."


def load_mode(mode: str, no_mmap: bool | None, mlock: bool | None) -> str:
    """The load mode from ``-lm`` and llama-server's earlier ``--no-mmap``/``--mmap`` and
    ``--mlock`` flags, which win where given (``-lm auto`` maps the model)."""
    if no_mmap is None and not mlock:
        return mode
    mapped = (not no_mmap) if no_mmap is not None else mode in ("auto", "mmap", "mmap+mlock")
    locked = bool(mlock) or mode in ("mlock", "mmap+mlock")
    if mapped:
        return "mmap+mlock" if locked else "mmap"
    return "mlock" if locked else "none"


def tensor_overrides(
    items: list[str] | None, cpu_moe: bool = False, n_cpu_moe: int = 0, n_cpu_ffn: int = 0
) -> tuple[tuple[str, str], ...]:
    """(tensor name pattern, buffer type name) pairs, in llama-server's order: ``-ot``'s
    items, then the CPU overrides of ``--cpu-moe``, ``--n-cpu-moe N``, ``--n-cpu-ffn N``."""
    out = [tuple(x.split("=", 1)) for x in items or []]
    if cpu_moe:
        out.append((MOE_REGEX, "CPU"))
    out += [(rf"blk\.{i}{MOE_REGEX}", "CPU") for i in range(n_cpu_moe)]
    out += [(rf"blk\.{i}{FFN_REGEX}", "CPU") for i in range(n_cpu_ffn)]
    return tuple((p, b) for p, b in out)


class BuftOverride(ctypes.Structure):
    """llama.h's llama_model_tensor_buft_override."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _ggml(name: str) -> ctypes.CDLL:
    return ctypes.CDLL(os.path.join(os.path.dirname(L.__file__), "lib", name))


def buffer_types() -> dict[str, int]:
    """ggml's buffer types by name: each device's default one (as llama-server lists them)."""
    reg, base = _ggml("libggml.so"), _ggml("libggml-base.so")
    reg.ggml_backend_dev_count.restype = ctypes.c_size_t
    reg.ggml_backend_dev_get.restype = ctypes.c_void_p
    reg.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    base.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    base.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    base.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    out: dict[str, int] = {}
    for i in range(reg.ggml_backend_dev_count()):
        buft = base.ggml_backend_dev_buffer_type(reg.ggml_backend_dev_get(i))
        if buft:
            out[base.ggml_backend_buft_name(buft).decode()] = buft
    out["CPU"] = base.ggml_backend_cpu_buffer_type()  # what --cpu-moe uses
    return out


@dataclass
class ModelParams:
    """llama_model_params and the ctypes objects they point to (kept alive with the model)."""

    params: L.llama_model_params
    keep: list[object] = field(default_factory=list)  # arrays and bytes, only kept alive


class LoadOptions(Protocol):
    """What ``load_model`` reads of the backend's ModelOptions (server.llama.backend, which
    imports this module)."""

    @property
    def path(self) -> str: ...
    @property
    def type_v(self) -> str: ...
    @property
    def flash_attn(self) -> str: ...
    @property
    def n_gpu_layers(self) -> int: ...
    @property
    def split_mode(self) -> str: ...
    @property
    def tensor_split(self) -> tuple[float, ...]: ...
    @property
    def main_gpu(self) -> int: ...
    @property
    def load_mode(self) -> str: ...
    @property
    def tensor_overrides(self) -> tuple[tuple[str, str], ...]: ...


def load_model(opts: LoadOptions) -> tuple[L.llama_model_p, ModelParams]:
    """The model at ``opts.path`` (a backend ModelOptions), loaded with llama-server's model
    params, and those params (their arrays must live as long as the model). RuntimeError
    where llama-server fails to start: a quantized V cache without flash attention (llama.cpp
    refuses the context; said here before loading), a model that does not load."""
    if opts.type_v in QUANTIZED and opts.flash_attn == "off":
        raise RuntimeError(f"-ctv {opts.type_v}: a quantized V cache needs flash attention")
    mp = model_params(
        opts.n_gpu_layers,
        opts.split_mode,
        opts.tensor_split,
        opts.main_gpu,
        opts.load_mode,
        opts.tensor_overrides,
    )
    model = L.llama_model_load_from_file(opts.path.encode(), mp.params)
    if not model:
        raise RuntimeError(f"failed to load model {opts.path}")
    return model, mp


def model_params(
    n_gpu_layers: int,
    split_mode: str = "layer",
    tensor_split: tuple[float, ...] = (),
    main_gpu: int = 0,
    mode: str = "auto",
    overrides: tuple[tuple[str, str], ...] = (),
    bufts: dict[str, int] | None = None,
) -> ModelParams:
    """llama_model_params as llama-server sets them. Raises ValueError for more split
    proportions than llama.cpp has devices, or an unknown buffer type (naming the known
    ones, as llama-server prints them)."""
    mp = ModelParams(L.llama_model_default_params())
    p = mp.params
    p.n_gpu_layers = n_gpu_layers if n_gpu_layers >= 0 else 999
    p.split_mode = SPLIT_MODES[split_mode]
    p.main_gpu = main_gpu
    p.load_mode = LOAD_MODES[mode]
    if tensor_split:
        n_max = L.llama_max_devices()
        if len(tensor_split) > n_max:
            raise ValueError(f"--tensor-split: {len(tensor_split)} values, at most {n_max}")
        arr = (ctypes.c_float * n_max)(*tensor_split)
        # the bindings annotate these two pointer fields as arrays; their ctypes fields are
        # POINTER(c_float) and c_void_p, which these casts fill
        p.tensor_split = ctypes.cast(arr, ctypes.POINTER(ctypes.c_float))  # type: ignore[assignment]
        mp.keep.append(arr)
    if overrides:
        known = buffer_types() if bufts is None else bufts
        arr = (BuftOverride * (len(overrides) + 1))()  # ends with {NULL, NULL}
        for i, (pattern, name) in enumerate(overrides):
            if name not in known:
                raise ValueError(
                    f"--override-tensor: unknown buffer type {name!r} "
                    f"(available: {', '.join(sorted(known))})"
                )
            raw = pattern.encode()
            mp.keep.append(raw)
            arr[i].pattern, arr[i].buft = raw, known[name]
        p.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)  # type: ignore[assignment]
        mp.keep.append(arr)
    return mp
