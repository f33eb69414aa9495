"""SavedState: the one shape of "what a slot held", wherever it is kept.

Every tier that keeps a slot's state makes and hands over this one type: the RAM prompt
cache's entries (server.tiers.prompt_cache), the disk tier's queued writes and the files
it reads back (server.tiers.disk, server.engine.disk_glue), a slot's snapshot
(SlotStore.snapshot), a slot file saved or read (server.engine.commands). And one method
loads it into a slot: ``SlotStore.restore(slot, state, trusted)``.

``data`` says where the target state's bytes are, as one field:
  - a ``StateBuf`` (bytearray or ctypes array): in our memory, llama_state_seq_get_data's
    buffer (8-byte header + state bytes): a RAM entry, a disk write still queued;
  - ``InBuffer``: a file (slot file or disk-tier file) read into one buffer of ours, the
    state at an offset, its appendices after it; or a slot's state copied into a reused
    buffer to be written as a slot file (SaveSlot);
  - ``InSlot``: still in a slot's KV cache (a snapshot: read on demand), or already loaded
    into the slot restoring it (a slot file's appendices, parsed after its state);
  - ``OnDisk``: a disk-tier file indexed from its header and trailer, not read yet (the
    disk index's entries, ``disk_files.DiskEntry``: a SavedState of that shape).

Where the state came from decides how far it is trusted (``restore``'s ``trusted``): one we
made ourselves (RAM, a queued write) loads as it is; a file's (slot file, disk tier) has its
cells proven before llama.cpp sees it. Files keep their on-disk formats (slot_file.py,
disk_files.py): SavedState is what they are read into and written from; a file's
appendices are read as a SavedState of its extras alone (``slot_file.parse_appendices``,
given to the state they follow with ``slot_file.give_appendices``), and the disk index's
record of a file not read yet is one whose state is ``OnDisk`` (``DiskTier.read`` reads it
into a buffer, the state ``SlotStore.restore`` loads).
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from ..types import Checkpoint, StateBuf

# A file's bytes read into memory of ours: a bytearray, or anonymous memory in huge pages
# (slot_file.file_buffer), never the file itself mapped; or a view of the first bytes of
# such a buffer, reused (file_io.BUFFERS).
FileBuf = bytearray | mmap.mmap | memoryview


@dataclass(frozen=True)
class InBuffer:
    """A file's bytes read into ``buf`` (ours, private): the state with
    llama_state_seq_set_data's header from ``state_off``, ending exactly at ``end`` when
    ``exact``, else where llama.cpp stops reading, the appendices after it up to ``end``;
    ``proven``: see below."""

    buf: FileBuf
    state_off: int
    end: int
    exact: bool
    # its cells were proven already, in this buffer (file_plan.plan_restore, off the engine
    # thread): the buffer is ours, so SlotStore.restore does not prove them again
    proven: bool = False

    def __len__(self) -> int:
        return self.end - self.state_off


@dataclass(frozen=True)
class InSlot:
    """The state is in slot ``slot``'s KV cache: ``size`` bytes (target and draft
    together, known before copying), ``read`` copies the target's, ``read_draft`` the draft
    model's (None: no draft state). A restore of an InSlot state into that same slot only
    gives it the state's extras (checkpoints, draft): its bytes are loaded already."""

    slot: int = -1
    size: int = 0
    read: Callable[[], StateBuf] | None = None
    read_draft: Callable[[], bytes | bytearray] | None = None

    def __len__(self) -> int:
        return self.size


@dataclass(frozen=True)
class OnDisk:
    """The state is in a disk-tier file not read yet (``disk_files.DiskEntry``): ``name``
    in the tier's directory, ``nbytes`` long, its body (state and appendices) ending at
    ``body_len`` (the trailer after it), last written at ``mtime_ns`` (a read checks the
    file still is that one). ``DiskTier.read`` reads it into an ``InBuffer``."""

    name: str
    nbytes: int
    body_len: int
    mtime_ns: int

    def __len__(self) -> int:
        return self.nbytes


Where = StateBuf | InBuffer | InSlot | OnDisk


class Extras(Enum):
    """Where a state's checkpoints, draft state and KV types are."""

    GIVEN = "given"  # in the SavedState's own fields
    AFTER_STATE = "after"  # in ``data``'s buffer after the state: parsed once it is loaded
    LATER = "later"  # not read yet: load the state alone; they follow in a second restore


@dataclass
class SavedState:
    """What a slot held: its ``tokens`` (exactly the positions of the state), the target
    state (``data``: where its bytes are, see the module doc), the draft model's state of the
    same tokens (``data_dft``, empty without one), its checkpoints, the cache key it was
    computed under (``tenant``: tenant and adapter set, tiers/tenancy.py) and, for a file,
    the KV cache types it names (SKVT) and what was dropped reading it (``warnings``)."""

    tokens: list[int]
    data: Where
    data_dft: bytes | bytearray = b""
    checkpoints: list[Checkpoint] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    tenant: str = ""
    kv_types: tuple[int, int] | None = None
    extras: Extras = Extras.GIVEN
    warnings: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes held: the target state, the draft's and every checkpoint's."""
        return len(self.data) + len(self.data_dft) + sum(c.nbytes for c in self.checkpoints)

    def read(self) -> SavedState:
        """A copy with its bytes in our memory (an InSlot state read out of its slot):
        the same state otherwise. Raises MemoryError as the copy does."""
        where = self.data
        if not isinstance(where, InSlot) or where.read is None:
            return self
        data = where.read()
        dft = where.read_draft() if where.read_draft is not None else self.data_dft
        return SavedState(list(self.tokens), data, dft, list(self.checkpoints), tenant=self.tenant)
