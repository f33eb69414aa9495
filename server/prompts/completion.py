"""The prompts of the completion-shaped APIs as tokens: OpenAI's /v1/completions
(``completion_prompts``), llama-server's /completion (``native_prompts``) and /infill
(``infill_prompts``), and the output limit a body asks for (``max_tokens_of``). Worker
threads only (``service.pools``): tokenizing a long prompt takes a while."""

from __future__ import annotations

from ..cancel import checkpoint
from ..media.image_inputs import MediaLimits, check_image, decode_base64
from ..schemas.bodies import InfillRequest
from ..schemas.errors import APIError
from ..service.state import ServerState
from ..service.submit import Prompt
from ..service.tokenizer import tokenize
from .chat import image_prompt, media_limits
from .completion_forms import multimodal_prompt, prompt_tokens
from .infill_prompt import InfillLimits, infill_prompt, is_mixed


def completion_prompts(st: ServerState, prompt: object) -> list[Prompt]:
    """A completions ``prompt`` (text, tokens, or a list of either) as one Prompt each; an
    object is llama-server's form (``{"prompt_string", "multimodal_data"}``: images)."""
    b = st.require_backend()
    if isinstance(prompt, dict):
        return native_prompts(st, [prompt])
    if isinstance(prompt, str):
        return [Prompt(tokenize(b, prompt, True, True))]
    if not prompt:
        raise APIError(400, "the prompt is empty")
    if not isinstance(prompt, list):  # the request's model refused it already
        raise APIError(400, "prompt must be a string or an array")
    if all(isinstance(x, int) for x in prompt):
        return [Prompt(list(prompt))]
    out = []
    for p in prompt:
        checkpoint()
        out.append(Prompt(tokenize(b, p, True, True) if isinstance(p, str) else list(p)))
    return out


def max_tokens_of(*values: int | None) -> int:
    """The first limit the client set, by precedence; -1 (no limit) if none."""
    for v in values:
        if v is not None:
            return v
    return -1


def native_prompts(st: ServerState, prompts: list[object]) -> list[Prompt]:
    """Each of llama-server's prompt forms (server.prompts.completion_forms) as tokens: text is tokenized with
    special tokens parsed, BOS where it opens the prompt; token ids are taken as they are."""
    b = st.require_backend()

    def tok(text: str, add_special: bool) -> list[int]:
        return tokenize(b, text, add_special, True)

    limits = media_limits(st)
    out = []
    for i, p in enumerate(prompts):
        checkpoint()
        mm = multimodal_prompt(p, limits.max_count) if limits is not None else None
        if mm is None:  # without a projector, prompt_tokens refuses multimodal_data
            out.append(Prompt(prompt_tokens(p, tok)))
        else:
            assert limits is not None
            out.append(_multimodal(st, mm[0], mm[1], limits, i))
    return out


def _multimodal(st: ServerState, text: str, data: list[str], limits: MediaLimits, i: int) -> Prompt:
    """A prompt string with its images (llama-server's ``multimodal_data``: base64, one per
    media marker), each bounded as a chat image is; BOS added as the model wants."""
    where = f"prompt.{i}.multimodal_data" if i else "multimodal_data"
    wheres = [f"{where}.{j}" for j in range(len(data))]
    images = [
        check_image(decode_base64(d, limits, at), limits, at)
        for d, at in zip(data, wheres, strict=True)
    ]
    if not images:  # no image: an ordinary text prompt
        return Prompt(tokenize(st.require_backend(), text, True, True))
    return image_prompt(st, text, images, wheres=wheres)


def infill_prompts(
    st: ServerState, body: InfillRequest, extra: list[dict[str, str]]
) -> list[Prompt]:
    """The FIM prompt: ``prompt`` (special tokens parsed, no BOS) goes after the prefix."""
    b = st.require_backend()
    lim = InfillLimits(
        n_batch=b.n_batch,
        n_predict=st.settings.n_predict,
        n_ctx=b.n_ctx_slot,
        spm=st.settings.spm_infill,
    )
    bos = b.bos_id if b.add_bos and b.bos_id >= 0 else None

    def tok(text: str, add_special: bool, parse_special: bool) -> list[int]:
        return tokenize(b, text, add_special, parse_special)

    prefix, suffix = body.input_prefix, body.input_suffix
    if not (is_mixed(prefix) and is_mixed(suffix)):  # check_infill_body refused it already
        raise APIError(400, '"input_prefix" and "input_suffix" must be strings or token arrays')
    tokens = tok(body.prompt if isinstance(body.prompt, str) else "", False, True)
    return [Prompt(infill_prompt(tok, b.fim, bos, prefix, suffix, extra, tokens, lim))]
