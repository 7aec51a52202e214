"""Tool-call parsers on model outputs, whole and streamed split at every boundary; their grammars.

The outputs are what the models write: SmolLM2 under this server (hermes with
the test template, the json_list format), and each family's documented
format (Qwen 2.5 / Hermes, Llama 3.1 JSON, Mistral v0.3, Llama 3.2 pythonic).
"""

from __future__ import annotations

import json

import llguidance
import pytest

from pipeline.io_proc.tool_parsers import TOOL_PARSERS, JsonListToolParser, ToolCall, ToolCallDelta, ToolSpec
from pipeline.io_proc.tool_parsers.calls import assemble

WEATHER = ToolSpec(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
ADD = ToolSpec(
    "add",
    {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "integer"}, "exact": {"type": "boolean"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
)

# (parser, output, content, calls as (name, arguments))
CASES = [
    # SmolLM2, tool_choice required with the hermes template (recorded from this server).
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "",
        [("get_weather", '{"city": "Paris", "unit": "celsius"}')],
    ),
    # Qwen 2.5: text, then two calls.
    (
        "hermes",
        "Let me check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "add", "arguments": {"a": 1.5, "b": 2}}\n</tool_call>',
        "Let me check both.\n",
        [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1.5, "b": 2}')],
    ),
    # Hermes 2 Pro writes the arguments first, sometimes compact, with escapes.
    (
        "hermes",
        '<tool_call>\n{"arguments": {"city": "S\\u00e3o \\"Paulo\\""}, "name": "get_weather"}\n</tool_call>',
        "",
        [("get_weather", '{"city": "S\\u00e3o \\"Paulo\\""}')],
    ),
    # A plain answer that mentions the tag's start, and one with a broken call.
    ("hermes", "Use <tool to call. 3 < 4 is true.", "Use <tool to call. 3 < 4 is true.", []),
    ("hermes", '<tool_call>\n{"name": 5}\n</tool_call>', '<tool_call>\n{"name": 5}\n</tool_call>', []),
    # Llama 3.1 JSON tool calling.
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "fahrenheit"}}',
        "",
        [("get_weather", '{"city": "San Francisco", "unit": "fahrenheit"}')],
    ),
    (
        "llama3_json",
        '{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "add", "parameters": {"a": 4, "b": 5}}',
        "",
        [("add", '{"a": 2, "b": 3}'), ("add", '{"a": 4, "b": 5}')],
    ),
    ("llama3_json", "The weather is {sunny}.", "The weather is {sunny}.", []),
    # Mistral 7B Instruct v0.3.
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        "",
        [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("add", '{"a": 1, "b": 2}')],
    ),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {}}]', "Sure.", [("add", "{}")]),
    # Llama 3.2 pythonic.
    (
        "pythonic",
        "[get_weather(city='San Francisco', unit=\"celsius\"), add(a=1.5, b=2, exact=True)]",
        "",
        [("get_weather", '{"city": "San Francisco", "unit": "celsius"}'), ("add", '{"a": 1.5, "b": 2, "exact": true}')],
    ),
    ("pythonic", "[add(a=1, b=(2))] ", "", [("add", '{"a": 1, "b": 2}')]),
    ("pythonic", "[This is not a call]", "[This is not a call]", []),
    # SmolLM2, tool_choice required with its own template (json_list, recorded from this server).
    (
        "json_list",
        '[{"name": "add", "arguments": {"a": 3, "b": 4}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]',
        "",
        [("add", '{"a": 3, "b": 4}'), ("add", '{"a": 3, "b": 4}')],
    ),
]


def _parser(name: str):
    return JsonListToolParser() if name == "json_list" else TOOL_PARSERS[name]()


def _streamed(parser, chunks: list[str]) -> list:
    s = parser.stream()
    events = [e for c in chunks for e in s.feed(c)]
    return events + s.finish()


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_output(name, text, content, calls):
    got_content, got_calls = _parser(name).extract(text)
    assert got_content == content
    assert got_calls == [ToolCall(n, a) for n, a in calls]
    for c in got_calls:
        json.loads(c.arguments)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_stream_split_anywhere_reassembles_to_the_whole(name, text, content, calls):
    parser = _parser(name)
    whole = parser.extract(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for chunks in splits:
        events = _streamed(parser, chunks)
        assert assemble(events) == whole, chunks
        # Each call's first piece names it; the pieces come in call order.
        seen = -1
        for e in events:
            if isinstance(e, ToolCallDelta):
                assert (e.name is not None) == (e.index > seen) and e.index in (seen, seen + 1)
                seen = e.index


@pytest.mark.parametrize("name,text,content,calls", [c for c in CASES if c[3]])
def test_an_output_cut_inside_a_call_gives_its_text_as_content(name, text, content, calls):
    """max_tokens may end an output anywhere: a whole output returns only complete calls, and the text of
    the call it ended inside as content; a stream emits that text too unless the call's name went out."""
    parser, full = _parser(name), [ToolCall(n, a) for n, a in calls]
    for i in range(len(text) + 1):
        got_content, got_calls = parser.extract(text[:i])
        assert got_calls == full[: len(got_calls)], text[:i]
        assert got_content or got_calls or not text[:i].strip(), text[:i]
        streamed = parser.stream()
        events = streamed.feed(text[:i]) + streamed.finish()
        stream_content, stream_calls = assemble(events)
        if streamed.cut:  # the stream sent the call's name and arguments so far; a whole output has its text
            assert stream_calls[:-1] == got_calls and got_content == stream_content + streamed.cut
        else:
            assert (stream_content, stream_calls) == (got_content, got_calls)


def test_cut_calls_by_example():
    hermes, mistral = TOOL_PARSERS["hermes"](), TOOL_PARSERS["mistral"]()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for cut in ("<tool_call>\n{", '<tool_call>\n{"na', '<tool_call>\n{"name": "get_weather", "arguments": {"ci'):
        assert hermes.extract("Let me see. " + cut) == ("Let me see. " + cut, [])
    # The JSON is whole, its closing tag cut: a complete call.
    assert hermes.extract(call[:-3]) == ("", [ToolCall("get_weather", '{"city": "Paris"}')])
    assert hermes.extract(call + "\n" + call[:20]) == ("\n" + call[:20], [ToolCall("get_weather", '{"city": "Paris"}')])
    first = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert mistral.extract(first + ', {"name": "ad') == (', {"name": "ad', [ToolCall("add", '{"a": 1, "b": 2}')])


@pytest.mark.parametrize("name", [*TOOL_PARSERS, "json_list"])
def test_rendered_calls_read_back_and_follow_the_grammar(smol_dir, name):
    """Past calls are written as the model is asked to write them: the parser reads them back, and the
    grammar accepts them; the example that describes the format names no function."""
    parser, tok = _parser(name), _tokenizer(smol_dir)
    calls = [
        ("get_weather", {"city": 'S\u00e3o "Paulo"', "unit": "celsius"}),
        ("add", {"a": 1.5, "b": 2, "exact": True}),
    ]
    text = parser.render([parser.call_text(n, a) for n, a in calls])
    content, got = parser.extract(text)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert _accepts(tok, parser.grammar([WEATHER, ADD], free=False, parallel=True), text)
    assert "<function name>" in parser.render([parser.example_call]) and not parser.extract(parser.example_call)[1]


def _tokenizer(smol_dir) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer((smol_dir / "tokenizer.json").read_text())


def _accepts(tok, grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(grammar))
    return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()


@pytest.mark.parametrize("name", [*TOOL_PARSERS, "json_list"])
def test_grammar_takes_the_format_and_only_valid_arguments(smol_dir, name):
    tok, parser = _tokenizer(smol_dir), _parser(name)
    for free in (True, False):
        for parallel in (True, False):
            g = parser.grammar([WEATHER, ADD], free=free, parallel=parallel)
            assert not llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(g), None)
    canonical = {
        "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1.5, "b": 2}}\n</tool_call>',
        "llama3_json": '{"name": "add", "parameters": {"a": 1.5, "b": 2}}',
        "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1.5, "b": 2}}]',
        "pythonic": "[add(a=1.5, b=2)]",
        "json_list": '[{"name": "add", "arguments": {"a": 1.5, "b": 2}}]',
    }[name]
    forced = parser.grammar([WEATHER, ADD], free=False, parallel=False)
    free = parser.grammar([WEATHER, ADD], free=True, parallel=True)
    assert _accepts(tok, forced, canonical) and _accepts(tok, free, canonical)
    assert _parser(name).extract(canonical)[1] == [ToolCall("add", '{"a": 1.5, "b": 2}')]
    # A string where a number is due, an unknown function, a missing required argument.
    for bad in (
        canonical.replace("1.5", '"x"'),
        canonical.replace("add", "sub"),
        canonical.replace(', "b": 2', "").replace(", b=2", ""),
    ):
        assert not _accepts(tok, forced, bad) and not _accepts(tok, free, bad), bad


def test_free_grammar_lets_text_through_until_the_trigger(smol_dir):
    tok = _tokenizer(smol_dir)
    g = TOOL_PARSERS["hermes"]().grammar([WEATHER], free=True, parallel=False)
    assert _accepts(tok, g, "It is sunny in Paris, no <tool needed.")
    assert _accepts(tok, g, 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not _accepts(tok, g, 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}')
    # One call only without parallel calls; the free text cannot follow a call.
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert not _accepts(tok, g, one + "\n" + one) and not _accepts(tok, g, one + " bye")
    g = TOOL_PARSERS["llama3_json"]().grammar([WEATHER], free=True, parallel=False)
    assert _accepts(tok, g, "No call: {braces} are fine after the start.")
    assert not _accepts(tok, g, '{"city": "Oslo"}')
