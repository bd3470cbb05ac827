"""Chat templates: rendering as transformers does, token ids, errors as 400s, and which template is used."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import msgspec
import pluggy
import pytest

from trtserver import hookimpl
from trtserver.chat_template import (
    ChatTemplate,
    ChatTemplateConfigError,
    ChatTemplateError,
    ChatTemplateMissing,
    require_chat_template,
    resolve_chat_template,
    template_token_ids,
)
from trtserver.config import ServerConfig
from trtserver.errors import InvalidRequest
from trtserver.manifest import Manifest, Source, save_manifest
from trtserver.plugins import new_plugin_manager
from trtserver.scripted_engine import CHAT_TEMPLATE, write_engine_dir
from trtserver.tokenizer import Tokenizer

# Qwen2.5's template, as published with its tokenizer_config.json
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\
\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city, «today»",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scripted engine's directory: a small ChatML vocabulary and template (tests/engine has SmolLM2's)."""
    return write_engine_dir(tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def tokenizer(scripted_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(scripted_dir)


@pytest.fixture(scope="module")
def chatml(tokenizer: Tokenizer) -> ChatTemplate:
    return ChatTemplate.for_tokenizer(CHAT_TEMPLATE, tokenizer)


def render(source: str, messages: list[dict[str, Any]] | None = None, **options: Any) -> str:
    return ChatTemplate.from_text(source, special_tokens={"bos_token": "<s>", "eos_token": "</s>"}).render(
        messages if messages is not None else [{"role": "user", "content": "Hi"}], **options)


# --- rendering --------------------------------------------------------------------------------


def test_qwen_tools_template_with_tool_calls_and_results() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    call: dict[str, Any] = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
    messages: list[dict[str, Any]] = [
                {"role": "user", "content": "Weather in Zürich and Bern?"},
                {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "call_2", "function": {
                    "name": "get_weather", "arguments": '{"city": "Bern"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]}]
    text = render(QWEN_TEMPLATE, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n")
    # tojson as transformers defines it: no ASCII escaping, no HTML escaping
    assert '\n{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, «today»"' \
        in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Zürich and Bern?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    # transformers, given what vLLM gives it (arguments decoded, content parts joined), renders the same
    as_vllm = json.loads(json.dumps(messages))
    for item in as_vllm[1]["tool_calls"]:
        item["function"]["arguments"] = json.loads(item["function"]["arguments"])
    as_vllm[3]["content"] = "rain"
    rendered, _ = render_jinja_template([as_vllm], tools=[WEATHER_TOOL],  # type: ignore[str-unpack]
                                        chat_template=QWEN_TEMPLATE, add_generation_prompt=True)
    assert rendered[0] == text


def test_no_tools_branch_and_tools_none() -> None:
    assert render(QWEN_TEMPLATE, tools=None, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    assert render(QWEN_TEMPLATE, tools=[]) == render(QWEN_TEMPLATE)  # an empty list is falsy in the template
    assert render("{{ tools is none }} {{ tools | length if tools is not none }}", tools=[]) == "False 0"
    assert render("{{ tools is none }}") == "True"


def test_tojson_options_and_globals() -> None:
    source = ("{{ {'b': 'é<>', 'a': [1]} | tojson(indent=2, sort_keys=True) }}|{{ 'x' | tojson(ensure_ascii=True) }}"
              "|{{ '\u00e9' | tojson(ensure_ascii=True) }}|{{ strftime_now('%Y') }}|{{ bos_token }}{{ eos_token }}")
    assert render(source) == ('{\n  "a": [\n    1\n  ],\n  "b": "é<>"\n}|"x"|"\\u00e9"|'
                              f"{datetime.datetime.now().year}|<s></s>")
    source = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% if loop.index > 1 %}"
              "{% break %}{% endif %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
              "{{ ns.n }}{{ dict(a=1) | tojson }}")
    assert render(source, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == '[a]2{"a": 1}'


def test_trim_and_lstrip_blocks() -> None:
    source = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert render(source) == "Hi\n"


def test_chat_template_kwargs_reach_the_template_but_not_reserved_names() -> None:
    source = "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}{{ messages[0].content }}"
    assert render(source, kwargs={"enable_thinking": False}) == "/no_think Hi"
    assert render(source, kwargs={}) == "Hi"
    for name in ("messages", "add_generation_prompt", "bos_token", "tools"):
        with pytest.raises(InvalidRequest) as caught:
            render(source, kwargs={name: "x"})
        assert caught.value.status == 400 and caught.value.param == "chat_template_kwargs"
        assert repr(name) in caught.value.message


def test_content_parts_joined_or_kept_as_the_template_wants() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert render("{{ messages[0].content }}", [{"role": "user", "content": parts}]) == "one\ntwo"
    iterating = "{% for m in messages %}{% for part in m['content'] %}<{{ part.text }}>{% endfor %}{% endfor %}"
    assert ChatTemplate.from_text(iterating).content_as_parts
    assert ChatTemplate.from_text("{% for m in messages %}{% for p in m.content | list %}{% endfor %}{% endfor %}"
                                  ).content_as_parts
    assert not ChatTemplate.from_text("{% for m in messages %}{{ m.content }}{% endfor %}").content_as_parts
    assert render(iterating, [{"role": "user", "content": parts}, {"role": "user", "content": "three"}]) == (
        "<one><two><three>")
    with pytest.raises(InvalidRequest) as caught:
        render("{{ messages }}", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert caught.value.param == "messages" and "text parts only" in caught.value.message


def test_none_valued_keys_are_dropped_as_transformers_does() -> None:
    source = "{% for m in messages %}{{ m.role }}:{{ m.name is defined }}:{{ m.content }};{% endfor %}"
    messages = [{"role": "user", "content": "a", "name": None}, {"role": "assistant", "content": None}]
    assert render(source, messages) == "user:False:a;assistant:False:;"


# --- continue_final_message -----------------------------------------------------------------


def test_continue_final_message_cuts_after_the_content(chatml: ChatTemplate) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    assert chatml.render(messages, continue_final_message=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer is")
    # a template that trims content: the trailing space goes, as in transformers
    trimming = "{% for m in messages %}[{{ m.content | trim }}]{% endfor %}"
    assert render(trimming, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "So "}],
                  continue_final_message=True) == "[Hi][So"


def test_continue_final_message_errors() -> None:
    with pytest.raises(InvalidRequest) as caught:
        render("{{ messages }}", add_generation_prompt=True, continue_final_message=True)
    assert caught.value.status == 400 and caught.value.param == "continue_final_message"
    with pytest.raises(InvalidRequest, match="does not render the final message"):
        render("{% for m in messages %}{{ m.role }}{% endfor %}", continue_final_message=True)
    with pytest.raises(InvalidRequest, match="at least one message"):
        render("x", [], continue_final_message=True)


# --- token ids ---------------------------------------------------------------------------------


def test_special_tokens_become_single_ids(chatml: ChatTemplate, tokenizer: Tokenizer) -> None:
    ids = template_token_ids(chatml.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True), tokenizer)
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    assert start is not None and end is not None
    assert ids[0] == start and ids.count(start) == 2 and ids.count(end) == 1
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_bos_never_doubled(tokenizer: Tokenizer) -> None:
    bos = tokenizer.bos_token_id
    assert bos is not None
    adding = Tokenizer(tokenizer.backend, bos_token_id=bos, eos_token_ids=tokenizer.eos_token_ids,
                       add_bos_token=True, special_tokens=tokenizer.special_tokens)
    with_bos = ChatTemplate.for_tokenizer("{{ bos_token }}{{ messages[0].content }}", adding).render(
        [{"role": "user", "content": "Hi"}])
    assert with_bos == "<|im_start|>Hi"
    assert template_token_ids(with_bos, adding) == [bos, *tokenizer.encode("Hi")]
    assert template_token_ids("Hi", adding) == [bos, *tokenizer.encode("Hi")]  # the tokenizer adds it
    assert template_token_ids("Hi", tokenizer) == tokenizer.encode("Hi")  # and one that does not, does not


def test_tokenizer_reads_its_special_tokens(tokenizer: Tokenizer) -> None:
    assert tokenizer.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                        "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}


# --- errors are 400s ---------------------------------------------------------------------------


def test_raise_exception_is_a_400_with_the_message() -> None:
    source = ("{% if messages[0].role != 'system' %}{{ raise_exception('Conversation roles must alternate!') }}"
              "{% endif %}")
    with pytest.raises(ChatTemplateError) as caught:
        render(source)
    assert caught.value.status == 400 and caught.value.message == "Conversation roles must alternate!"
    assert caught.value.param == "messages" and isinstance(caught.value, InvalidRequest)


def test_syntax_error_is_a_400_naming_the_line() -> None:
    with pytest.raises(ChatTemplateError) as caught:
        ChatTemplate.from_text("line one\n{% for m in messages %}{{ m.content }}")
    assert caught.value.status == 400 and caught.value.param == "chat_template"
    assert "line 2" in caught.value.message and "endfor" in caught.value.message


def test_undefined_and_type_errors_are_400s() -> None:
    for source in ("{{ messages[0].content.nope.deeper }}", "{{ messages[5].content }}x{{ messages[5].x.y }}",
                   "{{ messages[0].content + 1 }}", "{{ 1 // 0 }}"):
        with pytest.raises(ChatTemplateError) as caught:
            render(source)
        assert caught.value.status == 400 and caught.value.param == "messages"
        assert "chat template failed" in caught.value.message


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{{ messages.append({'role': 'x'}) }}",
    "{{ messages[0].update(role='x') }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{% set ns = namespace(_x=1) %}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_sandbox_refuses_and_answers_400(source: str) -> None:
    with pytest.raises(ChatTemplateError) as caught:
        render(source)
    assert caught.value.status == 400
    assert "SecurityError" in caught.value.message or "UndefinedError" in caught.value.message


def test_sandbox_unsafe_attributes_print_as_nothing() -> None:
    # as in jinja2's sandbox (and so transformers): reading one is undefined, using it is an error
    assert render("[{{ messages[0].__class__ }}][{{ raise_exception.__globals__ }}][{{ messages[0].role }}]") == (
        "[][][user]")


# --- which template ------------------------------------------------------------------------------


def engine_dir_with(path: Path, *, manifest_template: str | None = None, tokenizer_config: dict[str, Any] | None = None,
                    jinja: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_manifest(path, Manifest(served_model_name="tiny", source=Source(kind="hf-checkpoint", location="x",
                                                                          sha256="0" * 64),
                                 dtype="float32", context_length=64, weights_sha256="0" * 64, created_by="test",
                                 chat_template="chat_template.jinja" if manifest_template is not None else None))
    if manifest_template is not None or jinja is not None:
        (path / "chat_template.jinja").write_text(manifest_template if manifest_template is not None else jinja or "")
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config or {}))
    return path


class Answer:
    def __init__(self, text: str | None) -> None:
        self.text = text

    @hookimpl
    def trtserver_chat_template(self, config: ServerConfig, model_template: str | None) -> str | None:
        return self.text


def pm_with(*plugins: object) -> pluggy.PluginManager:
    pm = new_plugin_manager()
    for number, plugin in enumerate(plugins):
        pm.register(plugin, name=f"p{number}")
    return pm


def resolve(engine_dir: Path, tokenizer: Tokenizer, pm: pluggy.PluginManager | None = None,
            **config: Any) -> ChatTemplate | None:
    return resolve_chat_template(ServerConfig(engine_dir=str(engine_dir), **config), pm or pm_with(), tokenizer)


def test_engine_dir_sources(tmp_path: Path, tokenizer: Tokenizer) -> None:
    named = resolve(engine_dir_with(tmp_path / "a", manifest_template="manifest {{ bos_token }}",
                                    tokenizer_config={"chat_template": "config"}), tokenizer)
    assert named is not None and named.render([]) == "manifest <|im_start|>"
    legacy = resolve(engine_dir_with(tmp_path / "b", tokenizer_config={"chat_template": "config"}), tokenizer)
    assert legacy is not None and legacy.render([]) == "config"
    listed = resolve(engine_dir_with(tmp_path / "c", tokenizer_config={"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default"}]}), tokenizer)
    assert listed is not None and listed.render([]) == "default"
    jinja_file = resolve(engine_dir_with(tmp_path / "d", jinja="jinja", tokenizer_config={"chat_template": "config"}),
                         tokenizer)
    assert jinja_file is not None and jinja_file.render([]) == "jinja"  # transformers prefers the .jinja file
    assert resolve(engine_dir_with(tmp_path / "e"), tokenizer) is None


def test_an_engine_directory_without_a_manifest_has_its_jinja_template(scripted_dir: Path,
                                                                      tokenizer: Tokenizer) -> None:
    template = resolve(scripted_dir, tokenizer)
    assert template is not None and template.source == CHAT_TEMPLATE


def test_override_from_file_and_from_string(tmp_path: Path, tokenizer: Tokenizer) -> None:
    engine = engine_dir_with(tmp_path / "m", tokenizer_config={"chat_template": "model"})
    file = tmp_path / "mine.jinja"
    file.write_text("file {{ messages[0].content }}")
    from_file = resolve(engine, tokenizer, chat_template=str(file))
    assert from_file is not None and from_file.render([{"role": "user", "content": "x"}]) == "file x"
    assert from_file.origin == str(file)
    from_string = resolve(engine, tokenizer, chat_template="string {{ messages | length }}")
    assert from_string is not None and from_string.render([]) == "string 0"
    assert from_string.origin == "--chat-template"
    # overrides give a model without a template one
    bare = engine_dir_with(tmp_path / "bare")
    assert resolve(bare, tokenizer) is None
    template = resolve(bare, tokenizer, chat_template="x")
    assert template is not None and template.render([]) == "x"


def test_hook_precedence(tmp_path: Path, tokenizer: Tokenizer) -> None:
    engine = engine_dir_with(tmp_path / "m", tokenizer_config={"chat_template": "model"})
    assert resolve(engine, tokenizer, pm_with(Answer(None))).render([]) == "model"  # type: ignore[union-attr]
    plugin = resolve(engine, tokenizer, pm_with(Answer(None), Answer("plugin")))
    assert plugin is not None and plugin.render([]) == "plugin" and plugin.origin == "plugin"
    flag = resolve(engine, tokenizer, pm_with(Answer("plugin")), chat_template="flag")
    assert flag is not None and flag.render([]) == "flag"
    # a plugin can give a model without a template one
    bare = resolve(engine_dir_with(tmp_path / "bare"), tokenizer, pm_with(Answer("plugin")))
    assert bare is not None and bare.render([]) == "plugin"


def test_a_bad_template_at_start_up_names_its_source(tmp_path: Path, tokenizer: Tokenizer) -> None:
    engine = engine_dir_with(tmp_path / "m", tokenizer_config={"chat_template": "{% if %}"})
    with pytest.raises(ChatTemplateConfigError, match="tokenizer_config.json"):
        resolve(engine, tokenizer)
    with pytest.raises(ChatTemplateConfigError, match="--chat-template"):
        resolve(engine, tokenizer, chat_template="{{ unclosed")
    with pytest.raises(ChatTemplateConfigError, match="plugin"):
        resolve(engine, tokenizer, pm_with(Answer("{% endfor %}")))


def test_missing_template_message_names_the_flag() -> None:
    with pytest.raises(ChatTemplateMissing) as caught:
        require_chat_template(None)
    assert caught.value.status == 400 and "--chat-template" in caught.value.message
    template = ChatTemplate.from_text("x")
    assert require_chat_template(template) is template


def test_config_fields_and_flags() -> None:
    import argparse

    from trtserver.cli import _add_serve_arguments, config_from_args

    parser = argparse.ArgumentParser()
    _add_serve_arguments(parser)
    config = config_from_args(parser.parse_args(["e", "--chat-template", "t.jinja", "--tool-call-parser", "hermes"]))
    assert (config.chat_template, config.tool_call_parser) == ("t.jinja", "hermes")
    assert msgspec.convert({"engine_dir": "e"}, ServerConfig).chat_template is None


def test_a_manifest_naming_a_missing_file_is_a_start_up_error(tmp_path: Path, tokenizer: Tokenizer) -> None:
    engine = engine_dir_with(tmp_path / "m", manifest_template="x")
    (engine / "chat_template.jinja").unlink()
    with pytest.raises(ChatTemplateConfigError, match="chat_template.jinja"):
        resolve(engine, tokenizer)


def test_reasoning_is_given_under_each_name_templates_read() -> None:
    source = "{% for m in messages %}{{ m.thinking }}|{{ m.reasoning_content }}|{{ m.content }}{% endfor %}"
    assert render(source, [{"role": "assistant", "reasoning": "hmm", "content": "ok"}]) == "hmm|hmm|ok"
