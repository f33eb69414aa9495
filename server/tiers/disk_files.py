"""The disk tier's files (server.tiers.disk): names, the trailer, reading a file's header
and trailer without its state, writing an entry whole, and cleaning abandoned writes.

One entry is one file, ``<time_ns:016x>-<host>-<pid>-<uuid12>.lsc`` (unique across replicas
sharing the directory), in the slot-file format (server.tiers.slot_file: the ggsq body, the
SCKP checkpoint appendix, SDFT with a draft state, the SIMG block when it holds images:
server.tiers.image_file) followed by a trailer, which slot-file readers stop at (an
unknown magic ends the appendices):

    tenant (utf-8) | model id (utf-8) | u32 len(tenant) | u32 len(model) | u64 body_len |
    u32 version 1 | u32 magic 'SDSK'

``body_len`` is where the trailer starts (the file's size less the trailer), so a truncated
file never passes. A file is written under ``.tmp-<host>-<pid>-<uuid>.lsc`` and renamed when
complete: readers see whole files only, and a process killed mid-write leaves only a
temporary file, which is never indexed and is removed at start-up once its writer is gone.
Hostile files (not regular files, symlinks, truncated, wrong magic or version, lengths the
file cannot hold, tokens outside the vocabulary, another model's) raise BadFile.

Reading an entry (read_entry) copies the file into one bytearray with pread, never through
a mapping: replicas share the directory, and a file mapped while another process truncates
it kills the reader with SIGBUS on the first access past the new end. A file that is not
the one indexed (size or mtime moved), reads short, grows, or is written while read raises
EntryChanged: a miss, never a crash.
"""

from __future__ import annotations

import ctypes
import os
import re
import socket
import stat
import struct
import time
import uuid
from array import array
from dataclasses import dataclass
from pathlib import Path

from . import file_io, image_file, slot_file
from .saved import Extras, OnDisk, SavedState

MiB = 1024 * 1024

TRAILER = struct.Struct("<IIQII")  # len(tenant), len(model), body_len, version, magic
TRAILER_MAGIC = 0x4B534453  # 'SDSK'
TRAILER_VERSION = 1
MAX_LABEL = 4096  # longest tenant or model id accepted in a trailer
SUFFIX = ".lsc"
TMP_PREFIX = ".tmp-"
NAME_RE = re.compile(r"^[0-9a-f]{16}-[A-Za-z0-9_.]{1,64}-[0-9]{1,10}-[0-9a-f]{12}\.lsc$")
TMP_RE = re.compile(r"^\.tmp-([A-Za-z0-9_.]{1,64})-([0-9]{1,10})-[0-9a-f]{12}\.lsc$")
STALE_TMP_S = 3600.0  # another host's temporary file this old is an abandoned write
# Test-only: seconds to sleep after each MiB written, so a test can kill a writer mid-file.
WRITE_DELAY_ENV = "LLAMA_SLOT_TEST_DISK_WRITE_DELAY_S"
# Test-only: seconds to sleep between opening an entry and reading it, so a test can
# truncate it under a reader.
READ_DELAY_ENV = "LLAMA_SLOT_TEST_DISK_READ_DELAY_S"
_CHUNK = MiB


class BadFile(ValueError):
    """A file in the directory that is not a usable entry (``foreign``: another model's)."""

    def __init__(self, message: str, foreign: bool = False) -> None:
        super().__init__(message)
        self.foreign = foreign


class EntryChanged(Exception):
    """An indexed entry's file is not the one indexed any more (truncated, replaced, or
    written while read, by another process): a miss, and the entry is forgotten."""


def host_label() -> str:
    """This host's name as a file-name part: [A-Za-z0-9_.], at most 64 characters."""
    name = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64]
    return name or "host"


def entry_name(host: str, pid: int, now_ns: int | None = None) -> str:
    """A new entry's file name: time first (readable age), then writer and a random part."""
    t = time.time_ns() if now_ns is None else now_ns
    return f"{t & (2**64 - 1):016x}-{host}-{pid}-{uuid.uuid4().hex[:12]}{SUFFIX}"


def tmp_name(host: str, pid: int) -> str:
    return f"{TMP_PREFIX}{host}-{pid}-{uuid.uuid4().hex[:12]}{SUFFIX}"


def encode_trailer(tenant: str, model: str, body_len: int) -> bytes:
    t, m = tenant.encode("utf-8"), model.encode("utf-8")
    if len(t) > MAX_LABEL or len(m) > MAX_LABEL:
        raise ValueError("tenant or model id too long for a disk entry")
    return t + m + TRAILER.pack(len(t), len(m), body_len, TRAILER_VERSION, TRAILER_MAGIC)


class DiskEntry(SavedState):
    """One file of the tier as the index knows it: a saved state whose bytes are still in
    the file (``OnDisk``; its checkpoints and draft state are in the file's appendices,
    read with it). Made from the file's header and trailer: (name, tokens, tenant, file
    size, end of its body, mtime)."""

    def __init__(
        self, name: str, tokens: list[int], tenant: str, nbytes: int, body_len: int, mtime_ns: int
    ) -> None:
        at = OnDisk(name, nbytes, body_len, mtime_ns)
        super().__init__(tokens, at, tenant=tenant, extras=Extras.AFTER_STATE)
        self.at = at

    @property
    def name(self) -> str:
        return self.at.name

    @property
    def body_len(self) -> int:
        return self.at.body_len

    @property
    def mtime_ns(self) -> int:
        return self.at.mtime_ns

    @property
    def key(self) -> tuple[int, str]:
        return (self.at.mtime_ns, self.at.name)


@dataclass
class FileCheck:
    """What read_header checks a file against (this model and context)."""

    version: int  # llama.cpp's state file version
    n_ctx: int  # most tokens a slot holds
    n_vocab: int
    model: str  # model id written in the trailer; files with another are foreign
    projector: bytes | None = None  # --mmproj's key: the images a file holds must name it


def _read_exact(fd: int, n: int, what: str) -> bytes:
    data = os.read(fd, n)
    if len(data) != n:
        raise BadFile(f"truncated ({what})")
    return data


def _header_tokens(fd: int, size: int, check: FileCheck) -> list[int]:
    magic, version, n_tokens = struct.unpack("<III", _read_exact(fd, 12, "header"))
    if magic != slot_file.GGSQ_MAGIC:
        raise BadFile(f"wrong magic {magic:#010x}")
    if version != check.version:
        raise BadFile(f"state version {version}, not {check.version}")
    if n_tokens == 0 or n_tokens > check.n_ctx:
        raise BadFile(f"{n_tokens} tokens (a slot holds 1..{check.n_ctx})")
    if 12 + 4 * n_tokens + 8 + TRAILER.size > size:
        raise BadFile(f"{n_tokens} tokens do not fit in {size} bytes")
    raw = array("i")
    raw.frombytes(_read_exact(fd, 4 * n_tokens, "tokens"))
    if max(raw) >= check.n_vocab:
        raise BadFile("a token outside this model's vocabulary")
    return raw.tolist()  # negative entries: images' placeholders, proven by _images


def _images(fd: int, tokens: list[int], body_len: int, check: FileCheck) -> None:
    """Prove the placeholders among ``tokens`` are the images the file's SIMG block (at
    the end of its body) names, made by this server's projector (image_file.check)."""
    if not image_file.has_images(tokens):
        return
    body = 12 + 4 * len(tokens) + 8
    most = image_file.HEAD.size + image_file.MAX_IMAGES * image_file.REC.size
    start = max(body, body_len - most - image_file.TAIL.size)
    os.lseek(fd, start, os.SEEK_SET)
    tail = _read_exact(fd, body_len - start, "image block")
    try:
        block = image_file.find(tail, len(tail), 0)
        if block is not None and block.start + start < body:
            raise image_file.ImageFileError("its image block overlaps the state")
        image_file.check(tokens, block, check.projector)
    except image_file.ImageFileError as e:
        raise BadFile(f"images: {e}", e.foreign) from None


def _trailer(fd: int, size: int, min_body: int) -> tuple[str, str, int]:
    os.lseek(fd, size - TRAILER.size, os.SEEK_SET)
    lt, lm, body_len, version, magic = TRAILER.unpack(_read_exact(fd, TRAILER.size, "trailer"))
    if magic != TRAILER_MAGIC:
        raise BadFile("no disk-cache trailer (truncated or not ours)")
    if version != TRAILER_VERSION:
        raise BadFile(f"trailer version {version}")
    if lt > MAX_LABEL or lm > MAX_LABEL or body_len != size - TRAILER.size - lt - lm:
        raise BadFile("trailer lengths do not match the file")
    if body_len < min_body:
        raise BadFile("trailer leaves no room for the state")
    os.lseek(fd, body_len, os.SEEK_SET)
    labels = _read_exact(fd, lt + lm, "labels")
    try:
        return labels[:lt].decode("utf-8"), labels[lt:].decode("utf-8"), body_len
    except UnicodeDecodeError:
        raise BadFile("trailer labels are not UTF-8") from None


def read_header(directory: Path, name: str, check: FileCheck) -> DiskEntry:
    """Index one file from its header and trailer; raises BadFile for anything else than a
    whole entry of this model. Symlinks and non-regular files are refused unread."""
    path = directory / name
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise BadFile("not a regular file (symlink, directory or device)")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise BadFile(f"cannot open: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadFile("not a regular file")
        size = st.st_size
        if size < 12 + 8 + TRAILER.size:
            raise BadFile("truncated (shorter than a header)")
        tokens = _header_tokens(fd, size, check)
        tenant, model, body_len = _trailer(fd, size, 12 + 4 * len(tokens) + 8)
        if model == check.model:
            _images(fd, tokens, body_len, check)
    except OSError as e:
        raise BadFile(f"unreadable: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if model != check.model:
        raise BadFile(f"another model's entry ({model!r})", foreign=True)
    return DiskEntry(name, tokens, tenant, size, body_len, st.st_mtime_ns)


def read_entry(
    directory: Path, e: DiskEntry, check: FileCheck, seq: int, delay_s: float = 0.0
) -> tuple[bytearray, int]:
    """The indexed entry ``e``'s whole file in one new bytearray (read with pread: one copy,
    no mapping another process can truncate under us), with llama_state_seq_set_data's
    8-byte header for sequence ``seq`` written over the last token's bytes; and that
    header's offset (state_off). Raises EntryChanged when the file is not the one indexed
    (size or mtime moved), reads short, grows, or changes while read; BadFile when it is no
    regular file; OSError as it comes (FileNotFoundError: another replica removed it)."""
    fd = os.open(directory / e.name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise BadFile("not a regular file")
        if (before.st_size, before.st_mtime_ns) != (e.nbytes, e.mtime_ns):
            raise EntryChanged(
                f"changed since it was indexed ({before.st_size} bytes, {e.nbytes} indexed)"
            )
        if delay_s > 0:
            time.sleep(delay_s)
        buf = bytearray(e.nbytes)
        _pread_into(fd, buf)
        if os.pread(fd, 1, e.nbytes):
            raise EntryChanged("grew while it was read")
        if _identity(os.fstat(fd)) != _identity(before):
            raise EntryChanged("written while it was read")
    finally:
        os.close(fd)
    return buf, _patch_body(buf, e, check, seq)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    # ctime too: a writer can put mtime back (utime), never ctime
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _pread_into(fd: int, buf: bytearray) -> None:
    """Fill ``buf`` from the file's start (``file_io.pread_into``); EntryChanged when the
    file ends first (another process truncated it)."""
    got = file_io.pread_into(fd, buf)
    if got < len(buf):
        raise EntryChanged(f"truncated while read ({got} of {len(buf)} bytes)")


def _patch_body(buf: bytearray, e: DiskEntry, check: FileCheck, seq: int) -> int:
    """Check the bytes read hold the indexed header and tokens; write the state header in
    place of the last token's bytes (already compared). Returns its offset."""
    n = len(e.tokens)
    body = 12 + 4 * n
    magic, version, n_tokens = struct.unpack_from("<III", buf, 0)
    if magic != slot_file.GGSQ_MAGIC or version != check.version or n_tokens != n:
        raise EntryChanged("its header is not the one indexed")
    if body + 8 > e.body_len or buf[12:body] != array("i", e.tokens).tobytes():
        raise EntryChanged("its tokens are not the ones indexed")
    struct.pack_into("<Ii", buf, body - 8, slot_file.STATE_HEADER_MAGIC, seq)
    return body - 8


def entry_parts(
    entry: SavedState, version: int, model: str, projector: bytes | None = None
) -> list[bytes | memoryview]:
    """An entry's file, as pieces to write (the state buffers are not copied). The entry's
    bytes are in memory (a RAM entry, a slot's state read for a spill). Its images are
    named by the SIMG block ending its body (``projector``: the loaded one's key); one
    whose images are not known any more raises ValueError (image_file.ImageFileError)."""
    if not isinstance(entry.data, (bytearray, ctypes.Array)):
        raise ValueError("a disk entry is written from a state in memory")
    mv = memoryview(entry.data).cast("B")
    if len(mv) < 8 or struct.unpack_from("<I", mv, 0)[0] != slot_file.STATE_HEADER_MAGIC:
        raise ValueError("unexpected sequence state layout")
    parts: list[bytes | memoryview] = [
        struct.pack("<III", slot_file.GGSQ_MAGIC, version, len(entry.tokens)),
        array("i", entry.tokens).tobytes(),
        mv[8:],
        *slot_file.appendix_parts(entry.checkpoints, entry.data_dft),
        image_file.encode(entry.tokens, projector),
    ]
    body_len = sum(len(p) for p in parts)
    parts.append(encode_trailer(entry.tenant, model, body_len))
    return parts


def write_entry(
    directory: Path,
    entry: SavedState,
    version: int,
    model: str,
    delay_s: float = 0.0,
    projector: bytes | None = None,
) -> tuple[str, int, int]:
    """Write ``entry`` to a temporary file, make it durable, rename it to a new unique name.
    Returns (name, size, mtime_ns). On any failure the temporary file is removed and no
    entry appears."""
    host, pid = host_label(), os.getpid()
    tmp = directory / tmp_name(host, pid)
    parts = entry_parts(entry, version, model, projector)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            for p in parts:
                if delay_s <= 0:
                    f.write(p)
                    continue
                for i in range(0, len(p), _CHUNK):
                    f.write(p[i : i + _CHUNK])
                    f.flush()
                    time.sleep(delay_s)
            f.flush()
            os.fdatasync(f.fileno())
            size = f.tell()
        name = entry_name(host, pid)
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return name, size, os.stat(directory / name).st_mtime_ns


def clean_temp_files(directory: Path, now: float | None = None) -> int:
    """Remove temporary files whose writer is gone: this host's when their process no
    longer runs (or is this process: a previous life with the same pid), any host's after
    STALE_TMP_S. A live replica's write in progress is left alone. Returns how many."""
    host, now = host_label(), time.time() if now is None else now
    removed = 0
    for name in os.listdir(directory):
        m = TMP_RE.match(name)
        if m is None:
            continue
        path = directory / name
        try:
            st = os.lstat(path)
            mine = m.group(1) == host
            if (mine and not _pid_alive(int(m.group(2)))) or now - st.st_mtime > STALE_TMP_S:
                path.unlink()
                removed += 1
        except OSError:
            continue  # gone already, or not ours to remove
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own temporary files cannot exist before we start writing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True
