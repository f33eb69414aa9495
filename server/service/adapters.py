"""LoRA adapters as the API sees them (issue 32): the loaded files, their global scales
(``GET``/``POST /lora-adapters``), and what one request runs under.

Contracts:

- Adapter ids are the load order: ``--lora`` and ``--lora-scaled`` files as given, then
  ``--lora-alias`` files not among them (loaded at scale 0: they run only when a request
  names them).
- A request runs under (``resolve``), first match wins: its non-empty ``lora`` field (llama-server's:
  an adapter it leaves out runs at 0; an unknown id is a 400); else a ``model`` naming an
  alias (that adapter at its ``--lora-scaled`` scale, 1.0 by default or when that is 0,
  every other at 0);
  else the global scales.
- ``key(scales)`` names an adapter set for the caches: ``""`` when every scale is 0 (the
  base model), else a digest of each active adapter's file content and scale, the same in
  every process, so disk-tier entries and slot files keep their meaning across restarts
  and replicas (tiers/tenancy.py ``with_adapters``).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass

from ..json_value import JsonObject
from ..schemas.bodies import LORA_SCALE_MAX, LoraScale
from ..schemas.errors import APIError


@dataclass
class Adapter:
    id: int
    path: str
    digest: str  # sha256 of the file, 32 hex digits
    scale: float  # the global scale (POST /lora-adapters changes it)
    default_scale: float  # its --lora-scaled scale (1.0 for --lora): an alias runs it so
    alias: str | None = None
    # loaded by POST /v1/load_lora_adapter (service/lora_runtime.py); ``removed``: unloaded
    # since (its id stays taken: ids are the scales' indices; the same bytes loaded again
    # come back under it, with the cache entries keyed by its digest)
    runtime: bool = False
    removed: bool = False


@dataclass(frozen=True)
class AdapterChoice:
    """What one request runs under: one scale per adapter, and the set's cache key."""

    scales: tuple[float, ...] = ()
    key: str = ""


def file_digest(path: str) -> str:
    """sha256 of the file's bytes (read in 1 MiB blocks), 32 hex digits. OSError unless
    ``path`` is a regular file (opened without blocking: a FIFO is refused, not waited on)."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path!r} is not a regular file")
        os.set_blocking(fd, True)
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()[:32]


class AdapterRegistry:
    def __init__(self, adapters: list[Adapter]) -> None:
        self.adapters = adapters
        self.by_alias = {a.alias: a for a in adapters if a.alias}
        # the global scales as one tuple, replaced whole (``set_global``, on the event loop):
        # ``resolve`` may run in a worker thread and never sees half of a change
        self.global_scales = tuple(a.scale for a in adapters)
        self.runtime_names: set[str] = set()  # aliases given at run time (unloadable)
        self.runtime_busy = False  # a run-time load is under way (service/lora_runtime.py)

    @classmethod
    def from_files(
        cls, files: list[tuple[str, float]], aliases: dict[str, str], apply: bool = True
    ) -> AdapterRegistry:
        """``files``: (path, scale) in id order; ``aliases``: name -> path (a path not in
        ``files`` is added at scale 0); ``apply`` False: every global scale starts at 0
        (--lora-init-without-apply)."""
        out: list[Adapter] = []
        paths: dict[str, Adapter] = {}
        for path, scale in files:
            a = Adapter(len(out), path, file_digest(path), scale if apply else 0.0, scale)
            out.append(a)
            paths.setdefault(path, a)
        for name, path in aliases.items():
            if path not in paths:
                paths[path] = Adapter(len(out), path, file_digest(path), 0.0, 1.0)
                out.append(paths[path])
            paths[path].alias = name
        return cls(out)

    @property
    def paths(self) -> list[str]:
        return [a.path for a in self.adapters]

    def describe(self) -> list[JsonObject]:
        """GET /lora-adapters: llama-server's list (``alias`` added where one is set)."""
        out = []
        for a in self.adapters:
            if a.removed:
                continue
            d: JsonObject = {
                "id": a.id,
                "path": a.path,
                "scale": a.scale,
                "task_name": "",
                "prompt_prefix": "",
            }
            if a.alias:
                d["alias"] = a.alias
            out.append(d)
        return out

    def scales_of(self, items: list[LoraScale]) -> tuple[float, ...]:
        """llama-server's ``[{"id", "scale"}]`` as one scale per adapter (left out: 0);
        APIError 400 for an id no adapter has."""
        scales = [0.0] * len(self.adapters)
        for it in items:
            if not 0 <= it.id < len(scales):
                raise APIError(400, f"invalid adapter id {it.id}: {len(scales)} adapters loaded")
            if it.scale and self.adapters[it.id].removed:
                raise APIError(400, f"adapter {it.id} was unloaded")
            scales[it.id] = float(it.scale)
        return tuple(scales)

    def set_global(self, items: list[LoraScale]) -> None:
        """POST /lora-adapters: the new global scales (an adapter left out: 0)."""
        scales = self.scales_of(items)
        for a, s in zip(self.adapters, scales, strict=True):
            a.scale = s
        self.global_scales = scales

    # ---- run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) -------------

    def by_digest(self, digest: str) -> Adapter | None:
        """The adapter loaded from these bytes, unloaded or not."""
        return next((a for a in self.adapters if a.digest == digest), None)

    def add_runtime(self, id: int, path: str, digest: str, name: str) -> Adapter:
        """Register an adapter the engine attached under ``id`` (the next one), named
        ``name`` (requests name it as their ``model``), at scale 0 globally."""
        if id != len(self.adapters):
            raise RuntimeError(f"adapter id {id} out of step with {len(self.adapters)} adapters")
        a = Adapter(id, path, digest, 0.0, 1.0, alias=name, runtime=True)
        self.adapters.append(a)
        self.by_alias[name] = a
        self.runtime_names.add(name)
        self.global_scales = (*self.global_scales, 0.0)
        return a

    def revive(self, a: Adapter, path: str, name: str) -> None:
        """The bytes of ``a`` loaded again under ``name``: the same id, digest and so the
        same cache entries."""
        if a.removed:
            a.removed, a.path = False, path
        a.alias = a.alias or name
        self.by_alias[name] = a
        self.runtime_names.add(name)

    def reload_paths(self) -> list[str]:
        """The files a model (re)load loads, one per id. A run-time adapter whose file is
        gone or holds other bytes now (a wake from sleep reloads by path) is unloaded and
        its id left empty (""): its digest keys cache entries of the old bytes."""
        out = []
        for a in self.adapters:
            if a.runtime and not a.removed:
                try:
                    same = file_digest(a.path) == a.digest
                except OSError:
                    same = False
                if not same:
                    for name in [n for n, b in self.by_alias.items() if b is a]:
                        self.remove(name)
            out.append("" if a.runtime and a.removed else a.path)
        return out

    def remove(self, name: str) -> Adapter:
        """Unload a runtime adapter by name: no request may name it from now on (KeyError
        for an unknown name; ValueError for a --lora adapter)."""
        a = self.by_alias[name]
        if name not in self.runtime_names:
            raise ValueError(f"{name!r} was loaded at start (--lora-alias): it stays")
        del self.by_alias[name]
        self.runtime_names.discard(name)
        if a.runtime and not any(b is a for b in self.by_alias.values()):
            a.removed, a.alias, a.scale = True, None, 0.0
            self.global_scales = tuple(
                0.0 if b is a else s for b, s in zip(self.adapters, self.global_scales, strict=True)
            )
        return a

    def resolve(self, lora: list[LoraScale] | None, model: str | None) -> AdapterChoice:
        """What a request with these fields runs under (module docstring). Thread-safe
        against ``set_global``."""
        if not self.adapters:
            if lora:
                raise APIError(400, "no LoRA adapter is loaded (start the server with --lora)")
            return AdapterChoice()
        if lora:  # llama-server: an empty list is no list
            scales = self.scales_of(lora)
        elif model is not None and model in self.by_alias:
            a = self.by_alias[model]
            on = a.default_scale or 1.0
            scales = tuple(on if b is a else 0.0 for b in self.adapters)
        else:
            scales = self.global_scales
        return AdapterChoice(scales, self.key(scales))

    def key(self, scales: tuple[float, ...]) -> str:
        """The cache key of an adapter set (module docstring)."""
        active = [f"{a.digest}*{s!r}" for a, s in zip(self.adapters, scales, strict=False) if s]
        if not active:
            return ""
        return hashlib.sha256(";".join(active).encode()).hexdigest()[:24]


def lora_scale(text: str) -> float:
    """A --lora-scaled scale; ValueError unless a finite number within ``LORA_SCALE_MAX``
    either way (the bound requests are held to: schemas/bodies.py)."""
    scale = float(text)
    if not abs(scale) <= LORA_SCALE_MAX:  # NaN fails too
        raise ValueError(
            f"LoRA scale {text!r} is outside [-{LORA_SCALE_MAX:g}, {LORA_SCALE_MAX:g}]"
        )
    return scale


def registry_of(
    lora: list[str], scaled: list[str], aliases: list[str], apply: bool
) -> AdapterRegistry:
    """The registry the flags describe (--lora, --lora-scaled FILE:SCALE, --lora-alias
    NAME=FILE, not --lora-init-without-apply). OSError for a file that cannot be read,
    ValueError for a scale that is not a number within ``LORA_SCALE_MAX``."""
    files = [(p, 1.0) for p in lora]
    for item in scaled:
        path, _, scale = item.rpartition(":")
        files.append((path, lora_scale(scale)))
    names = dict(x.split("=", 1) for x in aliases)
    return AdapterRegistry.from_files(files, names, apply)
