"""What is proven of a slot file before the engine loads it (DESIGN §8). Any thread: the
routes run these on worker threads, never on the engine thread, so the engine only loads
what was read, checked and parsed here (``commands.RestoreSlot`` takes the plan)."""

from __future__ import annotations

from dataclasses import dataclass

from ..cache import slot_file
from ..cache.saved import Extras, InBuffer, SavedState
from .audit import kv_type_problem, seq_state_problem
from .backend_api import Backend


@dataclass
class RestorePlan:
    """What is known of a slot file before the engine loads it: where its state ends (the
    end of its appendices when unknown) and its appendices, parsed off the engine thread
    (None: the state's end is unknown, so they are parsed once the engine has loaded it)."""

    known: bool
    state_end: int
    appendices: SavedState | None  # the state's extras alone (slot_file.parse_appendices)


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
    return RestorePlan(True, end, app)


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
