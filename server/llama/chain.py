"""A request's llama.cpp sampler chain, built as llama-server's ``common_sampler`` builds it:
logit bias, then the stages of ``SamplingParams.samplers`` in that order (penalties, DRY,
top-n-sigma, top-k, typical, top-p, min-p, XTC, temperature with its dynamic range, infill),
then the pick: a seeded dist, greedy at temperature 0, or adaptive_p when ``samplers``
names it. Mirostat 1 and 2 replace the stages: bias, temperature, mirostat. Stages that
change nothing are left out (``SamplingParams.stages``)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp as L

from ..task import SamplingParams

# accepting a token changes these stages (they remember recent tokens, or mirostat's mu)
STATEFUL = frozenset({"penalties", "dry", "mirostat", "adaptive_p"})


@dataclass(frozen=True)
class ChainEnv:
    """What a chain needs of the model: its vocabulary, the slot's context (a window of -1
    means all of it) and the server's seed (-1: random)."""

    vocab: L.llama_vocab_p
    n_vocab: int
    n_ctx: int
    seed: int


@dataclass
class Chain:
    """A built chain: ``ptr`` (the caller frees it), whether accepting tokens changes it,
    and whether it is an argmax after at most a logit bias."""

    ptr: L.llama_sampler_p
    stateful: bool
    greedy: bool


def _seed(p: SamplingParams, env: ChainEnv) -> int:
    seed = p.seed if p.seed >= 0 else (env.seed if env.seed >= 0 else 0xFFFFFFFF)
    return seed & 0xFFFFFFFF


def _window(n: int, env: ChainEnv) -> int:
    return env.n_ctx if n < 0 else n


def _penalties(p: SamplingParams, env: ChainEnv, history: list[int]) -> L.llama_sampler_p:
    last_n = _window(p.repeat_last_n, env)
    s = L.llama_sampler_init_penalties(
        env.n_vocab, last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
    )
    for t in history[-last_n:]:
        L.llama_sampler_accept(s, t)
    return s


def _dry(p: SamplingParams, env: ChainEnv, history: list[int]) -> L.llama_sampler_p:
    last_n = _window(p.dry_penalty_last_n, env)
    raw = [b.encode() for b in p.dry_sequence_breakers]
    arr = (ctypes.c_char_p * max(1, len(raw)))(*raw)
    s = L.llama_sampler_init_dry(
        env.vocab, p.dry_multiplier, p.dry_base, p.dry_allowed_length, last_n, arr, len(raw)
    )
    # as llama-server, the prompt counts: a repeat that began there is penalized
    for t in history[-last_n:]:
        L.llama_sampler_accept(s, t)
    return s


def _stage(name: str, p: SamplingParams, env: ChainEnv, history: list[int]) -> L.llama_sampler_p:
    """The llama_sampler of one stage of ``SamplingParams.stages``."""
    if name == "penalties":
        return _penalties(p, env, history)
    if name == "dry":
        return _dry(p, env, history)
    if name == "top_n_sigma":
        return L.llama_sampler_init_top_n_sigma(p.top_n_sigma)
    if name == "top_k":
        return L.llama_sampler_init_top_k(p.top_k)
    if name == "typ_p":
        return L.llama_sampler_init_typical(p.typical_p, p.min_keep)
    if name == "top_p":
        return L.llama_sampler_init_top_p(p.top_p, max(1, p.min_keep))
    if name == "min_p":
        return L.llama_sampler_init_min_p(p.min_p, max(1, p.min_keep))
    if name == "xtc":
        return L.llama_sampler_init_xtc(
            p.xtc_probability, p.xtc_threshold, p.min_keep, _seed(p, env)
        )
    if name == "temperature":
        if p.mirostat or p.dynatemp_range <= 0.0:  # (temp_ext is temp without a range)
            return L.llama_sampler_init_temp(p.temperature)
        return L.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range, p.dynatemp_exponent)
    if name == "mirostat":
        if p.mirostat == 1:
            return L.llama_sampler_init_mirostat(
                env.n_vocab, _seed(p, env), p.mirostat_tau, p.mirostat_eta, 100
            )
        return L.llama_sampler_init_mirostat_v2(_seed(p, env), p.mirostat_tau, p.mirostat_eta)
    if name == "infill":
        return L.llama_sampler_init_infill(env.vocab)
    raise ValueError(f"unknown sampler stage {name!r}")


def _pick(p: SamplingParams, env: ChainEnv) -> L.llama_sampler_p | None:
    """The chain's final stage (none after mirostat, which picks itself)."""
    if p.mirostat:
        return None
    if p.temperature <= 0.0:
        return L.llama_sampler_init_greedy()
    if "adaptive_p" in p.samplers:
        return L.llama_sampler_init_adaptive_p(p.adaptive_target, p.adaptive_decay, _seed(p, env))
    return L.llama_sampler_init_dist(_seed(p, env))


def build_chain(p: SamplingParams, env: ChainEnv, history: list[int]) -> Chain:
    """``p``'s chain; ``history`` (the prompt's recent tokens) seeds the penalty and DRY
    windows."""
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    add = L.llama_sampler_chain_add
    if p.logit_bias:
        arr = (L.llama_logit_bias * len(p.logit_bias))()
        for i, (tok, bias) in enumerate(p.logit_bias.items()):
            arr[i] = L.llama_logit_bias(tok, bias)
        add(chain, L.llama_sampler_init_logit_bias(env.n_vocab, len(p.logit_bias), arr))
    stages = p.stages()
    for name in stages:
        add(chain, _stage(name, p, env, history))
    last = _pick(p, env)
    if last is not None:
        add(chain, last)
    names = set(stages) | ({"adaptive_p"} if "adaptive_p" in p.samplers else set())
    stateful = bool(names & STATEFUL)
    return Chain(chain, stateful, greedy=p.temperature <= 0.0 and not stages)
