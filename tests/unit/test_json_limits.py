"""Bounds on free-form JSON in a request: nesting depth, and schemas that admit no finite value (issue 40,
findings 4 and 8)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.common.finite_schema import admits_finite_value
from pipeline.common.grammar import GrammarError, build_grammar
from pipeline.io_proc.json_limits import MAX_JSON_DEPTH, loads, nests_too_deeply
from pipeline.io_proc.openai.protocol_chat import ChatCompletionRequest
from pipeline.io_proc.openai.responses_input import ResponsesRequest


def nested(depth: int) -> dict:
    """A dict whose containers nest ``depth`` levels deep."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def test_depth_is_counted_in_containers_up_to_the_bound():
    assert not nests_too_deeply(nested(MAX_JSON_DEPTH))
    assert nests_too_deeply(nested(MAX_JSON_DEPTH + 1))
    assert not nests_too_deeply([[1, "x"], {"a": [None]}, 2])
    assert not nests_too_deeply("text")
    assert nests_too_deeply([nested(MAX_JSON_DEPTH)])  # a list counts as a level too


def test_json_text_past_the_bound_or_past_json_s_own_limit_is_a_value_error():
    assert loads('{"a": [1]}') == {"a": [1]}
    for text in ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "[" * 100_000 + "]" * 100_000):
        with pytest.raises(ValueError, match=f"nested more than {MAX_JSON_DEPTH} levels deep"):
            loads(text)
    with pytest.raises(ValueError):
        loads("{")


def error_loc(model, body: dict) -> tuple:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    errors = e.value.errors()
    assert len(errors) == 1 and "nested more than 64 levels deep" in errors[0]["msg"], errors
    return errors[0]["loc"]


@pytest.mark.parametrize(
    "field, loc",
    [
        ("tools", ("tools", 0, "function", "parameters")),
        ("response_format", ("response_format",)),
        ("guided_json", ("guided_json",)),
        ("guided_json_text", ("guided_json",)),
        ("tool_choice", ("tool_choice",)),
    ],
)
def test_a_chat_field_nested_too_deeply_is_refused_naming_it(field, loc):
    deep = nested(MAX_JSON_DEPTH + 1)
    body: dict = {"messages": [{"role": "user", "content": "hi"}]}
    if field == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    elif field == "guided_json_text":
        body["guided_json"] = "[" * 200 + "]" * 200
    else:
        body[field] = deep
    assert error_loc(ChatCompletionRequest, body) == loc


@pytest.mark.parametrize("field", ["input", "tools", "text", "metadata"])
def test_a_responses_field_nested_too_deeply_is_refused_naming_it(field):
    deep = nested(MAX_JSON_DEPTH + 1)
    body = {"input": "hi", field: [deep] if field in ("input", "tools") else deep}
    assert error_loc(ResponsesRequest, body) == (field,)


# The issue's case, and others whose every value is infinite.
INFINITE = [
    {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}},
    {"$ref": "#"},
    {
        "$defs": {"n": {"type": "object", "required": ["next"], "properties": {"next": {"$ref": "#/$defs/n"}}}},
        "type": "object",
        "required": ["x"],
        "properties": {"x": {"$ref": "#/$defs/n"}},
    },
    {
        "type": "object",
        "required": ["c"],
        "properties": {"c": {"type": "array", "minItems": 1, "items": {"$ref": "#"}}},
    },
    {
        "allOf": [{"$ref": "#/$defs/x"}],
        "$defs": {"x": {"type": "object", "required": ["y"], "properties": {"y": {"$ref": "#"}}}},
    },
    False,
]
# Recursive but with a way to end, or nothing that must recurse.
FINITE = [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},
    {"type": "object", "required": ["c"], "properties": {"c": {"type": "array", "items": {"$ref": "#"}}}},
    {
        "$defs": {
            "n": {
                "anyOf": [
                    {"type": "null"},
                    {"type": "object", "required": ["n"], "properties": {"n": {"$ref": "#/$defs/n"}}},
                ]
            }
        },
        "$ref": "#/$defs/n",
    },
    {"type": ["object", "null"], "required": ["a"], "properties": {"a": {"$ref": "#"}}},
    {"required": ["a"], "properties": {"a": {"$ref": "#"}}},  # no type: a string is a value too
    {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "https://example.com/s.json"}}},
    True,
]


@pytest.mark.parametrize("schema", INFINITE)
def test_a_schema_with_only_infinite_values_is_found(schema):
    assert not admits_finite_value(schema)
    if isinstance(schema, dict):
        with pytest.raises(GrammarError, match="admits no finite value") as e:
            build_grammar("json_schema", schema, "guided_json")
        assert e.value.param == "guided_json"


@pytest.mark.parametrize("schema", FINITE)
def test_a_schema_with_a_finite_value_passes(schema):
    assert admits_finite_value(schema)


def test_a_long_chain_of_references_is_followed_to_its_end():
    n = 20_000
    defs = {
        f"d{i}": {"type": "object", "required": ["n"], "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(n)
    }
    ending = {**defs, f"d{n}": {"type": "string"}}
    assert admits_finite_value({"$defs": dict(reversed(ending.items())), "$ref": "#/$defs/d0"})
    looping = {**defs, f"d{n}": {"$ref": "#/$defs/d0"}}
    assert not admits_finite_value({"$defs": looping, "$ref": "#/$defs/d0"})
