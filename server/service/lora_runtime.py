"""LoRA adapters loaded and unloaded at run time: vLLM's ``POST /v1/load_lora_adapter``
(``{"lora_name", "lora_path"}``) and ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``),
behind ``--enable-lora-runtime`` (off: 404) and only for files under ``--lora-runtime-dir``.

Contracts:

- A path is taken only when its real path (symlinks resolved) lies under the directory's real
  path; it is opened without following a last symlink and without blocking (a FIFO answers
  at once), must be a regular file, and the file opened is checked again by its descriptor
  (a swap between the check and the open is caught). Anything else is a 403; a missing
  file a 404; a file the adapter check (server/llama/lora_check.py) or llama.cpp refuses a
  400 naming what is wrong.
- A name is refused (400) when it is the served model's name or one of its ``--alias``es:
  ``model: "<alias>"`` would otherwise run the adapter for every client naming the model.
- The file is checked from that descriptor (header only; its size bounds what follows),
  then copied once into a private memory file while hashed (sha256, the adapter's cache key,
  service/adapters.py ``key``); that copy is checked again and handed to llama.cpp
  (``load_adapter``): the bytes hashed, checked and loaded are the same even if the file
  changes meanwhile. All off the event loop and off the engine thread. The engine thread
  only attaches the loaded adapter between two steps (``attach_adapter`` through
  ``Engine.call``): its id is the next one.
- Bytes seen before (by digest) take their old id back without a load: their cache entries,
  keyed by the digest in every tier, serve again. Different bytes under an old name are a
  new adapter, a new digest: old entries never match them.
- Unloading removes the name (requests can no longer name it; runs already started finish
  under it); the adapter's memory stays with the model for a later load of the same bytes.
  At most ``--lora-runtime-max`` distinct files are loaded at run time over the server's
  life: beyond, a load is a 400 (memory is bounded).
- One load at a time: another load arriving meanwhile is a 409 (retry).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
from typing import Protocol, runtime_checkable

from ..engine.commands import AttachAdapter
from ..json_value import JsonObject, JsonValue
from ..schemas.errors import APIError
from ..types import AdapterHandle
from .state import ServerState

MAX_NAME = 128
MAX_PATH = 4096


@runtime_checkable
class AdapterLoading(Protocol):
    """The model's side of run-time loading (server.llama.backend.LlamaBackend)."""

    def check_adapter(self, fd: int) -> int: ...

    def load_adapter(self, fd: int) -> AdapterHandle: ...

    def attach_adapter(self, handle: AdapterHandle) -> int: ...


def _enabled(st: ServerState) -> str:
    """The directory's real path; APIError 404 while run-time loading is off."""
    s = st.settings
    if not s.enable_lora_runtime or not s.lora_runtime_dir:
        raise APIError(
            404,
            "loading LoRA adapters at run time is off (start with --enable-lora-runtime "
            "--lora-runtime-dir DIR)",
            "not_found_error",
        )
    return os.path.realpath(s.lora_runtime_dir)


def _name(v: JsonValue) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_NAME or not v.isprintable():
        raise APIError(400, f"lora_name must be a printable string of 1-{MAX_NAME} characters")
    return v


def _new_name(st: ServerState, v: JsonValue) -> str:
    """A name a load may take: not the served model's (module docstring)."""
    name = _name(v)
    if name == st.model_name or name in st.model_aliases:
        raise APIError(400, f"lora_name {name!r} is the served model's name: choose another")
    return name


def checked_path(root: str, given: JsonValue) -> str:
    """The real path of ``given`` (relative: to ``root``), which must lie under ``root``;
    APIError 400 for a malformed path, 403 for one outside."""
    if not isinstance(given, str) or not 0 < len(given) <= MAX_PATH or "\0" in given:
        raise APIError(400, f"lora_path must be a path of 1-{MAX_PATH} characters")
    real = os.path.realpath(os.path.join(root, given))
    if real == root or os.path.commonpath([real, root]) != root:
        raise APIError(403, "lora_path must name a file under --lora-runtime-dir")
    return real


def open_checked(root: str, real: str) -> int:
    """Open ``real`` for reading without following a symlink; the descriptor of a regular
    file that still lies under ``root``. APIError 404 (missing), 403 (anything else)."""
    try:  # O_NONBLOCK: a FIFO opens at once (and is refused below) instead of waiting
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise APIError(404, "no such adapter file under --lora-runtime-dir") from None
    except OSError as e:
        raise APIError(403, f"cannot open the adapter file: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise APIError(403, "lora_path must name a regular file")
        link = f"/proc/self/fd/{fd}"
        if os.path.exists(link):
            opened = os.path.realpath(os.readlink(link))
            if os.path.commonpath([opened, root]) != root:
                raise APIError(403, "lora_path must name a file under --lora-runtime-dir")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_copy(fd: int, size: int) -> tuple[int, str]:
    """The open file's first ``size`` bytes copied into a new memory file (its descriptor,
    the caller's to close) and their sha256, 32 hex digits (service/adapters.file_digest's).
    APIError 400 when the file holds more bytes by now (it changed after its check)."""
    h = hashlib.sha256()
    out = os.memfd_create("lora-adapter", os.MFD_CLOEXEC)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        left = size
        while left > 0 and (block := os.read(fd, min(left, 1 << 20))):
            h.update(block)
            left -= len(block)
            view = memoryview(block)
            while view:
                view = view[os.write(out, view) :]
        if os.read(fd, 1):
            raise APIError(400, "failed to load LoRA adapter: the file changed while read")
    except BaseException:
        os.close(out)
        raise
    return out, h.hexdigest()[:32]


def _checked_copy(b: AdapterLoading, fd: int) -> tuple[int, str]:
    """Check the file, then copy it (``private_copy``); APIError 400 naming what is wrong."""
    try:
        size = b.check_adapter(fd)
    except ValueError as e:
        raise APIError(400, f"failed to load LoRA adapter: {e}") from None
    return private_copy(fd, size)


def _prepare(
    st: ServerState, b: AdapterLoading, root: str, real: str
) -> tuple[str, AdapterHandle | None]:
    """Worker thread: open, check, copy and hash, and load the copy when these bytes are
    new; (digest, handle or None when an adapter of these bytes exists)."""
    fd = open_checked(root, real)
    try:
        copy, digest = _checked_copy(b, fd)
    finally:
        os.close(fd)
    try:
        if st.adapters.by_digest(digest) is not None:
            return digest, None
        n_runtime = sum(1 for a in st.adapters.adapters if a.runtime)
        if n_runtime >= st.settings.lora_runtime_max:
            raise APIError(
                400,
                f"{n_runtime} adapters were loaded at run time: the most "
                "--lora-runtime-max allows (restart to free their memory)",
            )
        try:
            return digest, b.load_adapter(copy)
        except ValueError as e:
            raise APIError(400, f"failed to load LoRA adapter: {e}") from None
    finally:
        os.close(copy)


async def load(st: ServerState, body: JsonObject) -> str:
    """POST /v1/load_lora_adapter (module docstring); vLLM's success text."""
    root = _enabled(st)
    name = _new_name(st, body.get("lora_name"))
    real = checked_path(root, body.get("lora_path"))
    reg = st.adapters
    if name in reg.by_alias:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.")
    engine = st.require_engine()
    b = st.require_backend()
    if not isinstance(b, AdapterLoading):
        raise APIError(501, "this model cannot load adapters at run time")
    if reg.runtime_busy:
        raise APIError(409, "another LoRA adapter is being loaded: retry", "conflict_error")
    reg.runtime_busy = True  # the event loop's: no await between the check and this
    try:
        digest, handle = await asyncio.to_thread(_prepare, st, b, root, real)
        old = reg.by_digest(digest)
        if old is not None:
            reg.revive(old, real, name)
        else:
            assert handle is not None  # None only for bytes registered (runtime_busy held)
            new_id = await asyncio.wrap_future(engine.submit_command(AttachAdapter(b, handle)))
            reg.add_runtime(new_id, real, digest, name)
    finally:
        reg.runtime_busy = False
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload(st: ServerState, body: JsonObject) -> str:
    """POST /v1/unload_lora_adapter (module docstring); vLLM's success text."""
    _enabled(st)
    name = _name(body.get("lora_name"))
    try:
        st.adapters.remove(name)
    except KeyError:
        raise APIError(
            404, f"The lora adapter '{name}' cannot be found.", "not_found_error"
        ) from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return f"Success: LoRA adapter '{name}' removed successfully."
