"""What a guided-decoding backend is asked to compile, independent of the request's wire shape.

``guide_spec_from_request`` reads every way a client can ask for constrained output (vLLM's
``guided_*`` fields, the newer ``structured_outputs`` object and ``response_format``) and returns
one ``GuideSpec``, which the backend the request names (registered through
``trtserver_register_guided_backends``) compiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import msgspec

from trtserver.errors import InvalidRequest

if TYPE_CHECKING:
    from trtserver.protocol import GenerationFields
    from trtserver.tokenizer import Tokenizer

GuideKind = Literal["json", "json_object", "regex", "choice", "grammar"]
DEFAULT_BACKEND = "xgrammar"


@dataclass(frozen=True, slots=True)
class GuideSpec:
    """One constraint. ``value`` is the JSON schema text (key order as the client sent it), the
    regex, the grammar (EBNF / GBNF / Lark, as the backend understands it), or, for ``choice``,
    a tuple of strings; for ``json_object`` it is empty."""

    kind: GuideKind
    value: str | tuple[str, ...]
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False

    @property
    def cache_key(self) -> tuple[object, ...]:
        return (self.kind, self.value, self.whitespace_pattern, self.disable_any_whitespace)


@dataclass(frozen=True, slots=True)
class GuideContext:
    """What a backend needs to know about the model to compile a guide."""

    tokenizer: Tokenizer
    vocab_size: int  # width of the logits row; may exceed the tokenizer's vocabulary
    eos_token_ids: tuple[int, ...]
    compile_timeout_s: float = 30.0
    extra: dict[str, object] = field(default_factory=dict)


def _schema_text(value: object, param: str) -> str:
    if isinstance(value, str):
        try:
            msgspec.json.decode(value)
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"{param} is not valid JSON: {exc}", param=param) from exc
        return value
    if isinstance(value, msgspec.Raw):
        return bytes(value).decode()
    return msgspec.json.encode(value).decode()


def guide_spec_from_request(request: GenerationFields) -> tuple[GuideSpec, str] | None:
    """The request's guide and backend name, or None when it asks for no constraint."""
    found: list[tuple[str, GuideSpec]] = []
    ws = request.guided_whitespace_pattern
    if request.guided_json is not None:
        found.append(("guided_json", GuideSpec("json", _schema_text(request.guided_json, "guided_json"), ws)))
    if request.guided_regex is not None:
        found.append(("guided_regex", GuideSpec("regex", request.guided_regex, ws)))
    if request.guided_choice is not None:
        found.append(("guided_choice", GuideSpec("choice", tuple(request.guided_choice), ws)))
    if request.guided_grammar is not None:
        found.append(("guided_grammar", GuideSpec("grammar", request.guided_grammar, ws)))
    backend = request.guided_decoding_backend
    so = request.structured_outputs
    if so is not None:
        pattern = so.whitespace_pattern or ws
        plain = so.disable_any_whitespace
        if so.json is not None:
            found.append(("structured_outputs.json",
                          GuideSpec("json", _schema_text(so.json, "structured_outputs.json"), pattern, plain)))
        if so.regex is not None:
            found.append(("structured_outputs.regex", GuideSpec("regex", so.regex, pattern, plain)))
        if so.choice is not None:
            found.append(("structured_outputs.choice", GuideSpec("choice", tuple(so.choice), pattern, plain)))
        if so.grammar is not None:
            found.append(("structured_outputs.grammar", GuideSpec("grammar", so.grammar, pattern, plain)))
        if so.json_object:
            found.append(("structured_outputs.json_object", GuideSpec("json_object", "", pattern, plain)))
        backend = so.backend or backend
    rf = request.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", GuideSpec("json_object", "", ws)))
        elif rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequest("response_format json_schema needs json_schema.schema",
                                 param="response_format.json_schema")
        else:
            found.append(("response_format",
                          GuideSpec("json", _schema_text(rf.json_schema.schema_, "response_format"), ws)))
    if not found:
        return None  # a backend named with nothing to guide is harmless
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequest(f"You can only use one kind of guided decoding at a time; got {names}.",
                             param=found[1][0])
    spec = found[0][1]
    if spec.kind == "choice" and not spec.value:
        raise InvalidRequest("guided_choice must not be empty", param=found[0][0])
    return spec, (backend or DEFAULT_BACKEND)
