"""Slot files (ARCHITECTURE §8): llama.cpp's sequence-state file plus our appendices.

Layout, little-endian:
  body      u32 'ggsq' magic, u32 version, u32 n_tokens, n_tokens x i32, state bytes
            (what llama_state_seq_save_file writes: the state bytes are those of
            llama_state_seq_get_data without its 8-byte header, the window section holding
            a checkpoint's older cells too when widened: ``widened_body``)
  SCKP      u32 magic, u32 version 1, u32 count, per checkpoint: i64 n_tokens, i32 pos_min,
            i32 pos_max, then data_tgt, data_dft, data_spec as (u64 length, bytes)
  SDFT      only with a draft model: u32 magic, u32 version 1, two (u64 length, bytes) buffers
  SKVT      u32 magic, u32 version 1, i32 type_k, i32 type_v: the KV cache's ggml types
            (-ctk / -ctv) of the context that saved it. Ours: llama-server stops reading at
            it. The state bytes record each layer's types too (the restore checks those,
            so a file without SKVT is checked as well); SKVT names them without parsing.
  STNT      a footer at the file's very end, found without parsing the state: the saving
            request's tenant (utf-8), u32 its length, u32 version 1, u32 magic. Ours, written
            on every save; llama-server never reads that far. A file without it (llama-server's,
            or older) has no known tenant.
  SIMG      only when the state holds images: their projector, identities and spans, at
            the end of the body before STNT (server.tiers.image_file); the token list
            holds the images' placeholders as they are.

Reading never trusts the file: every length is checked against the bytes that are left
before anything is allocated, and the llama.cpp restore is done from memory with
llama_state_seq_set_data_ext, which fails softly (llama_state_seq_load_file aborts the
process on a truncated file).
"""

from __future__ import annotations

import collections
import logging
import os
import struct
import tempfile
import unicodedata
from array import array
from dataclasses import dataclass
from pathlib import Path

from ..llama.ggml_types import cache_type_name
from ..llama.state_bytes import WindowShape, widen
from ..types import Checkpoint, StateBuf
from . import durable, file_io, image_file
from .saved import Extras, FileBuf, InSlot, SavedState

log = logging.getLogger("server.slotfile")

GGSQ_MAGIC = 0x67677371  # 'ggsq'
STATE_HEADER_MAGIC = 0xAF143CD8  # llama_state_seq_get_data's leading u32
SCKP_MAGIC = 0x504B4353  # 'SCKP'
SDFT_MAGIC = 0x54464453  # 'SDFT'
SKVT_MAGIC = 0x54564B53  # 'SKVT'
STNT_MAGIC = 0x544E5453  # 'STNT'
TENANT_FOOTER = struct.Struct("<III")  # len(tenant), version, magic: the file's last 12 bytes
MAX_TENANT_BYTES = 4096
APPENDIX_VERSION = 1
TOKEN_NULL = -1  # llama-server's packed token list starts with LLAMA_TOKEN_NULL
PACKED_TOKENS_VERSION = 1


class SlotFileError(ValueError):
    """A file or filename that cannot be used; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def validate_filename(name: str) -> str:
    """Plain names only: no separators, no '..', no control characters, at most 255 bytes."""
    if not isinstance(name, str) or not name:
        raise SlotFileError("filename must be a non-empty string")
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        raise SlotFileError("filename is longer than 255 bytes")
    if name in (".", "..") or ".." in name:
        raise SlotFileError("filename must not contain '..'")
    if "/" in name or "\\" in name:
        raise SlotFileError("filename must not contain path separators")
    if any(unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn") for ch in name):
        raise SlotFileError("filename must not contain control or unassigned characters")
    if name != name.strip() or name.startswith("."):
        raise SlotFileError("filename must not start with '.' or begin or end with spaces")
    return name


def resolve(directory: str | Path, name: str) -> Path:
    """The file's path inside ``directory``; symlinks may not lead outside it."""
    validate_filename(name)
    base = Path(directory).resolve()
    path = (base / name).resolve()
    if path.parent != base:
        raise SlotFileError("filename resolves outside the slot save directory")
    return path


@dataclass
class ParsedFile:
    """A validated slot file, read into one buffer of ours. The target state starts at
    ``state_off``; the 8 bytes before it have been overwritten (in the buffer) with
    llama_state_seq_set_data's header."""

    tokens: list[int]
    buf: FileBuf
    state_off: int  # offset of the header + state bytes, for llama_state_seq_set_data_ext
    n_read: int
    end: int = -1  # where the state and its appendices end (before the STNT footer)
    tenant: str | None = None  # the saving request's tenant (STNT); None: not recorded
    # the pooled buffer ``buf`` views (file_io.BUFFERS), to give back once nothing reads it
    pooled: FileBuf | None = None

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = len(self.buf)


def _unpack_tokens(raw: array) -> list[int]:
    """Plain token list, or llama-server's packed form [NULL, version, n, tokens.., n_media=0]."""
    if not raw or raw[0] != TOKEN_NULL:
        return raw.tolist()
    if len(raw) < 4 or raw[1] != PACKED_TOKENS_VERSION:
        raise SlotFileError("unsupported packed token list in slot file")
    n = raw[2]
    if n < 0 or 3 + n + 1 > len(raw):
        raise SlotFileError("packed token list is truncated")
    tokens = raw[3 : 3 + n].tolist()
    if raw[3 + n] != 0:
        raise SlotFileError("slot file holds media chunks, which this server cannot restore")
    return tokens


# Files from this size are read into huge pages (``file_buffer``).
HUGE_BUFFER_MIN = file_io.HUGE_BUFFER_MIN


def file_buffer(size: int) -> FileBuf:
    """Private memory of ``size`` bytes for a file to be read into (file_io.new_buffer:
    huge pages from HUGE_BUFFER_MIN bytes, never the file mapped)."""
    return file_io.new_buffer(size)


def read_file(
    path: Path, n_ctx: int, n_vocab: int, seq: int, version: int, projector: bytes | None = None
) -> ParsedFile:
    """Read and bound-check the body header and tokens (not the state: llama.cpp checks it)."""
    try:
        fd = durable.open_locked(path)  # shared lock: never recycled while we read it
    except FileNotFoundError:
        raise SlotFileError(f"slot file {path.name!r} not found", 404) from None
    try:
        return _read_fd(fd, n_ctx, n_vocab, seq, version, projector)
    finally:
        os.close(fd)


def _read_fd(
    fd: int, n_ctx: int, n_vocab: int, seq: int, version: int, projector: bytes | None
) -> ParsedFile:
    size = os.fstat(fd).st_size
    if size < 12:
        raise SlotFileError("slot file is truncated (no header)")
    # Read into our own buffer, never mapped: a file that another process (a replica sharing
    # the directory, a user) truncates while it is restored is then a short read and a 400,
    # not a SIGBUS that kills the server.
    # a reused buffer (file_io.BUFFERS): already faulted in, so the read is one copy
    pooled = file_io.BUFFERS.take(size)
    buf = pooled if len(pooled) == size else memoryview(pooled)[:size]
    try:
        got = file_io.pread_into(fd, buf)  # in parallel parts when large
        if got < size:
            raise SlotFileError(f"slot file changed while read ({got} of {size} bytes)")
        return _parse(buf, size, n_ctx, n_vocab, seq, version, projector, pooled)
    except SlotFileError:
        file_io.BUFFERS.give(pooled)  # nothing else holds it: refused before any use
        raise


def release(parsed: ParsedFile) -> None:
    """Give a parsed file's buffer back for the next save or restore: only once nothing
    reads it any more (the engine has loaded the state, its appendices are copied out)."""
    pooled, parsed.pooled = parsed.pooled, None
    if pooled is not None:
        file_io.BUFFERS.give(pooled)


def _parse(
    buf: FileBuf,
    size: int,
    n_ctx: int,
    n_vocab: int,
    seq: int,
    version: int,
    projector: bytes | None,
    pooled: FileBuf | None,
) -> ParsedFile:
    """``read_file``'s checks of the ``size`` bytes read into ``buf``."""
    n_read = size
    magic, file_version, n_tokens = struct.unpack_from("<III", buf, 0)
    if magic != GGSQ_MAGIC:
        raise SlotFileError(f"not a llama.cpp sequence state file (magic {magic:#010x})")
    if file_version != version:
        raise SlotFileError(f"slot file version {file_version} is not this llama.cpp's ({version})")
    if n_tokens > (size - 12) // 4:
        raise SlotFileError(
            f"slot file claims {n_tokens} tokens but holds at most {(size - 12) // 4}"
        )
    raw = array("i")
    raw.frombytes(buf[12 : 12 + 4 * n_tokens])
    body = 12 + 4 * n_tokens
    if size - body < 8:
        raise SlotFileError("slot file has no sequence state")
    tenant, end = read_tenant(buf, body)
    try:  # the images it holds (SIMG, before the footer): its placeholders stay as they are
        block = image_file.find(buf, end, body + 8)
        tokens = raw.tolist() if block is not None else _unpack_tokens(raw)
        image_file.check(tokens, block, projector)
    except image_file.ImageFileError as e:
        raise SlotFileError(f"slot file images cannot be restored: {e}") from None
    if len(tokens) > n_ctx:
        raise SlotFileError(
            f"slot file holds {len(tokens)} tokens, more than the slot's context ({n_ctx})"
        )
    bad = next((t for t in tokens if t >= n_vocab), None)
    if bad is not None:
        raise SlotFileError(
            f"slot file token {bad} is outside this model's vocabulary (another model?)"
        )
    # Rebuild llama_state_seq_get_data's 8-byte header in place of the last token bytes
    # (already parsed) so the state is restored from this buffer without a copy.
    state_off = body - 8
    struct.pack_into("<Ii", buf, state_off, STATE_HEADER_MAGIC, seq)
    if block is not None:
        end = block.start  # the state and its appendices end where the image block starts
    return ParsedFile(tokens, buf, state_off, n_read, end, tenant, pooled)


def read_tenant(buf: bytes | FileBuf, body: int) -> tuple[str | None, int]:
    """The STNT footer: (the saver's tenant, where the bytes before the footer end). A file
    without one, or with one it cannot hold after its ``body`` (header and tokens), or
    not utf-8, gives (None, len(buf)): no known tenant (never an error: the state may be
    fine)."""
    size = len(buf)
    if size - body < TENANT_FOOTER.size:
        return None, size
    n, version, magic = TENANT_FOOTER.unpack_from(buf, size - TENANT_FOOTER.size)
    start = size - TENANT_FOOTER.size - n
    if magic != STNT_MAGIC or version != APPENDIX_VERSION or n > MAX_TENANT_BYTES:
        return None, size
    if start < body + 8:  # the state (at least its 8-byte header) comes first
        return None, size
    try:
        return bytes(buf[start : start + n]).decode("utf-8"), start
    except UnicodeDecodeError:
        return None, size


def tenant_parts(tenant: str | None) -> list[bytes]:
    """The STNT footer naming ``tenant`` (nothing for None)."""
    if tenant is None:
        return []
    raw = tenant.encode("utf-8")
    if len(raw) > MAX_TENANT_BYTES:
        raise SlotFileError("tenant name too long for a slot file", 500)
    return [raw, TENANT_FOOTER.pack(len(raw), APPENDIX_VERSION, STNT_MAGIC)]


def _take(buf: bytes | bytearray | memoryview, pos: int, fmt: str) -> tuple[tuple, int]:
    n = struct.calcsize(fmt)
    if pos + n > len(buf):
        raise SlotFileError("appendix truncated")
    return struct.unpack_from(fmt, buf, pos), pos + n


def _take_buffer(buf: memoryview, pos: int) -> tuple[memoryview, int]:
    """A length-prefixed buffer, as a view into the file (no copy, no allocation)."""
    (length,), pos = _take(buf, pos, "<Q")
    if length > len(buf) - pos:
        # never allocate a length the file cannot hold
        raise SlotFileError(f"appendix buffer of {length} bytes exceeds the {len(buf) - pos} left")
    return buf[pos : pos + length], pos + length


# the least bytes one checkpoint record takes: n_tokens, pos_min, pos_max, three lengths
_CKPT_MIN_BYTES = struct.calcsize("<qii") + 3 * 8
# A slot keeps at most --ctx-checkpoints (32 by default) checkpoints: a file declaring more
# than this (or than the slot's limit, if larger) is not walked record by record.
MAX_CHECKPOINT_RECORDS = 4096
_CKPT_HEAD = struct.Struct("<qiiQ")  # n_tokens, pos_min, pos_max, len(data_tgt)
_LEN = struct.Struct("<Q")


def _skip_buffer(view: memoryview, pos: int) -> tuple[int, int]:
    """A length-prefixed buffer's (start, end), not read (no copy, no allocation)."""
    if pos + 8 > len(view):
        raise SlotFileError("appendix truncated")
    (length,) = _LEN.unpack_from(view, pos)
    pos += 8
    if length > len(view) - pos:
        # never allocate a length the file cannot hold
        raise SlotFileError(f"appendix buffer of {length} bytes exceeds the {len(view) - pos} left")
    return pos, pos + length


def _checkpoints(
    view: memoryview, p: int, n_tokens: int, warnings: list[str], keep: int | None = None
) -> tuple[list[Checkpoint], int]:
    """The SCKP appendix's checkpoints: the last ``keep`` (None: all) that match the slot.
    A count the remaining bytes cannot hold, or above MAX_CHECKPOINT_RECORDS (and ``keep``),
    is refused before any is read (a crafted count must not cost time); records are walked
    without copying, and only the kept ones are copied out; the dropped ones get one
    summary warning each (mismatched, over ``keep``)."""
    (count,), p = _take(view, p, "<I")
    if count > (len(view) - p) // _CKPT_MIN_BYTES:
        raise SlotFileError(f"it declares {count} checkpoints, more than its bytes can hold")
    most = max(MAX_CHECKPOINT_RECORDS, keep or 0)
    if count > most:
        raise SlotFileError(f"it declares {count} checkpoints, more than the {most} allowed")
    kept: collections.deque = collections.deque(maxlen=keep)
    dropped = 0
    for _ in range(count):
        if p + _CKPT_HEAD.size > len(view):
            raise SlotFileError("appendix truncated")
        nt, pmin, pmax, n_tgt = _CKPT_HEAD.unpack_from(view, p)
        t0, p = p + _CKPT_HEAD.size, p + _CKPT_HEAD.size + n_tgt
        if p > len(view):
            raise SlotFileError(f"appendix buffer of {n_tgt} bytes exceeds the bytes left")
        d0, p = _skip_buffer(view, p)
        _s0, p = _skip_buffer(view, p)
        if 0 < nt <= n_tokens and n_tgt:
            kept.append((nt, pmin, pmax, t0, t0 + n_tgt, d0 - 8, d0))
        else:
            dropped += 1
    if dropped:
        warnings.append(f"{dropped} of {count} checkpoints do not match the slot; dropped")
    if keep is not None and count - dropped > keep:
        warnings.append(f"{count - dropped - keep} checkpoints past the slot's {keep}; dropped")
    # copied out: the slot keeps them after the file mapping is gone
    return [_checkpoint(view, *k) for k in kept], p


def _checkpoint(
    view: memoryview, nt: int, pmin: int, pmax: int, t0: int, t1: int, dl: int, d0: int
) -> Checkpoint:
    """A kept record, copied out of the file (its draft data's length is at ``dl``)."""
    (n_dft,) = _LEN.unpack_from(view, dl)
    return Checkpoint(nt, pmin, pmax, bytearray(view[t0:t1]), bytes(view[d0 : d0 + n_dft]))


def parse_appendices(
    buf: bytes | bytearray | memoryview,
    pos: int,
    n_tokens: int,
    max_checkpoints: int | None = None,
) -> SavedState:
    """Appendices after the state, up to the end of ``buf`` (pass a slice to stop before a
    footer or trailer), read as a saved state's extras: a SavedState of them alone (no
    tokens; its state ``InSlot()``, wherever its caller loads it), to give to the state
    they follow (``give_appendices``) — SCKP its checkpoints, SDFT's first buffer its draft
    state (the second, the speculative state, is empty: draft-simple has none), SKVT its KV
    types, and what was dropped reading them its ``warnings``. A bad magic means "none"; a
    bad version is skipped with a warning; a truncated or oversized appendix is dropped.
    At most the last ``max_checkpoints`` (the slot's limit; None: all) checkpoints are kept
    and copied. Never raises. Any thread: a restore calls it before the engine loads the
    state (it costs time linear in the file's checkpoint records)."""
    out = SavedState([], InSlot())
    with memoryview(buf) as view:  # released here: the caller may close a mapping
        _parse_into(out, view, pos, n_tokens, max_checkpoints)
    return out


def _parse_into(
    out: SavedState, view: memoryview, pos: int, n_tokens: int, keep: int | None
) -> None:
    while pos + 8 <= len(view):
        magic, version = struct.unpack_from("<II", view, pos)
        if magic not in (SCKP_MAGIC, SDFT_MAGIC, SKVT_MAGIC):
            break
        if version != APPENDIX_VERSION:
            out.warnings.append(f"appendix {magic:#x} has version {version}; ignored")
            break  # its layout is unknown, so nothing after it can be located either
        try:
            if magic == SCKP_MAGIC:
                out.checkpoints, p = _checkpoints(view, pos + 8, n_tokens, out.warnings, keep)
            elif magic == SKVT_MAGIC:
                out.kv_types, p = _take(view, pos + 8, "<ii")
            else:
                dft, p = _take_buffer(view, pos + 8)
                _, p = _take_buffer(view, p)  # the speculative state: none to restore
                out.data_dft = bytes(dft)
            pos = p
        except SlotFileError as e:
            out.warnings.append(f"appendix {magic:#x} dropped: {e}")
            break


def checkpoint_parts(checkpoints: list[Checkpoint]) -> list[bytes | memoryview]:
    """The SCKP appendix as pieces to write (the state buffers are not copied)."""
    parts: list[bytes | memoryview] = [
        struct.pack("<III", SCKP_MAGIC, APPENDIX_VERSION, len(checkpoints))
    ]
    for c in checkpoints:
        parts.append(struct.pack("<qii", c.n_tokens, c.pos_min, c.pos_max))
        for data in (c.data, c.data_dft, b""):
            view = memoryview(data).cast("B")
            parts.append(struct.pack("<Q", len(view)))
            parts.append(view)
    return parts


def draft_parts(draft: bytes | bytearray) -> list[bytes | memoryview]:
    """The SDFT appendix (the draft context's state of the slot, and an empty speculative
    state: draft-simple has none); nothing without a draft state, as llama-server writes."""
    if not draft:
        return []
    return [
        struct.pack("<IIQ", SDFT_MAGIC, APPENDIX_VERSION, len(draft)),
        memoryview(draft).cast("B"),
        struct.pack("<Q", 0),
    ]


def kv_types_parts(kv_types: tuple[int, int] | None) -> list[bytes | memoryview]:
    """The SKVT appendix: the KV cache's ggml types (nothing when unknown)."""
    if kv_types is None:
        return []
    return [struct.pack("<IIii", SKVT_MAGIC, APPENDIX_VERSION, *kv_types)]


def appendix_parts(
    checkpoints: list[Checkpoint],
    draft: bytes | bytearray = b"",
    kv_types: tuple[int, int] | None = None,
) -> list[bytes | memoryview]:
    """Everything after the body: SCKP, SDFT when there is a draft state, then SKVT."""
    return checkpoint_parts(checkpoints) + draft_parts(draft) + kv_types_parts(kv_types)


def give_appendices(state: SavedState, app: SavedState) -> SavedState:
    """``state`` with a file's appendices (``parse_appendices``) as its extras:
    checkpoints, draft state, KV types, and the warnings of reading them (the same list)."""
    state.checkpoints = app.checkpoints
    state.data_dft = app.data_dft
    state.kv_types = app.kv_types
    state.warnings = app.warnings
    state.extras = Extras.GIVEN
    return state


def kv_types_problem(app: SavedState, want: tuple[int, int] | None) -> str | None:
    """Why a file whose SKVT names other KV cache types than ``want`` cannot be restored;
    None when they match or either is unknown."""
    if app.kv_types is None or want is None or tuple(app.kv_types) == tuple(want):
        return None
    name = cache_type_name
    (k, v), (wk, wv) = app.kv_types, want
    return (
        f"it was saved with KV cache types K {name(k)}, V {name(v)}; this server's are "
        f"K {name(wk)}, V {name(wv)} (-ctk / -ctv)"
    )


def encode_checkpoints(checkpoints: list[Checkpoint]) -> bytes:
    return b"".join(bytes(p) for p in checkpoint_parts(checkpoints))


def image_block(tokens: list[int], projector: bytes | None) -> bytes:
    """The SIMG block naming the images among ``tokens`` (b"" for a text-only state); a
    state whose images are not known by their identities cannot be saved (a 500)."""
    try:
        return image_file.encode(tokens, projector)
    except image_file.ImageFileError as e:
        raise SlotFileError(f"the slot cannot be saved: {e}", 500) from None


def widened_body(
    state: memoryview, checkpoints: list[Checkpoint], window: WindowShape | None
) -> tuple[list[bytes | memoryview], list[Checkpoint]]:
    """The body's state bytes (``state`` without its 8-byte header) as pieces, and the
    checkpoints still to write in SCKP. The newest checkpoint, when it has no draft state
    and its window joins the state's, is written as the few cells it adds to the state's
    window (``widen``: a restore serves its cut from the window itself, and
    rebuilds it for later snapshots) instead of a whole window's copy."""
    if window is not None and checkpoints and not checkpoints[-1].data_dft:
        with memoryview(checkpoints[-1].data) as raw, raw.cast("B") as ck:
            wide = widen(state, window.n_caches, ck, window.max_cells)
        if wide is not None:
            return [wide[0][8:], *wide[1:]], checkpoints[:-1]
    return [state[8:]], checkpoints


def temp_for(path: Path) -> Path:
    """A new temporary file beside ``path`` (same directory, so the final rename is atomic)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".slot", dir=path.parent)
    os.fchmod(fd, 0o644)
    os.close(fd)
    return Path(tmp)


def write_file(
    path: Path,
    tokens: list[int],
    state: StateBuf | FileBuf,
    version: int,
    checkpoints: list[Checkpoint],
    draft: bytes | bytearray = b"",
    kv_types: tuple[int, int] | None = None,
    tenant: str | None = None,
    images: bytes = b"",
    nbytes: int | None = None,
    parts: dict[str, float] | None = None,
    window: WindowShape | None = None,
) -> int:
    """Write a slot file from a state buffer (llama_state_seq_get_data's: 8-byte header +
    state bytes, the first ``nbytes`` of ``state``; None: all of it): the body what
    llama_state_seq_save_file writes (its window widened, below), then the appendices, the SIMG block naming its
    ``images`` and, with a ``tenant``, the STNT footer; durable (durable.write_durable:
    fdatasync, atomic rename, directory fsync). Returns the file's size; ``parts`` gets
    the milliseconds of "prepare" (the pieces and the temporary file), "write", "sync"
    and "rename". With a ``window`` (a sliding-window
    model), the newest checkpoint goes into the state's window (``widened_body``)."""
    laps = file_io.Laps(parts)
    with memoryview(state) as whole, whole.cast("B") as flat:
        mv = flat[: len(flat) if nbytes is None else nbytes]
        if len(mv) < 8 or struct.unpack_from("<I", mv, 0)[0] != STATE_HEADER_MAGIC:
            raise SlotFileError("unexpected sequence state layout", 500)
        body, checkpoints = widened_body(mv, checkpoints, window)
        pieces: list[bytes | memoryview] = [
            struct.pack("<III", GGSQ_MAGIC, version, len(tokens)),
            array("i", tokens).tobytes(),
            *body,
            *appendix_parts(checkpoints, draft, kv_types),
            images,
            *tenant_parts(tenant),
        ]
        tmp = temp_for(path)
        laps.lap("prepare")
        try:
            return durable.write_durable(tmp, path, pieces, laps)
        finally:
            mv.release()
