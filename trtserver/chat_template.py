"""Chat templates: which one a model uses, rendering it as transformers does, and its token ids.

Rendering follows ``transformers.utils.chat_template_utils``: jinja2's
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the ``loopcontrols``
extension and the ``{% generation %}`` tag, the ``tojson`` filter that does not escape HTML
(``ensure_ascii=False``, ``indent``, ``separators``, ``sort_keys``), and the globals
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``. A template sees ``messages``,
``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) and the request's ``chat_template_kwargs``.

Interface::

    template = resolve_chat_template(config, pm, tokenizer)      # at start-up; None: the model has none
    template = require_chat_template(template)                   # per chat request; 400 naming --chat-template
    text = template.render(messages, tools=..., add_generation_prompt=True,
                           continue_final_message=False, kwargs=request.chat_template_kwargs)
    prompt_token_ids = template_token_ids(text, tokenizer)

``messages`` are OpenAI-shaped dicts. ``content`` may be a string, None, or a list of text parts:
for a template that treats content as a string the parts are joined with newlines (as vLLM does),
for one that iterates over content they stay a list of ``{"type": "text", "text": ...}``. A
function call's ``arguments`` JSON string becomes a dict, which is what templates expect.
Every failure a request can cause (``raise_exception``, undefined values, sandbox violations,
syntax errors in a template given with the request) is an ``InvalidRequest`` (400).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trtserver.errors import InvalidRequest

if TYPE_CHECKING:
    import pluggy

    from trtserver.config import ServerConfig
    from trtserver.tokenizer import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"
"""The template's file in an engine directory (and in Hugging Face checkpoints)."""

RESERVED_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                            "bos_token", "eos_token", "raise_exception", "strftime_now"})
"""Template variables a request's ``chat_template_kwargs`` may not set."""

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(InvalidRequest):
    """A template that cannot be compiled or rendered with the request's messages."""

    code = "chat_template_error"


class ChatTemplateMissing(InvalidRequest):
    code = "chat_template_missing"

    def __init__(self) -> None:
        super().__init__(
            "This model has no chat template, so /v1/chat/completions cannot turn messages into a prompt; "
            "start the server with --chat-template FILE|STRING, or use /v1/completions"
        )


class ChatTemplateConfigError(ValueError):
    """A template chosen at start-up (``--chat-template``, a plugin, the engine directory) that does not compile."""


class TemplateRaised(jinja2.TemplateError):
    """What a template's ``raise_exception(message)`` raises."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` in a template, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attributes (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's own signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _environment()


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error at line {exc.lineno}: {exc.message}",
                                param="chat_template") from exc


class ChatTemplate:
    """One compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str] | None = None,
                 origin: str = "text") -> None:
        self.source = source
        self.origin = origin
        """Where it came from, for logs: ``--chat-template``, ``plugin``, a file path."""
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(source)  # raises ChatTemplateError
        self.content_as_parts = _loops_over_content(source)
        """True when the template iterates over a message's content: it then gets lists of text parts."""

    @classmethod
    def from_text(cls, source: str, *, special_tokens: Mapping[str, str] | None = None,
                  origin: str = "text") -> ChatTemplate:
        return cls(source, special_tokens=special_tokens, origin=origin)

    @classmethod
    def for_tokenizer(cls, source: str, tokenizer: Tokenizer, *, origin: str = "text") -> ChatTemplate:
        return cls(source, special_tokens=tokenizer.special_tokens, origin=origin)

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, {len(self.source)} chars)"

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = False,
               continue_final_message: bool = False, kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text for ``messages``; raise ``InvalidRequest`` for anything the request caused."""
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true",
                                 param="continue_final_message")
        extra = {str(name): _plain(value) for name, value in (kwargs or {}).items()}
        reserved = sorted(RESERVED_NAMES.intersection(extra))
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: "
                                 "use the request's own fields", param="chat_template_kwargs")
        chat = template_messages(messages, content_as_parts=self.content_as_parts)
        final_text: str | None = None
        if continue_final_message:
            final_text = _tag_final_message(chat)
        variables = {**self.special_tokens, **extra, "messages": chat, "tools": _plain(tools),
                     "documents": _plain(documents),
                     "add_generation_prompt": add_generation_prompt}
        try:
            text = self._template.render(**variables)
        except TemplateRaised as exc:
            raise ChatTemplateError(str(exc.message), param="messages") from exc
        except Exception as exc:  # undefined values, sandbox violations, a template's own bugs: never a 500
            raise ChatTemplateError(f"chat template failed on these messages: {type(exc).__name__}: {exc}",
                                    param="messages") from exc
        if final_text is not None:
            text = _cut_after_final_message(text, final_text)
        return text


@lru_cache(maxsize=32)
def _loops_over_content(source: str) -> bool:
    """Whether the template has ``{% for ... in message['content'] %}`` (or ``message.content``), as vLLM detects
    templates that take OpenAI's list of content parts rather than one string."""
    for loop in _ENV.parse(source).find_all(jinja2.nodes.For):
        target = loop.iter
        while isinstance(target, jinja2.nodes.Filter) and target.node is not None:  # message.content | list
            target = target.node
        if isinstance(target, jinja2.nodes.Getattr) and target.attr == "content":
            return True
        if isinstance(target, jinja2.nodes.Getitem) and isinstance(target.arg, jinja2.nodes.Const) \
                and target.arg.value == "content":
            return True
    return False


def require_chat_template(template: ChatTemplate | None) -> ChatTemplate:
    """The served model's template, or the 400 that names ``--chat-template``."""
    if template is None:
        raise ChatTemplateMissing()
    return template


# --- messages as templates see them ---------------------------------------------------------


def template_messages(messages: Sequence[Mapping[str, Any]], *, content_as_parts: bool) -> list[dict[str, Any]]:
    """OpenAI-shaped messages -> plain dicts: None-valued keys dropped (as transformers does), content joined
    or kept as text parts, tool-call arguments decoded from their JSON string, reasoning aliased."""
    out = []
    for position, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"messages[{position}] is not an object", param="messages")
        plain = {str(key): _plain(value) for key, value in message.items() if value is not None}
        plain["content"] = _content(message.get("content"), position, as_parts=content_as_parts)
        calls = plain.get("tool_calls")
        if isinstance(calls, list):
            plain["tool_calls"] = [_decoded_arguments(call) for call in calls]
        reasoning = next((plain[key] for key in _REASONING_FIELDS if plain.get(key) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


def _content(content: Any, position: int, *, as_parts: bool) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if as_parts else content
    if content is None:
        return [] if as_parts else ""
    if not isinstance(content, list):
        raise InvalidRequest(f"messages[{position}].content must be a string or a list of parts",
                             param="messages")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        text = part.get("text") if isinstance(part, Mapping) else None
        if kind not in ("text", None) or not isinstance(text, str):
            raise InvalidRequest(f"messages[{position}].content has a {kind or 'malformed'} part; "
                                 "this model takes text parts only", param="messages")
        texts.append(text)
    return [{"type": "text", "text": text} for text in texts] if as_parts else "\n".join(texts)


def _decoded_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call  # not JSON: the template gets the text as it was sent
        return {**call, "function": {**function, "arguments": arguments}}
    return call


def _plain(value: Any) -> Any:
    """Only JSON types reach the sandbox (subclasses could carry methods it does not know to refuse)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return f"<{type(value).__name__}>"


def _tag_final_message(chat: list[dict[str, Any]]) -> str:
    """Mark the end of the last message's text, so the render can be cut there; return that text."""
    if not chat:
        raise InvalidRequest("continue_final_message needs at least one message", param="continue_final_message")
    final = chat[-1]
    content = final.get("content")
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part.get("text"), str):
                text = str(part["text"])
                part["text"] = text + _CONTINUE_TAG
                return text
        raise InvalidRequest("continue_final_message: the final message has no text to continue",
                             param="continue_final_message")
    text = str(content)
    final["content"] = text + _CONTINUE_TAG
    return text


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if tag not in rendered or final_text.strip() not in rendered:
        raise InvalidRequest("continue_final_message: this chat template does not render the final message's "
                             "content as given, so it cannot be continued", param="continue_final_message")
    at = rendered.rindex(tag)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message: the trailing space went with it


# --- token ids ------------------------------------------------------------------------------


def template_token_ids(text: str, tokenizer: Tokenizer) -> list[int]:
    """Token ids of rendered chat text: special tokens in the text become their single ids, and BOS is
    added where the tokenizer adds it, unless the template already put it at the start."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos_token and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


# --- which template ---------------------------------------------------------------------------


def read_engine_dir_template(engine_dir: str | Path) -> tuple[str, str] | None:
    """(template text, where it was found) from an engine directory, or None.

    The manifest's ``chat_template`` names the file; directories built without that key (and Hugging
    Face checkpoint directories) are read where transformers looks: ``chat_template.jinja``, then
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates: ``default``).
    """
    from trtserver.manifest import ManifestError, load_manifest

    path = Path(engine_dir)
    try:
        named = load_manifest(path).chat_template
    except ManifestError:
        named = None
    file = path / (named or TEMPLATE_FILE)
    config_path = path / "tokenizer_config.json"
    try:
        if named is not None or file.is_file():
            return file.read_text(encoding="utf-8"), str(file)
        if not config_path.is_file():
            return None
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ChatTemplateConfigError(f"cannot read the chat template of {path}: {exc}") from exc
    text = template_from_tokenizer_config(config) if isinstance(config, dict) else None
    return None if text is None else (text, f"{config_path} chat_template")


def template_from_tokenizer_config(config: Mapping[str, Any]) -> str | None:
    """``chat_template`` of a ``tokenizer_config.json``: a string, or ``[{"name", "template"}]`` (take ``default``)."""
    value = config.get("chat_template")
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, Mapping)}
        default = named.get("default")
        return default if isinstance(default, str) and default else None
    return None


def chat_template_option(value: str) -> tuple[str, str]:
    """``--chat-template FILE|STRING``: (template text, origin). A value naming an existing file is read."""
    try:
        path = Path(value)
        is_file = path.is_file()
    except (OSError, ValueError):  # a long template is no valid path
        is_file = False
    if is_file:
        return path.read_text(encoding="utf-8"), str(path)
    return value, "--chat-template"


def resolve_chat_template(config: ServerConfig, pm: pluggy.PluginManager, tokenizer: Tokenizer, *,
                          engine_dir: str | Path | None = None) -> ChatTemplate | None:
    """The template chat requests use, chosen once at start-up: ``--chat-template``, else the first plugin
    answering ``trtserver_chat_template``, else the engine directory's; None when there is none.

    Raises ``ChatTemplateConfigError`` naming the source when the chosen template does not compile.
    """
    found = read_engine_dir_template(engine_dir if engine_dir is not None else config.engine_path)
    model_template = found[0] if found else None
    if config.chat_template is not None:
        source, origin = chat_template_option(config.chat_template)
    else:
        answer = pm.hook.trtserver_chat_template(config=config, model_template=model_template)
        if answer is not None:
            if not isinstance(answer, str):
                raise ChatTemplateConfigError(f"trtserver_chat_template returned {type(answer).__name__}, not str")
            source, origin = answer, "plugin"
        elif found is not None:
            source, origin = found
        else:
            return None
    try:
        return ChatTemplate.for_tokenizer(source, tokenizer, origin=origin)
    except ChatTemplateError as exc:
        raise ChatTemplateConfigError(f"chat template from {origin}: {exc.message}") from exc
