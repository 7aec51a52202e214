"""``/v1/responses`` through the openai SDK (``client.responses.create`` / ``.stream``) on SmolLM2, greedy:
docs/design.md, "The Responses API". ``smol_tools`` keeps at most 4 stored responses."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

FORECAST = {
    "type": "function",
    "name": "get_forecast",
    "description": "Weather forecast for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
    },
}
CAPITAL = "What is the capital of France?"


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=600)


def create(srv, **kw):
    return client(srv).responses.create(model=srv.model, temperature=0, **kw)


def test_text_whole_and_streamed(smol_tools):
    r = create(smol_tools, input=CAPITAL, max_output_tokens=20)
    assert r.status == "completed" and "Paris" in r.output_text and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 20
    with client(smol_tools).responses.stream(
        model=smol_tools.model, input=CAPITAL, max_output_tokens=20, temperature=0
    ) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == r.output_text and final.status == "completed"


def test_cut_short_is_incomplete(smol_tools):
    r = create(smol_tools, input="Write a long story about a dragon.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5


def _shots() -> list[dict]:
    items = []
    for city, days in (("Paris", 2), ("Oslo", 3)):
        items.append({"role": "user", "content": f"Forecast for {city}, {days} days?"})
        args = json.dumps({"city": city, "days": days})
        items.append({"type": "function_call", "call_id": f"call_{city}", "name": "get_forecast", "arguments": args})
    return items


def test_function_call_round_trip(smol_tools):
    question = {"role": "user", "content": "Forecast for Tokyo, 30 days?"}
    r = create(smol_tools, input=[*_shots(), question], tools=[FORECAST], max_output_tokens=40)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_forecast" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), FORECAST["parameters"])
    # Streamed: the same call, its arguments in deltas.
    with client(smol_tools).responses.stream(
        model=smol_tools.model, input=[*_shots(), question], tools=[FORECAST], max_output_tokens=40, temperature=0
    ) as s:
        events = list(s)
        streamed = s.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-2:] == [
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments == streamed.output[0].arguments
    # The result goes back as a function_call_output item; the answer is text.
    follow = [*_shots(), question, call.model_dump(exclude_none=True)]
    follow.append({"type": "function_call_output", "call_id": call.call_id, "output": "Rain all week."})
    answer = create(smol_tools, input=follow, tools=[FORECAST], tool_choice="none", max_output_tokens=20)
    assert answer.output[0].type == "message" and answer.output_text


def test_previous_response_id_and_the_store_bound(smol_tools):
    first = create(smol_tools, input=CAPITAL, store=True, max_output_tokens=12)
    again = create(smol_tools, input="And of Italy?", previous_response_id=first.id, store=True, max_output_tokens=12)
    assert "Rome" in again.output_text and again.previous_response_id == first.id
    alone = create(smol_tools, input="And of Italy?", max_output_tokens=1)
    assert again.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    got = client(smol_tools).responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    # A response not stored is not found; the store keeps the newest 4.
    unstored = create(smol_tools, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        create(smol_tools, input="again", previous_response_id=unstored.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and "store: true" in e.value.body["message"]
    for _ in range(3):
        create(smol_tools, input="hi", store=True, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client(smol_tools).responses.retrieve(first.id)  # evicted: the oldest of five
    with pytest.raises(openai.BadRequestError):
        create(smol_tools, input="again", previous_response_id=first.id, max_output_tokens=2)
    assert client(smol_tools).responses.retrieve(again.id).id == again.id
    client(smol_tools).responses.delete(again.id)
    with pytest.raises(openai.NotFoundError):
        client(smol_tools).responses.retrieve(again.id)


BAD = [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    (
        {"input": "hi", "tools": [{**FORECAST, "parameters": {"type": "array"}}], "tool_choice": "required"},
        "tools[0].parameters",
    ),
    ({"input": "hi", "tools": [FORECAST], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}], "tools": [FORECAST]}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_input_is_400_naming_the_field(smol_tools, body, param):
    r = httpx.post(f"{smol_tools.url}/v1/responses", json={"model": smol_tools.model, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
