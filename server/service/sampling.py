"""A request's sampler settings over the server's defaults: the sampling fields, logit bias
(llama-server's forms, checked), and stop strings."""

from __future__ import annotations

from ..engine_api import Tokenizer
from ..json_value import JsonObject
from ..schemas.bodies import SamplingFields
from ..schemas.errors import APIError
from ..settings.config import Settings
from ..task import SamplingParams, sampler_order

SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "xtc_probability",
    "xtc_threshold",
    "typical_p",
    "top_n_sigma",
    "dynatemp_range",
    "dynatemp_exponent",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "adaptive_target",
    "adaptive_decay",
)


def default_sampling(s: Settings | None) -> SamplingParams:
    """The server's default sampler settings: llama-server's, or those of the flags
    (--temp, --top-k, ..., --samplers, -s) when ``s`` is given."""
    if s is None:
        return SamplingParams()
    p = SamplingParams(**{name: getattr(s, name) for name in SAMPLING_FIELDS})
    if s.sampler_seq is not None:
        p.samplers = sampler_order(s.sampler_seq)
    elif s.samplers is not None:
        p.samplers = sampler_order(s.samplers.split(";"))
    if s.dry_sequence_breakers is not None:  # llama-server's "none": no breakers
        p.dry_sequence_breakers = tuple(b for b in s.dry_sequence_breakers if b != "none")
    return p


def sampling_from(
    req: SamplingFields, backend: Tokenizer, settings: Settings | None = None
) -> SamplingParams:
    """The request's sampler settings over the server defaults (``default_sampling``): a field
    the request leaves out (or sets to null) gets the default. APIError 400 for a top_k above
    the vocabulary, a bad logit_bias, or backend_sampling asked of a server without -bs."""
    p = default_sampling(settings)
    for name in SAMPLING_FIELDS:
        v = getattr(req, name)
        if v is not None:
            setattr(p, name, v)
    if p.top_k > backend.n_vocab:
        raise APIError(400, f"top_k must be at most the vocabulary size ({backend.n_vocab})")
    if req.logit_bias:
        p.logit_bias = _logit_bias(req.logit_bias, backend)
    if req.samplers is not None:
        p.samplers = sampler_order(req.samplers)  # checked by the schema: no ValueError
    if req.dry_sequence_breakers is not None:
        p.dry_sequence_breakers = tuple(req.dry_sequence_breakers)
    if req.min_keep is not None:
        p.min_keep = req.min_keep
    if req.backend_sampling is not None:
        if req.backend_sampling and settings is not None and not settings.backend_sampling:
            raise APIError(400, "backend_sampling needs a server started with -bs")
        p.backend_ok = req.backend_sampling
    return p


def _logit_bias(raw: JsonObject | list[list[object]], backend: Tokenizer) -> dict[int, float]:
    """llama-server's logit_bias forms as token -> bias: ``[[tok, bias], ...]`` or
    ``{"tok": bias}``, where ``tok`` is a token id or a text whose every token (tokenized
    without BOS) gets the bias, and ``false`` as the bias bans the token. Unlike there, an
    entry that is not a pair, a bias that is neither a number nor false, an id outside the
    vocabulary or a bias outside [-100, 100] is a 400, never silently skipped."""
    if isinstance(raw, dict):
        items: list[tuple[object, object]] = list(raw.items())
    else:
        if not all(isinstance(x, list) and len(x) == 2 for x in raw):
            raise APIError(400, "logit_bias entries must be [token, bias] pairs")
        items = [(x[0], x[1]) for x in raw]
    out: dict[int, float] = {}
    for k, v in items:
        bias = _bias_value(v)
        if bias is None:
            raise APIError(400, f"logit_bias value for {k!r} must be a number or false")
        if bias != bias or (abs(bias) > 100 and bias != float("-inf")):
            raise APIError(400, f"logit_bias value for {k!r} must be within [-100, 100]")
        for tok in _bias_tokens(k, backend, isinstance(raw, dict)):
            out[tok] = bias
    return out


def _bias_value(v: object) -> float | None:
    """A logit_bias value as a float (``false``: -inf), None when it is neither."""
    if v is False:
        return float("-inf")
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _bias_tokens(key: object, backend: Tokenizer, from_dict: bool) -> list[int]:
    """The tokens one logit_bias key names: an id (a whole decimal string in the object
    form), or the tokens of a text. APIError 400 for an id outside the vocabulary."""
    tok: int | None = None
    if isinstance(key, int) and not isinstance(key, bool):
        tok = key
    elif isinstance(key, str) and from_dict:
        try:
            tok = int(key)
        except ValueError:
            tok = None
    if tok is None:
        if not isinstance(key, str):
            return []
        return backend.tokenize(key, False, False)
    if not 0 <= tok < backend.n_vocab:
        raise APIError(
            400, f"logit_bias token {tok} is outside the vocabulary (0..{backend.n_vocab - 1})"
        )
    return [tok]


def stops_from(req: SamplingFields) -> list[str]:
    """``stop`` as a list (a single string is one stop string)."""
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)
