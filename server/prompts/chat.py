"""The chat pipeline every chat-shaped API shares (OpenAI chat, Anthropic Messages,
Responses, /apply-template, the render and token-count endpoints): a body's messages as
the chat template takes them, its tools and reasoning plan (``plan_chat``), the rendered
prompt as tokens (``render_chat``) and its output constraint (``chat_constraint``).

Everything here runs on a request's preparation pool (``service.pools``), never on the
event loop: rendering and tokenizing a long history take a while, and ``checkpoint()``
stops a request whose client left between messages."""

from __future__ import annotations

import re

from ..cancel import checkpoint
from ..constrained import Constraint
from ..image_types import MediaError, PromptImage, image_placeholders
from ..media import media_scope
from ..media.image_inputs import NO_IMAGES, MediaInput, MediaLimits
from ..schemas.bodies import ChatRequest, ContentPart
from ..schemas.errors import APIError
from ..service.state import ServerState
from ..service.submit import Prompt
from ..service.tokenizer import control_tokens, tokenize, tokenize_at
from ..service.validation import constraint_of
from ..templates.chat_plan import ChatPlan
from ..templates.chat_plan import plan_chat as plan_tools
from ..templates.chat_template import (
    ROLES,
    ChatMessage,
    ChatTemplate,
    Continuation,
    Rendered,
    TemplateError,
    thinking_forced_open,
)
from ..templates.control_tokens import NO_CONTROL
from ..templates.tool_fields import ToolSpecError
from ..templates.tools_prompt import prepare


def _parts(parts: list[ContentPart], media: MediaInput | None, where: str) -> str:
    """A message's content parts as its text: text parts joined by newlines, each image
    part the projector's media marker where it goes (its bytes taken into ``media``; a
    400 without --mmproj)."""
    texts = []
    for j, part in enumerate(parts):
        at = f"{where}.content.{j}"
        if part.type == "text" and part.text is not None:
            texts.append(part.text)
        elif part.type == "image_url":
            if media is None:
                raise APIError(400, f"{at}: {NO_IMAGES}")
            url = part.image_url.get("url") if isinstance(part.image_url, dict) else part.image_url
            if not isinstance(url, str):
                raise APIError(400, f"{at}.image_url.url: a string is required")
            texts.append(media.add_url(url, at))
        else:
            raise APIError(400, f"unsupported content part type {part.type!r} (text, image_url)")
    return "\n".join(texts)


def chat_messages(req: ChatRequest, media: MediaInput | None = None) -> list[ChatMessage]:
    """The messages as the chat template takes them: text parts joined, developer as
    system, images as media markers (``_parts``)."""
    out = []
    for i, m in enumerate(req.messages):
        checkpoint()  # the client may have left: stop between messages
        if m.role not in ROLES:
            raise APIError(400, f"unknown role {m.role!r} in messages")
        if isinstance(m.content, list):
            content = _parts(m.content, media, f"messages.{i}")
        else:
            content = m.content or ""
        role = "system" if m.role == "developer" else m.role
        msg: ChatMessage = {"role": role, "content": content}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


def _continuation(
    st: ServerState, req: ChatRequest, messages: list[ChatMessage]
) -> tuple[Continuation | None, bool]:
    """Whether the final message is continued (and then taken off ``messages``), and whether
    the template opens the assistant turn, as llama-server decides: ``continue_final_message``
    (true, "content" or "reasoning_content"), else a final assistant message is continued
    (--prefill-assistant, on by default). APIError 400 for the combinations it refuses."""
    mode = req.continue_final_message
    add_gen = req.add_generation_prompt
    if mode is None and st.settings.prefill_assistant and messages[-1]["role"] == "assistant":
        if len(messages) >= 2 and messages[-2]["role"] == "assistant":
            raise APIError(400, "Cannot have 2 or more assistant messages at the end of the list.")
        mode, add_gen = True, False
    if not mode:
        return None, add_gen
    if add_gen:
        raise APIError(
            400, "Cannot set both add_generation_prompt and continue_final_message to true."
        )
    last, raw = messages.pop(), req.messages[-1]
    if last.get("tool_calls"):
        raise APIError(400, "Cannot continue an assistant message that contains tool calls.")
    # parts join with a blank line here (llama.cpp's render_content), with "\n" elsewhere
    if isinstance(raw.content, list):
        content = "\n\n".join(p.text or "" for p in raw.content)
    else:
        content = last["content"]
    reasoning = last.get("reasoning_content") or ""
    if mode is True:  # auto: the reasoning when there is nothing else to continue
        mode = "reasoning_content" if reasoning and not content else "content"
    return Continuation(content, reasoning, mode == "reasoning_content"), False


def template_of(st: ServerState) -> ChatTemplate:
    """The model's chat template; APIError 503 while no model is loaded (it comes with it)."""
    if st.template is None:
        raise APIError(503, "Loading model", "unavailable_error")
    return st.template


def media_limits(st: ServerState) -> MediaLimits | None:
    """The bounds of a request's images (None: no projector with vision, images refused)."""
    p, s = st.projector, st.settings
    if p is None or not p.vision:
        return None
    return MediaLimits(s.image_max_mib << 20, s.image_max_pixels, s.image_max_count, s.media_path)


def media_input(st: ServerState) -> MediaInput | None:
    """Where a request's images go while it renders (None: no projector, images refused)."""
    limits = media_limits(st)
    if limits is None or st.projector is None:
        return None
    return MediaInput(st.projector.marker, limits)


def render_prompt(
    st: ServerState, req: ChatRequest, plan: ChatPlan, media: MediaInput | None = None
) -> Rendered:
    """The chat template's rendering of ``req``: tools and tool history as ``plan`` says
    (server.templates.tools_prompt), a continued final message as ``_continuation`` says. APIError 400
    when the template rejects the messages, 500 when the template itself fails."""
    messages = chat_messages(req, media)
    continuation, add_gen = _continuation(st, req, messages)
    try:
        tpl = template_of(st)
        prepared = prepare(tpl, messages, plan.spec, plan.kwargs)
        return tpl.render_chat(
            prepared.messages,
            add_generation_prompt=add_gen,
            continuation=continuation,
            **prepared.extra,
        )
    except TemplateError as e:
        raise APIError(400 if e.client else 500, str(e)) from e


def render_chat(st: ServerState, req: ChatRequest, plan: ChatPlan) -> Prompt:
    """Prompt tokens and the token index where the last user turn starts (-1 if unknown).
    Whether the prompt leaves the answer inside an open reasoning tag is noted in
    ``plan.forced_open``."""
    b = st.require_backend()
    media = media_input(st)
    rendered = render_prompt(st, req, plan, media)
    plan.forced_open = rendered.in_reasoning or thinking_forced_open(rendered.prompt, plan.tags[0])
    text = rendered.prompt
    # Templates emit BOS themselves; tokenizing with add_special would add a second one.
    has_bos = bool(b.bos_text) and text.startswith(b.bos_text)
    if has_bos:
        text = text[len(b.bos_text) :]
    # the last user turn's offset in ``text``: tokenized in pieces (linear time, see
    # service.tokenizer), where a piece starts there its first token is the answer
    mark = rendered.last_user_offset - (len(b.bos_text) if has_bos else 0)
    if media is not None and media.images:
        return image_prompt(st, text, media.images, mark, media.wheres)
    tokens, at = tokenize_at(b, text, True, True, [mark] if mark > 0 else [])
    user_start = at.get(mark, -1)
    if rendered.last_user_offset > 0 and mark not in at:
        head = rendered.prompt[: rendered.last_user_offset]
        if has_bos:
            head = head[len(b.bos_text) :]
        head_tokens = tokenize(b, head, True, True)
        # The boundary counts only where the head tokenizes alike alone and within the
        # whole prompt (a token may straddle it).
        if tokens[: len(head_tokens)] == head_tokens:
            user_start = len(head_tokens)
    return Prompt(tokens, user_start)


_IMAGE_AT = re.compile(r"^image (\d+): ")


def _named(e: MediaError, wheres: list[str]) -> str:
    """The projector's message with "image N" named by its place in the body."""
    msg = str(e)
    m = _IMAGE_AT.match(msg)
    if m is None or int(m.group(1)) >= len(wheres) or not wheres[int(m.group(1))]:
        return msg
    return f"{wheres[int(m.group(1))]}: {msg[m.end() :]}"


def _flatten(st: ServerState, text: str, images: list[bytes], wheres: list[str]) -> Prompt:
    """The projector's pieces of ``text`` as one token list, each image as its
    placeholders (server.image_types.image_placeholders) and a PromptImage. 400 for an image the
    projector refuses, or one larger than a ubatch when its tokens attend both ways
    (llama.cpp would abort)."""
    assert st.projector is not None
    b = st.require_backend()
    scope = media_scope.current()
    tenant = scope.cache_scope if scope is not None else b""
    try:
        # checkpoint between images: a request whose client left stops within one image
        pieces = st.projector.tokenize(text, images, tenant, checkpoint)
    except MediaError as e:
        raise APIError(400, _named(e, wheres)) from None
    tokens: list[int] = []
    found: list[PromptImage] = []
    for piece in pieces:
        if isinstance(piece, list):
            tokens.extend(piece)
            continue
        room = b.n_ubatch if piece.non_causal else b.n_batch
        if piece.n_tokens > room:
            raise APIError(
                400,
                f"image {len(found)} takes {piece.n_tokens} tokens, more than one batch "
                f"({room}; raise --ubatch-size and --batch-size)",
            )
        found.append(PromptImage(len(tokens), piece))
        tokens.extend(image_placeholders(piece.identity, piece.n_tokens))
    return Prompt(tokens, -1, tuple(found))


def image_prompt(
    st: ServerState, text: str, images: list[bytes], mark: int = -1, wheres: list[str] | None = None
) -> Prompt:
    """A rendered prompt with images (``_flatten``), and where its last user turn starts
    (``mark``: its offset in ``text``): the head before it tokenized alone (its images come
    from the embedding cache now), counted where the whole prompt starts with it. 400 for
    a prompt ending in an image (its last position must be text). In a request's scope
    (server/media/media_scope.py) the images are decoded on the media lane only, their
    pixels held against the API key's budget (429 past it)."""
    wheres = wheres or []
    scope = media_scope.current()
    if scope is not None:
        scope.decoding()  # on a text lane: the work moves to the media lane, nothing decoded
    whole = _flatten(st, text, images, wheres)
    if not whole.tokens or whole.tokens[-1] < 0:
        raise APIError(400, "the prompt must not end with an image")
    if mark <= 0 or st.projector is None:
        return whole
    head_text = text[:mark]
    head = _flatten(st, head_text, images[: head_text.count(st.projector.marker)], wheres)
    n = len(head.tokens)
    user_start = n if 0 < n < len(whole.tokens) and whole.tokens[:n] == head.tokens else -1
    return Prompt(whole.tokens, user_start, whole.images)


def chat_token_count(st: ServerState, req: ChatRequest) -> int:
    """How many tokens ``req``'s prompt renders to (the count_tokens / input_tokens
    endpoints of every chat API): planned and rendered as a generation would be."""
    return len(render_chat(st, req, plan_chat(st, req)).tokens)


def plan_chat(st: ServerState, body: ChatRequest) -> ChatPlan:
    """The request's tools and reasoning handling; APIError 400 for malformed tool fields
    or a forced call together with another constraint on the output."""
    st.require_engine()  # the template comes with the model
    template = template_of(st)
    # Server defaults (llama-server's --reasoning-format, --chat-template-kwargs, -rea and
    # --reasoning-effort) under the request's own values.
    s = st.settings
    effort = s.reasoning_effort
    server_kwargs = dict(s.chat_template_kwargs or {})
    if s.reasoning != "auto":  # -rea on|off: the template's thinking switch
        server_kwargs.setdefault("enable_thinking", s.reasoning == "on")
    try:
        plan = plan_tools(
            template,
            tools=body.tools,
            tool_choice=body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            reasoning_format=body.reasoning_format,
            # llama-server's deepseek-legacy also keeps the tags in content: not done here
            default_reasoning_format=s.reasoning_format.replace("deepseek-legacy", "deepseek"),
            chat_template_kwargs={**server_kwargs, **(body.chat_template_kwargs or {})},
            reasoning_effort=body.reasoning_effort or effort,
            # the model's control tokens (none before a model is loaded: /apply-template)
            control=control_tokens(st.backend) if st.backend is not None else NO_CONTROL,
        )
    except ToolSpecError as e:
        raise APIError(400, str(e)) from None
    if plan.spec.forced and (body.response_format or body.json_schema or body.grammar):
        field = "response_format" if body.response_format else "json_schema or grammar"
        raise APIError(400, f"{field} cannot be combined with a forced tool_choice")
    return plan


def chat_constraint(plan: ChatPlan, body: ChatRequest) -> Constraint | None:
    """A chat request's constraint: the forced call's, else what its ``response_format``,
    ``json_schema`` or ``grammar`` asks for. Compiles the client's schema (in a compile
    child): call it from a worker thread (``Submission.constraint``)."""
    return _tool_constraint(plan) or constraint_of(
        response_format=body.response_format, json_schema=body.json_schema, grammar=body.grammar
    )


def _tool_constraint(plan: ChatPlan) -> Constraint | None:
    """The forced call's constraint (None unless tool_choice forces one)."""
    try:
        return plan.constraint()
    except ToolSpecError as e:
        raise APIError(400, str(e)) from None
