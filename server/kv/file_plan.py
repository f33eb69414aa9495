"""What is proven of a slot file before the engine loads it (ARCHITECTURE §8). Any thread: the
routes run these on worker threads, never on the engine thread, so the engine only loads
what was read, checked and parsed here (``commands.RestoreSlot`` takes the plan)."""

from __future__ import annotations

from dataclasses import dataclass

from ..llama.state_bytes import WindowShape, narrow, window_shape
from ..slot.backend_api import Backend
from ..tiers import slot_file
from ..tiers.saved import Extras, InBuffer, SavedState
from ..types import CacheCells, Checkpoint
from .audit import kv_type_problem, seq_state_problem


@dataclass
class RestorePlan:
    """What is known of a slot file before the engine loads it: where its state ends (the
    end of its appendices when unknown) and its appendices, parsed off the engine thread
    (None: the state's end is unknown, so they are parsed once the engine has loaded it)."""

    known: bool
    state_end: int
    appendices: SavedState | None  # the state's extras alone (slot_file.parse_appendices)
    # a widened window's checkpoint (widen): the cut it serves, 0 for none
    window_checkpoint: int = 0


def plan_restore(
    backend: Backend, parsed: slot_file.ParsedFile, max_checkpoints: int | None = None
) -> RestorePlan:
    """Read the state's cells without loading them (any thread): a state that is not exactly
    the KV of the file's tokens is refused here (SlotFileError, a 400) and never reaches
    llama.cpp. The appendices are parsed here too (at most ``max_checkpoints`` kept), never
    on the engine thread. ``backend``: ``state_cells``, ``n_swa`` and, when known, the KV
    cache types (``kv_type_ids``)."""
    size = parsed.end  # the state and its appendices; the STNT footer after them
    try:
        read = backend.state_cells(parsed.buf, size, start=parsed.state_off)
    except ValueError as e:
        raise slot_file.SlotFileError(f"the slot file's state is not readable: {e}") from None
    if read is None:
        return RestorePlan(False, size, None)
    caches, end = read
    problem = seq_state_problem(caches, len(parsed.tokens), backend.n_swa)
    if problem:
        raise slot_file.SlotFileError(
            f"the slot file's state does not match its {len(parsed.tokens)} tokens: {problem}"
        )
    # another KV cache type (-ctk / -ctv): the state's own per-layer types, then SKVT
    want = backend.kv_type_ids
    app = parse_after_state(parsed, end, max_checkpoints)
    problem = kv_type_problem(caches, want) or slot_file.kv_types_problem(app, want)
    if problem:
        raise slot_file.SlotFileError(
            f"the slot file's KV cache does not fit this server: {problem}"
        )
    return RestorePlan(True, end, app, _window_checkpoint(caches, app, backend.n_swa))


def _window_checkpoint(caches: list[CacheCells], app: SavedState, n_swa: int) -> int:
    """The checkpoint a widened window serves (its oldest cell's position + n_swa; proven
    contiguous by seq_state_problem), unless the file carries it in SCKP; 0 for none."""
    swa = caches[-1] if caches and caches[-1].kind == "swa" else None
    if swa is None or n_swa <= 0 or len(swa.pos) <= n_swa:
        return 0
    n = min(swa.pos) + n_swa
    return 0 if any(c.n_tokens == n for c in app.checkpoints) else n


def window_of(backend: Backend) -> WindowShape | None:
    """The model's window shape, for widening a saved state (None: nothing to widen)."""
    return window_shape(backend.kv_kinds, backend.n_swa, backend.n_ubatch)


def window_checkpoint(
    parsed: slot_file.ParsedFile, plan: RestorePlan, shape: WindowShape
) -> Checkpoint | None:
    """The checkpoint a widened window serves, cut out of the file's buffer (a window's
    copy, so a restored slot's later snapshot carries it as the file did); None when the
    plan found none or the cells are not all there. Any thread: it only reads the buffer,
    which must not be given back before it returns."""
    n = plan.window_checkpoint
    if not n or not plan.known:
        return None
    with memoryview(parsed.buf) as whole, whole[parsed.state_off : plan.state_end] as state:
        data = narrow(state, shape.n_caches, n, shape.n_swa)
    return None if data is None else Checkpoint(n, n - shape.n_swa, n - 1, data)


def parse_after_state(
    parsed: slot_file.ParsedFile, pos: int, max_checkpoints: int | None
) -> SavedState:
    """The appendices from ``pos`` (where the state ends) up to the STNT footer, as the
    state's extras (``slot_file.parse_appendices``). Any thread."""
    with memoryview(parsed.buf) as whole, whole[: parsed.end] as body:
        return slot_file.parse_appendices(body, pos, len(parsed.tokens), max_checkpoints)


def saved_state(parsed: slot_file.ParsedFile, plan: RestorePlan, tenant: str) -> SavedState:
    """The slot file as the saved state ``SlotStore.restore`` loads (untrusted), under the
    restoring request's ``tenant``: its state in the file's buffer, exact when its end is
    known; its appendices given when the plan parsed them, else left for later (the state
    is loaded alone, its appendices parsed off the engine thread from where it ended and
    given in a second restore, of the state ``InSlot``). Any thread."""
    # a known layout's cells were proven by plan_restore, in this same private buffer
    where = InBuffer(parsed.buf, parsed.state_off, plan.state_end, plan.known, plan.known)
    state = SavedState(list(parsed.tokens), where, tenant=tenant, extras=Extras.LATER)
    if plan.appendices is not None:
        slot_file.give_appendices(state, plan.appendices)
    return state
