"""Tool-calling checks and plans without a server: each bad input's 400, the format each choice uses,
the conversation the template gets, and which templates render tools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.io_proc.protocol import APIError
from pipeline.io_proc.protocol_chat import ChatCompletionRequest, ChatTool, FunctionDefinition
from pipeline.io_proc.tokenization import Tokenization
from pipeline.io_proc.tool_calling import ToolCalling, compile_tool_grammar

HERMES_TEMPLATE = Path(__file__).resolve().parent.parent / "fixtures" / "hermes_tool_chat_template.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, "tools": [WEATHER], **body})


def rendering(**kw) -> ToolCalling:
    return ToolCalling("hermes", True, renders_tools=True, renders_tool_calls=True, **kw)


def ignoring() -> ToolCalling:
    return ToolCalling("hermes", True, renders_tools=False, renders_tool_calls=False)


def refused(tc: ToolCalling, req: ChatCompletionRequest) -> APIError:
    """The 400 of planning ``req``'s tools, or of compiling the plan's grammar."""
    with pytest.raises(APIError) as e:
        plan = tc.plan(req)
        if plan.grammar:
            compile_tool_grammar(plan)
    assert e.value.status_code == 400 and e.value.type == "invalid_request_error"
    return e.value


@pytest.mark.parametrize(
    "body,param,words",
    [
        (
            {"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "objekt"}}}]},
            "tools[0].function.parameters",
            "type object",
        ),
        (
            {
                "tools": [
                    {
                        **WEATHER,
                        "function": {
                            **WEATHER["function"],
                            "parameters": {"type": "object", "properties": {"a": {"type": 5}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
            "invalid",
        ),
        (
            {"tools": [{**WEATHER, "function": {**WEATHER["function"], "name": "bad name!"}}]},
            "tools[0].function.name",
            "letters",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "two tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice", "not in tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tool_choice": {"type": "function"}}, "tool_choice", "must be"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "combined"),
        (
            {"messages": [*USER, {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]},
            "messages[1].tool_call_id",
            "answers no tool call",
        ),
        (
            {
                "messages": [
                    *USER,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
            "JSON object",
        ),
    ],
)
def test_bad_input_is_400_naming_the_field(body, param, words):
    e = refused(rendering(), request(**body))
    assert e.param == param and words in e.message


def test_a_schema_nested_past_any_limit_is_400():
    deep: dict = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"x": deep}}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    req = ChatCompletionRequest.model_construct(
        messages=request().messages,
        tools=[
            ChatTool.model_construct(type="function", function=FunctionDefinition.model_construct(**tool["function"]))
        ],
    )
    e = refused(rendering(), req)
    assert e.param.startswith("tools") and "nested too deeply" in e.message


def test_auto_needs_the_flags_and_a_template_that_renders_tools():
    e = refused(ToolCalling(None, False, True, True), request())
    assert e.message == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    e = refused(ignoring(), request(tool_choice="auto"))
    assert "ignores tools" in e.message and "--chat-template" in e.message and e.param == "tool_choice"


def test_message_shapes_are_checked_by_the_request_model():
    for msg in (
        {"role": "user", "content": None},
        {"role": "tool", "content": "x"},
        {"role": "user", "content": "x", "tool_calls": []},
    ):
        with pytest.raises(ValueError):
            ChatCompletionRequest.model_validate({"messages": [msg]})


def test_each_choice_picks_its_format_and_grammar():
    auto = rendering().plan(request())
    assert auto.parser.name == "hermes" and auto.trigger == "<tool_call>" and auto.grammar
    assert auto.template_tools == [WEATHER]
    required = rendering().plan(request(tool_choice="required"))
    assert required.parser.name == "hermes" and not required.trigger and required.grammar
    # A template that ignores tools: vLLM's JSON list, with the tools described in the system message.
    named = ignoring().plan(request(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named.parser.name == "json_list" and named.template_tools is None
    assert named.conversation[0]["role"] == "system" and '"name": "get_weather"' in named.conversation[0]["content"]
    none = ignoring().plan(request(tool_choice="none"))
    assert none.parser is None and not none.grammar and none.conversation == USER


def test_history_reaches_the_template_as_transformers_takes_it():
    messages = [
        {"role": "developer", "content": "Be brief."},
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    conv = rendering().conversation(request(messages=messages).messages)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert conv[0] == {"role": "system", "content": "Be brief."}
    assert conv[2] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert conv[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    # A template that cannot show the calls gets them as text, in the format it is asked to write.
    conv = ignoring().conversation(request(messages=messages).messages)
    assert json.loads(conv[2]["content"]) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]


def test_templates_are_probed_for_tools(smol_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    stock = Tokenization(tok, num_threads=1)
    assert not stock.renders_tools and not stock.renders_tool_calls  # SmolLM2's template ignores them
    hermes = Tokenization(tok, num_threads=1, chat_template=HERMES_TEMPLATE.read_text())
    assert hermes.renders_tools and hermes.renders_tool_calls
    stock.close()
    hermes.close()
