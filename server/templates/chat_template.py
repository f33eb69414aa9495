"""Chat templates rendered in a sandboxed Jinja2 environment (CVE-2024-34359 was an unsandboxed one)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment
from typing_extensions import Required, TypedDict

from ..cancel import Cancelled, Watched

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Gemma has no system role: the system text opens the first user turn.
    "gemma": (
        "{{ bos_token }}"
        "{% set ns = namespace(system='') %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% set ns.system = ns.system + message['content'] + '\n\n' %}"
        "{% else %}"
        "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
        "{{ '<start_of_turn>' + role + '\n' }}"
        "{% if role == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
        "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}"
        "{% set ns = namespace(system='') %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
        "{% elif message['role'] == 'user' %}{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}{% set ns.system = '' %}"
        "{% elif message['role'] == 'tool' %}{{ '[TOOL_RESULTS]' + message['content'] + '[/TOOL_RESULTS]' }}"
        "{% else %}{{ message['content'] + eos_token }}{% endif %}"
        "{% endfor %}"
    ),
    # Cohere Command R (llama.cpp's LLM_CHAT_TEMPLATE_COMMAND_R): contents trimmed
    "command-r": (
        "{% set tokens = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>',"
        " 'assistant': '<|CHATBOT_TOKEN|>'} %}"
        "{% for message in messages %}{% if message['role'] in tokens %}"
        "{{ '<|START_OF_TURN_TOKEN|>' + tokens[message['role']] + message['content'] | trim"
        " + '<|END_OF_TURN_TOKEN|>' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}"
    ),
}

# GGUF architecture -> built-in template, for models whose metadata carries none.
ARCH_TEMPLATES = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3n": "gemma",
    "llama": "llama3",
    "mistral": "mistral",
}

ROLES = {"system", "user", "assistant", "tool", "developer", "function"}


class TemplateError(ValueError):
    """A template failed to render. ``client`` when the template itself rejected the messages
    (raise_exception, e.g. roles that do not alternate); otherwise the template is at fault
    (bad syntax, or it tried to escape the sandbox)."""

    def __init__(self, message: str, client: bool = False) -> None:
        super().__init__(message)
        self.client = client


class ChatMessage(TypedDict, total=False):
    """A message as the chat template takes it (``prompts.chat.chat_messages`` builds them
    from a checked request; ``templates.tools_prompt`` rewrites tool history)."""

    role: Required[str]
    content: str
    name: str
    tool_calls: Sequence[Mapping[str, object]]  # templates.tools_prompt.TemplateCall once rewritten
    tool_call_id: str
    reasoning_content: str


@dataclass
class Rendered:
    prompt: str
    # Character offset in ``prompt`` where the last user message's turn starts (-1 if none).
    last_user_offset: int
    # The prompt ends inside reasoning the answer continues (a continued reasoning_content).
    in_reasoning: bool = False


@dataclass(frozen=True)
class Continuation:
    """A final message continued rather than answered (llama-server's assistant prefill,
    vLLM's ``continue_final_message``). The messages before it are rendered with the
    assistant turn opened; ``content`` then starts the answer. ``in_reasoning`` continues
    its ``reasoning`` inside the template's thinking block instead."""

    content: str
    reasoning: str = ""
    in_reasoning: bool = False


def thinking_forced_open(prompt: str, open_tag: str = "<think>") -> bool:
    """The template ended the prompt inside an open reasoning tag (``open_tag``: the
    template's own, e.g. Command R7B's ``<|START_THINKING|>``): the output starts in the
    reasoning (DeepSeek R1, Qwen3 with thinking, ...)."""
    return prompt.rstrip().endswith(open_tag)


class _ConcatUndefined(jinja2.Undefined):
    """An undefined variable joined to a string is the empty string, as in llama.cpp's Jinja
    (FireFunction v2 adds ``functions``, which only some callers define)."""

    def __add__(self, other: Any) -> Any:  # jinja2.Undefined.__add__: (*args: Any) -> Never
        return other if isinstance(other, str) else super().__add__(other)

    def __radd__(self, other: Any) -> Any:
        return other if isinstance(other, str) else super().__radd__(other)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (Hugging Face's marker of the assistant
    text for training masks; LFM2.5, Laguna use it): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


_LIST_METHODS = frozenset({"append", "pop", "extend", "insert"})


class _Sandbox(ImmutableSandboxedEnvironment):
    """Immutable, but for lists' append/pop/extend/insert: templates build lists (Kimi K2), as
    llama.cpp's Jinja lets them. Templates are the operator's, never a client's; what they
    append to lives for one rendering."""

    def is_safe_attribute(self, obj: object, attr: str, value: object) -> bool:
        if isinstance(obj, list) and attr in _LIST_METHODS:
            return SandboxedEnvironment.is_safe_attribute(self, obj, attr, value)
        return super().is_safe_attribute(obj, attr, value)


def _json_default(o: object) -> object:
    """``tojson`` of what Jinja makes lazily (``map`` gives a generator: llama.cpp's Jinja a
    list) and of undefined values (null)."""
    if isinstance(o, jinja2.Undefined):
        return None
    if isinstance(o, Iterator):
        return list(o)
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def _date_context() -> dict[str, str]:
    """Today's date in the variables llama.cpp gives every template (common_chat_extra_context):
    Llama 3.x prints ``date_string``, FireFunction ``datetime``."""
    now = datetime.datetime.now()
    return {"datetime": now.strftime("%b %d %Y"), "date_string": now.strftime("%d %b %Y")}


def _raise(msg: str) -> None:
    raise TemplateError(f"chat template rejected the messages: {msg}", client=True)


class ChatTemplate:
    def __init__(
        self, source: str, bos_token: str = "", eos_token: str = "", name: str = ""
    ) -> None:
        self.source = source
        self.name = name or "custom"
        self.bos_token = bos_token
        self.eos_token = eos_token
        # loopcontrols ({% break %}, {% continue %}): Hugging Face renders with it, and
        # templates use it (Command R7B, Kimi K3, ...)
        env = _Sandbox(
            undefined=_ConcatUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
            autoescape=False,
            extensions=["jinja2.ext.loopcontrols", _Generation],
        )
        env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(
            v, ensure_ascii=False, indent=indent, default=_json_default
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._tpl = env.from_string(source)
            # the variables the template reads (``tools`` marks Hugging Face tool support)
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template does not parse: {e}") from e

    def render(
        self,
        messages: Sequence[Mapping[str, object]],
        add_generation_prompt: bool = True,
        **extra: object,
    ) -> str:
        try:
            return self._tpl.render(
                # iterating checks the request's cancellation before each message
                messages=Watched(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **{**_date_context(), **extra},
            )
        except SecurityError as e:
            raise TemplateError(f"chat template tried an unsafe operation: {e}") from e
        except (TemplateError, Cancelled):
            raise
        except Exception as e:  # jinja UndefinedError, TypeError inside the template, ...
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

    def render_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        add_generation_prompt: bool = True,
        continuation: Continuation | None = None,
        **extra: object,
    ) -> Rendered:
        """Render, also locating where the last user turn begins (a checkpoint position):
        the rendered prefix before it is the rendering of the messages before it. With a
        ``continuation`` (its message not in ``messages``) the assistant turn is opened and
        the continued text follows it, without the turn's end."""
        text = self.render(
            messages, add_generation_prompt=add_generation_prompt or bool(continuation), **extra
        )
        in_reasoning = False
        if continuation is not None:
            tail, in_reasoning = self._continued(text, continuation)
            text += tail
        last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
        offset = -1
        if last_user > 0:
            try:
                head = self.render(messages[:last_user], add_generation_prompt=False, **extra)
            except TemplateError:
                head = ""
            if head and text.startswith(head):
                offset = len(head)
        return Rendered(text, offset, in_reasoning)

    def _continued(self, prompt: str, c: Continuation) -> tuple[str, bool]:
        """What follows the opened assistant turn ``prompt`` to continue ``c``, and whether
        the answer then goes on inside the reasoning. Where the template opened a thinking
        block, continued content comes after the (closed) reasoning, as the template writes
        an answer's; TemplateError (client) where there is no reasoning to continue."""
        opened = thinking_forced_open(prompt)
        if c.in_reasoning:
            if opened:
                return c.reasoning, True
            if "<think>" in self.source:
                return "<think>\n" + c.reasoning, True
            raise TemplateError(
                "chat template rejected the messages: it has no reasoning block to continue "
                "the final message's reasoning_content in",
                client=True,
            )
        if opened:
            reasoning = c.reasoning.rstrip("\n")
            return (reasoning + "\n" if reasoning else "") + "</think>\n\n" + c.content, False
        return c.content, False


def pick_template(
    *,
    name: str | None,
    file: str | None,
    model_template: str | None,
    architecture: str,
    bos_token: str,
    eos_token: str,
    jinja: bool = True,
) -> ChatTemplate:
    """--chat-template-file, then --chat-template NAME, then the model's own, then by architecture.

    With ``jinja`` off (--no-jinja) no Jinja template from a file, the flag or the model is
    rendered: as llama-server does, the built-in template that template is recognised as is
    used (by its markers; failing that, by the model's architecture)."""
    if not jinja:
        builtin = _builtin_for(name, file, model_template, architecture)
        return ChatTemplate(BUILTIN_TEMPLATES[builtin], bos_token, eos_token, name=builtin)
    if file:
        with open(file, encoding="utf-8") as f:
            return ChatTemplate(f.read(), bos_token, eos_token, name=file)
    if name:
        if name in BUILTIN_TEMPLATES:
            return ChatTemplate(BUILTIN_TEMPLATES[name], bos_token, eos_token, name=name)
        # llama-server also accepts a template body here
        if "{%" in name or "{{" in name:
            return ChatTemplate(name, bos_token, eos_token, name="inline")
        raise ValueError(
            f"unknown chat template {name!r}; built-ins: {', '.join(BUILTIN_TEMPLATES)}"
        )
    if model_template:
        return ChatTemplate(model_template, bos_token, eos_token, name="model")
    builtin = ARCH_TEMPLATES.get(architecture, "chatml")
    return ChatTemplate(BUILTIN_TEMPLATES[builtin], bos_token, eos_token, name=builtin)


# Markers that identify a Jinja template as one of the built-ins (llama.cpp's
# llm_chat_detect_template does the same for --no-jinja).
_MARKERS = (
    ("<start_of_turn>", "gemma"),
    ("<|start_header_id|>", "llama3"),
    ("<|im_start|>", "chatml"),
    ("[INST]", "mistral"),
    ("<|START_OF_TURN_TOKEN|>", "command-r"),
)


def _builtin_for(
    name: str | None, file: str | None, model_template: str | None, architecture: str
) -> str:
    """--no-jinja: the name of the built-in template to render instead."""
    if name in BUILTIN_TEMPLATES:
        builtin = name
    else:
        source = name or model_template or ""
        if file:
            with open(file, encoding="utf-8") as f:
                source = f.read()
        found = [b for marker, b in _MARKERS if marker in source]
        if (name or file) and not found:  # only the model's own falls back, as there
            raise ValueError(
                f"--no-jinja: chat template {file or name!r} is none of the built-ins "
                f"({', '.join(BUILTIN_TEMPLATES)})"
            )
        builtin = found[0] if found else ARCH_TEMPLATES.get(architecture, "chatml")
    return builtin
