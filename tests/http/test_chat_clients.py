"""Chat through LangChain's ``ChatOpenAI`` (langchain-openai), as an application would use it."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.http.conftest import MODEL

QUESTION = [SystemMessage("You are a helpful assistant."), HumanMessage("What is the capital of France?")]


class get_weather(BaseModel):  # noqa: N801 (LangChain names the tool after the class)
    """The weather in a city."""

    city: str = Field(description="the city", max_length=20)


@pytest.fixture(scope="module")
def chat(base_url: str) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{base_url}/v1", api_key="none",  # type: ignore[arg-type]
                      temperature=0, max_retries=0, timeout=120)


def joined(chunks: list[Any]) -> AIMessageChunk:
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    assert isinstance(total, AIMessageChunk)
    return total


def test_invoke(chat: ChatOpenAI) -> None:
    message = chat.bind(max_tokens=8).invoke(QUESTION)
    assert isinstance(message, AIMessage)
    assert "Paris" in message.text
    assert message.response_metadata["finish_reason"] in ("stop", "length")
    assert message.response_metadata["model_name"] == MODEL
    usage: Any = message.usage_metadata
    assert 0 < usage["output_tokens"] <= 8 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_stream(chat: ChatOpenAI) -> None:
    # seeded: neither takes a cached prefix, whose shorter prefill may round a near tie apart
    whole = chat.bind(max_tokens=8, seed=0).invoke(QUESTION)
    chunks = list(chat.bind(max_tokens=8, seed=0).stream(QUESTION))
    assert len(chunks) > 2
    message = joined(chunks)
    assert message.text == whole.text
    assert message.response_metadata["finish_reason"] == whole.response_metadata["finish_reason"]


def test_bind_tools_named_invoke(chat: ChatOpenAI) -> None:
    tools = chat.bind_tools([get_weather], tool_choice="get_weather").bind(max_tokens=30)
    message = tools.invoke("What is the weather in Paris?")
    assert isinstance(message, AIMessage)
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["id"] and call["id"].startswith("call_")
    assert set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str)
    get_weather(**call["args"])  # LangChain's parsed arguments fit the tool's own model
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert not message.invalid_tool_calls


def test_bind_tools_named_stream(chat: ChatOpenAI) -> None:
    tools = chat.bind_tools([get_weather], tool_choice="get_weather").bind(max_tokens=30)
    message = joined(list(tools.stream("What is the weather in Paris?")))
    assert not message.invalid_tool_calls, message.invalid_tool_calls
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["id"] and call["id"].startswith("call_")
    get_weather(**call["args"])
