"""Tool calling through the openai SDK on SmolLM2 (greedy): docs/design.md, "Tool calling".

``smol_async`` has SmolLM2's own template, which ignores tools: ``required``
and named functions go through the JSON-list grammar. ``smol_tools`` has the
Hermes test template and parser, and serves ``auto``.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

PERSONS = {"type": "integer", "minimum": 1, "maximum": 9}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_table",
            "description": "Book a restaurant table",
            "parameters": {
                "type": "object",
                "properties": {
                    "restaurant": {"type": "string", "maxLength": 40},
                    "persons": PERSONS,
                    "outdoor": {"type": "boolean"},
                },
                "required": ["restaurant", "persons"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 60},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                },
                "required": ["query"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    ("What is the weather in Paris?", "get_weather"),
    ("Is it cold in Oslo today, in fahrenheit?", "get_weather"),
    ("Tell me the temperature in Tokyo.", "get_weather"),
    ("Weather report for Cairo please", "get_weather"),
    ("Do I need an umbrella in London?", "get_weather"),
    ("What is 2 plus 3?", "add"),
    ("Add 1.5 and 4.25", "add"),
    ("Sum of -7 and 12?", "add"),
    ("How much is 100 + 250?", "add"),
    ("I have 3 apples and get 4 more. How many?", "add"),
    ("Book a table for 2 at Luigi's", "book_table"),
    ("Reserve 4 seats outside at The Green Fork", "book_table"),
    ("Table for six at Sushi Zen tonight", "book_table"),
    ("Get me a table at Chez Paul for one person", "book_table"),
    ("We are 8 people, book Burger Barn", "book_table"),
    ("Search for the best pizza in Naples", "search"),
    ("Find news about the Mars rover", "search"),
    ("Look up Python asyncio tutorials, tag them python", "search"),
    ("Search recipes for vegan lasagna", "search"),
    ("Who won the 2018 World Cup? Search it.", "search"),
]


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=600)


def _check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _create(srv, messages, **kw):
    return client(srv).chat.completions.create(model=srv.model, messages=messages, temperature=0, **kw)


def _stream(srv, messages, **kw) -> tuple[str, list[tuple[str, str]], str]:
    """Content, calls (name, arguments) and finish reason of a stream, checking the shape of its deltas."""
    content, calls, finish, ids = "", [], None, []
    for chunk in _create(srv, messages, stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        finish = c.finish_reason or finish
        content += c.delta.content or ""
        for d in c.delta.tool_calls or []:
            if d.index == len(calls):  # a call's first delta carries its id, type and name
                assert d.id and d.type == "function" and d.function.name, d
                calls.append((d.function.name, d.function.arguments or ""))
                ids.append(d.id)
            else:  # later ones its index and a fragment of the arguments
                assert d.index == len(calls) - 1 and d.id is None and d.function.name is None, d
                calls[d.index] = (calls[d.index][0], calls[d.index][1] + d.function.arguments)
    assert len(set(ids)) == len(ids)
    return content, calls, finish


def _message_calls(r) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]


def test_required_and_named_calls_validate_streamed_and_not(smol_async):
    def one(i: int) -> None:
        prompt, tool = PROMPTS[i]
        messages = [{"role": "user", "content": prompt}]
        if i % 2:
            kw = {"tool_choice": {"type": "function", "function": {"name": tool}}}
            names = {tool}
        else:
            kw = {"tool_choice": "required", "parallel_tool_calls": False}
            names = set(SCHEMAS)
        r = _create(smol_async, messages, tools=TOOLS, max_tokens=80, **kw)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        calls = _message_calls(r)
        assert len(calls) == 1 and r.choices[0].message.tool_calls[0].id.startswith("call_")
        _check_calls(calls, names)
        # The stream carries the same call, in pieces, and no markup as content.
        content, streamed, finish = _stream(smol_async, messages, tools=TOOLS, max_tokens=80, **kw)
        assert (content, streamed, finish) == ("", calls, "tool_calls")

    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        list(ex.map(one, range(len(PROMPTS))))


def test_tool_loop_call_result_answer(smol_async):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = _create(
        smol_async, messages, tools=TOOLS[:1], tool_choice="required", parallel_tool_calls=False, max_tokens=60
    )
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    # The SDK's own message goes back as the history: content null, with its tool_calls.
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees celsius"},
    ]
    final = _create(smol_async, messages, tools=TOOLS[:1], tool_choice="none", max_tokens=30)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length")


# With the Hermes template, the model copies the calls of its history.
FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
        },
    },
}


def _asked(question: str, *calls: dict) -> list[dict]:
    tool_calls = [
        {
            "id": f"call_{question[:3]}{i}",
            "type": "function",
            "function": {"name": "get_forecast", "arguments": json.dumps(a)},
        }
        for i, a in enumerate(calls)
    ]
    return [{"role": "user", "content": question}, {"role": "assistant", "content": None, "tool_calls": tool_calls}]


SHOTS = _asked("Forecast for Paris, 2 days?", {"city": "Paris", "days": 2}) + _asked(
    "Forecast for Oslo, 3 days?", {"city": "Oslo", "days": 3}
)


def test_auto_calls_validate_where_free_text_would_not(smol_tools):
    """Asked for more days than the schema allows, the model writes them in free text (tool_choice none);
    under auto, the grammar that starts at <tool_call> keeps the arguments valid."""
    schema = FORECAST["function"]["parameters"]
    for question in ("Forecast for Tokyo, 30 days?", "Forecast for Cairo, 0 days?"):
        messages = [*SHOTS, {"role": "user", "content": question}]
        free = _create(smol_tools, messages, tools=[FORECAST], tool_choice="none", max_tokens=40).choices[0]
        assert free.message.content.startswith("<tool_call>") and free.message.tool_calls is None
        written = json.loads(free.message.content.split("\n")[1])["arguments"]
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(written, schema)
        r = _create(smol_tools, messages, tools=[FORECAST], max_tokens=40)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        calls = _message_calls(r)
        assert len(calls) == 1 and calls[0][0] == "get_forecast"
        jsonschema.validate(json.loads(calls[0][1]), schema)
        assert _stream(smol_tools, messages, tools=[FORECAST], max_tokens=40) == ("", calls, "tool_calls")


def test_auto_answers_in_text_when_the_model_does_not_call(smol_tools):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = _create(smol_tools, messages, tools=[FORECAST], max_tokens=20)
    assert r.choices[0].message.tool_calls is None and "Paris" in r.choices[0].message.content
    content, calls, finish = _stream(smol_tools, messages, tools=[FORECAST], max_tokens=20)
    assert content == r.choices[0].message.content and not calls and finish == r.choices[0].finish_reason


def test_parallel_tool_calls(smol_tools):
    shots = _asked("Forecast for Paris and Rome, 2 days?", {"city": "Paris", "days": 2}, {"city": "Rome", "days": 2})
    messages = [*shots, {"role": "user", "content": "Forecast for Tokyo and Lima, 5 days?"}]
    for choice in ("auto", "required"):
        both = _message_calls(_create(smol_tools, messages, tools=[FORECAST], tool_choice=choice, max_tokens=80))
        assert [json.loads(a)["city"] for _, a in both] == ["Tokyo", "Lima"]
        one = _create(
            smol_tools, messages, tools=[FORECAST], tool_choice=choice, parallel_tool_calls=False, max_tokens=80
        )
        assert len(_message_calls(one)) == 1 and one.choices[0].finish_reason == "tool_calls"
    content, streamed, finish = _stream(smol_tools, messages, tools=[FORECAST], max_tokens=80)
    assert (content, streamed, finish) == ("", both, "tool_calls")


def test_tool_loop_with_a_template_that_renders_tools(smol_tools):
    messages = [*SHOTS, {"role": "user", "content": "Forecast for Tokyo, 5 days?"}]
    first = _create(smol_tools, messages, tools=[FORECAST], max_tokens=40)
    call = first.choices[0].message.tool_calls[0]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Rain all week."},
    ]
    final = _create(smol_tools, messages, tools=[FORECAST], max_tokens=30).choices[0]
    assert final.message.content or final.message.tool_calls


BAD = [
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 3}}}},
                }
            ],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
    ),
    ({"tools": [FORECAST], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [FORECAST], "tool_choice": "always"}, "tool_choice"),
    (
        {
            "tools": [FORECAST],
            "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "1"}],
        },
        "messages[1].tool_call_id",
    ),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_tool_input_is_400_naming_the_field(smol_tools, body, param):
    r = httpx.post(
        f"{smol_tools.url}/v1/chat/completions",
        json={"model": smol_tools.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_auto_without_the_flags_is_vllms_400(smol_async):
    with pytest.raises(openai.BadRequestError) as e:
        _create(smol_async, [{"role": "user", "content": "hi"}], tools=[FORECAST], max_tokens=5)
    assert "--enable-auto-tool-choice" in e.value.body["message"]
    m = smol_async.wait_idle()
    assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"]


# smol_auto: SmolLM2's own template, which ignores tools, with --enable-auto-tool-choice --tool-call-parser hermes.
# Its few shots come as text in the hermes format, as the server writes past calls for such a template.
TOKYO = [*SHOTS, {"role": "user", "content": "Forecast for Tokyo, 5 days?"}]


def _check_forecast(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        assert name == "get_forecast"
        jsonschema.validate(json.loads(arguments), FORECAST["function"]["parameters"])


def test_openais_default_tool_choice_on_a_template_that_ignores_tools(smol_auto):
    """No tool_choice (OpenAI's default, auto) and auto: 200, the tools described in the hermes format,
    calls valid for the schema, a stream that reassembles to the whole answer."""
    called = 0
    for messages in ([{"role": "user", "content": "What is the capital of France?"}], TOKYO):
        for kw in ({}, {"tool_choice": "auto"}):
            r = _create(smol_auto, messages, tools=[FORECAST], max_tokens=40, **kw)
            calls = _message_calls(r)
            _check_forecast(calls)
            called += bool(calls)
            finish = "tool_calls" if calls else r.choices[0].finish_reason
            assert r.choices[0].finish_reason == finish
            assert _stream(smol_auto, messages, tools=[FORECAST], max_tokens=40, **kw) == (
                r.choices[0].message.content or "",
                calls,
                finish,
            )
    assert called  # the shots make the model call: the checks above saw calls
    assert "tools=(auto, hermes format, tools described in the system message)" in smol_auto.output()


def test_follow_up_turns_on_a_template_that_ignores_tools(smol_auto):
    first = _create(smol_auto, TOKYO, tools=[FORECAST], max_tokens=40)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *TOKYO,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Rain all week."},
    ]
    for kw in ({}, {"tool_choice": "auto"}, {"tool_choice": "none"}):
        final = _create(smol_auto, messages, tools=[FORECAST], max_tokens=30, **kw)
        assert final.choices[0].message.content or final.choices[0].message.tool_calls
        _check_forecast(_message_calls(final))


def test_responses_follow_ups_on_a_template_that_ignores_tools(smol_auto):
    """function_call_output items in the input, and a follow-up by previous_response_id."""
    tool = {"type": "function", **FORECAST["function"]}
    items: list[dict] = []
    for m in TOKYO:
        if m["role"] == "user":
            items.append({"role": "user", "content": m["content"]})
        for c in m.get("tool_calls", []):
            f = c["function"]
            items.append({"type": "function_call", "call_id": c["id"], "name": f["name"], "arguments": f["arguments"]})
            items.append({"type": "function_call_output", "call_id": c["id"], "output": "Sunny."})
    responses = client(smol_auto).responses
    first = responses.create(
        model=smol_auto.model, input=items, tools=[tool], store=True, temperature=0, max_output_tokens=40
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and calls
    _check_forecast([(c.name, c.arguments) for c in calls])
    follow = [{"type": "function_call_output", "call_id": c.call_id, "output": "Rain."} for c in calls]
    final = responses.create(
        model=smol_auto.model,
        previous_response_id=first.id,
        input=follow,
        tools=[tool],
        temperature=0,
        max_output_tokens=30,
    )
    assert final.status in ("completed", "incomplete") and final.output
    _check_forecast([(o.name, o.arguments) for o in final.output if o.type == "function_call"])


def test_stop_strings_never_break_a_call(smol_auto):
    """Stop strings that occur inside the arguments apply to free text only: required, named and auto
    calls come back whole, streamed and not."""
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    required = {"tool_choice": "required", "parallel_tool_calls": False}
    named = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    cases = [
        (messages, kw, tools, stop)
        for stop in ("}", ", ", '"')
        for messages, kw, tools in ((weather, required, TOOLS), (weather, named, TOOLS), (TOKYO, {}, [FORECAST]))
    ]
    schemas = {**SCHEMAS, "get_forecast": FORECAST["function"]["parameters"]}

    def one(case) -> tuple[list, str]:
        messages, kw, tools, stop = case
        r = _create(smol_auto, messages, tools=tools, max_tokens=60, stop=[stop], **kw)
        calls, finish = _message_calls(r), r.choices[0].finish_reason
        content = r.choices[0].message.content or ""
        assert _stream(smol_auto, messages, tools=tools, max_tokens=60, stop=[stop], **kw) == (content, calls, finish)
        for name, arguments in calls:
            assert name in {t["function"]["name"] for t in tools}
            jsonschema.validate(json.loads(arguments), schemas[name])
        return calls, finish

    with ThreadPoolExecutor(len(cases)) as ex:
        results = list(ex.map(one, cases))
    # Forced calls ignore stop strings (their output is calls only); the shots make auto call too.
    assert all(calls and finish == "tool_calls" for calls, finish in results)


def test_a_call_cut_by_max_tokens_comes_back_as_content(smol_auto):
    named = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    for messages, kw, tools in ((weather, named, TOOLS), (TOKYO, {}, [FORECAST])):
        for max_tokens in (2, 5, 12):
            r = _create(smol_auto, messages, tools=tools, max_tokens=max_tokens, **kw).choices[0]
            assert r.finish_reason == "length" and r.message.tool_calls is None and r.message.content, max_tokens
            content, calls, finish = _stream(smol_auto, messages, tools=tools, max_tokens=max_tokens, **kw)
            assert finish == "length"
            if calls:  # the stream had sent the call's name: its arguments are cut, and the finish says so
                assert len(calls) == 1 and calls[0][0] in {"get_weather", "get_forecast"}
            else:
                assert content == r.message.content
