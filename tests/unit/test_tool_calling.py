"""Tool-calling checks and plans without a server: each bad input's 400, the format each choice uses,
the conversation the template gets, and which templates render tools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.io_proc.openai.protocol import APIError
from pipeline.io_proc.openai.protocol_chat import ChatCompletionRequest, ChatTool, FunctionDefinition
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
# A template that refuses the system role, as Gemma's and early Mistral ones do.
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Gemma's shape: no system role, and user and assistant turns that must alternate (so no tool role).
ALTERNATING_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


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


def test_auto_needs_the_flags():
    e = refused(ToolCalling(None, False, True, True), request())
    assert e.message == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_on_a_template_that_ignores_tools_describes_them_in_the_parsers_format(choice):
    """OpenAI's default (no tool_choice) and auto: the tools and the hermes format in the system message,
    the lazy grammar from <tool_call>, the route named for the request log."""
    system = [{"role": "system", "content": "Be brief."}]
    for messages, tc in ((USER, ignoring()), ([*system, *USER], ignoring())):
        plan = tc.plan(request(messages=messages, **({"tool_choice": choice} if choice else {})))
        assert plan.parser.name == "hermes" and plan.trigger == "<tool_call>" and plan.grammar
        assert plan.template_tools is None and plan.conversation[-1] == USER[0]
        described = plan.conversation[0]
        assert described["role"] == "system" and len(plan.conversation) == 2
        assert described["content"].startswith("Be brief.\n\n") == (messages != USER)
        assert (
            '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
            in (described["content"])
        )
        assert json.dumps(WEATHER["function"]) in described["content"]
        assert plan.route == "auto, hermes format, tools described in the system message"
    # A template with no system role: the description opens the first user message.
    plan = ToolCalling("hermes", True, False, False, system_role=False).plan(request())
    assert [m["role"] for m in plan.conversation] == ["user"]
    assert (
        plan.conversation[0]["content"].endswith("\n\nWeather in Paris?")
        and "<tool_call>" in (plan.conversation[0]["content"])
    )
    assert plan.route == "auto, hermes format, tools described in the first user message"
    assert rendering().plan(request()).route == "auto, hermes format, tools rendered by the chat template"


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
    # A template that cannot show the calls gets them as text, in the format it is asked to write:
    # the parser's under auto, the JSON list when forced.
    auto = ignoring().plan(request(messages=messages)).conversation
    assert auto[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert auto[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    forced = ignoring().plan(request(messages=messages, tool_choice="required")).conversation
    assert json.loads(forced[2]["content"]) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]


def test_templates_are_probed_for_tools(smol_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    stock = Tokenization(tok, num_threads=1)
    assert not stock.renders_tools and not stock.renders_tool_calls  # SmolLM2's template ignores them
    hermes = Tokenization(tok, num_threads=1, chat_template=HERMES_TEMPLATE.read_text())
    assert hermes.renders_tools and hermes.renders_tool_calls
    assert stock.system_role and hermes.system_role
    no_system = Tokenization(tok, num_threads=1, chat_template=NO_SYSTEM_TEMPLATE)
    assert not no_system.system_role and not no_system.renders_tools
    for t in (stock, hermes, no_system):
        t.close()


def test_a_template_without_system_and_tool_roles_renders_a_tool_loop(smol_dir):
    """Gemma's shape: the description opens the first user message, and the results of a turn's calls come
    back as one user turn, so that roles alternate and the template renders the follow-up."""
    import asyncio

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    t = Tokenization(tok, num_threads=1, chat_template=ALTERNATING_TEMPLATE)
    assert (t.renders_tools, t.renders_tool_calls, t.system_role, t.tool_role) == (False, False, False, False)
    tc = ToolCalling("hermes", True, t.renders_tools, t.renders_tool_calls, t.system_role, t.tool_role)
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
        for i, c in enumerate(("Paris", "Oslo"))
    ]
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    plan = tc.plan(request(messages=messages))
    assert [m["role"] for m in plan.conversation] == ["user", "assistant", "user"]
    assert plan.conversation[0]["content"].startswith("You can call functions.")
    assert plan.conversation[1]["content"].count("<tool_call>") == 2
    assert plan.conversation[2]["content"] == (
        "get_weather returned: sunny\n\nget_weather returned: rain\n\nAnd tomorrow?"
    )
    text = tok.decode(asyncio.run(t.encode_chat(plan.conversation)))
    assert '<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert text.endswith("And tomorrow?<end_of_turn>\n<start_of_turn>model\n")
    t.close()
