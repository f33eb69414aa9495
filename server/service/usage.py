"""What a finished request reports of its tasks: OpenAI's usage and finish_reason, and one
llama-server Timings over several choices."""

from __future__ import annotations

from ..json_value import JsonObject
from ..task import FinishReason, TaskResult, Timings


def merged_timings(results: list[TaskResult]) -> Timings:
    """One Timings for several choices: token counts add up; the choices ran in parallel, so
    the times are the longest one's."""
    t = Timings()
    for r in results:
        t.cache_n += r.timings.cache_n
        t.prompt_n += r.timings.prompt_n
        t.predicted_n += r.timings.predicted_n
        t.draft_n += r.timings.draft_n
        t.draft_n_accepted += r.timings.draft_n_accepted
        t.cache_reuse_n += r.timings.cache_reuse_n
        t.cache_reuse_chunks += r.timings.cache_reuse_chunks
        t.preempted += r.timings.preempted
        t.resumed_n += r.timings.resumed_n
        t.prompt_ms = max(t.prompt_ms, r.timings.prompt_ms)
        t.predicted_ms = max(t.predicted_ms, r.timings.predicted_ms)
    return t


def usage_of(results: list[TaskResult]) -> JsonObject:
    """OpenAI's ``usage`` object over every choice."""
    prompt = sum(r.n_prompt for r in results)
    completion = sum(r.timings.predicted_n for r in results)
    cached = sum(r.timings.cache_n for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def finish_reason(r: TaskResult) -> str:
    """OpenAI's finish_reason: "length" for a token limit or a full context, else "stop"."""
    return "length" if r.finish is FinishReason.LENGTH else "stop"
