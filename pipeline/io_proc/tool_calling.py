"""Tool calling on chat requests: checks, the prompt's conversation, the grammar and the output's parser
(docs/design.md, "Tool calling")."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.common.grammar import GrammarError, build_grammar, check_finite, check_grammar
from pipeline.io_proc.json_limits import loads
from pipeline.io_proc.openai.protocol import APIError
from pipeline.io_proc.openai.protocol_chat import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from pipeline.io_proc.tokenization import utf8_text
from pipeline.io_proc.tool_parsers import (
    TOOL_PARSERS,
    JsonListToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolSpec,
)
from pipeline.io_proc.tool_parsers.calls import Event
from pipeline.io_proc.tool_parsers.stream import ToolCallStream

# OpenAI's rule for function names.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# What a function without parameters takes: nothing.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# JSON schema keywords holding schemas: by name, in a list, or one.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass
class ToolPlan:
    """How one chat request uses its tools.

    Attributes:
        parser: None for ``tool_choice: none`` (or no tools).
        grammar: llguidance Lark, "" for none; compiled by ``compile_tool_grammar``.
        trigger: with ``auto``, the text before which the grammar is inactive.
        route: how the tools reach the model, for the request log ("" without tools).
    """

    parser: ToolParser | None = None
    grammar: str = ""
    allowed: list[tuple[int, ToolSpec]] = field(default_factory=list)
    trigger: str = ""
    trigger_at_start: bool = False
    template_tools: list[dict] | None = None
    conversation: list[dict] = field(default_factory=list)
    route: str = ""


class ToolCalling:
    """The server's tool-calling settings (``--tool-call-parser``, ``--enable-auto-tool-choice``, what the chat template
    renders) and each request's ``ToolPlan``."""

    def __init__(
        self,
        parser_name: str | None,
        enable_auto: bool,
        renders_tools: bool,
        renders_tool_calls: bool,
        system_role: bool = True,
        tool_role: bool = True,
    ):
        self._parser = TOOL_PARSERS[parser_name]() if parser_name else None
        self._enable_auto = enable_auto
        self._renders_tools = renders_tools
        self._renders_tool_calls = renders_tool_calls
        self._system_role = system_role
        # A template that shows past calls takes their results as it is.
        self._results_as_text = not renders_tool_calls and not tool_role

    def plan(self, req: ChatCompletionRequest) -> ToolPlan:
        """Check the request's tools, choice and history, and say how to serve them.

        Raises:
            APIError: 400 naming the field: a malformed tool or schema, an unknown ``tool_choice`` or function, ``auto``
                without the flags, a ``tool_call_id`` without its call, arguments that are not a JSON object.
        """
        specs = _tool_specs(req.tools or [])
        choice = _tool_choice(req.tool_choice, specs)
        plan = ToolPlan()
        if choice == "none":
            # As vLLM: the template still sees the tools.
            plan.template_tools = _template_tools(req.tools) if specs and self._renders_tools else None
            plan.conversation = self.conversation(req.messages)
            plan.route = "none" if specs else ""
            return plan
        if req.structured_output() is not None:
            raise APIError.bad_request(
                "response_format and guided_* cannot be combined with tools unless tool_choice is none",
                param="response_format",
            )
        parallel = req.parallel_tool_calls is not False
        if choice == "auto":
            if not self._enable_auto or self._parser is None:
                raise APIError.bad_request(_AUTO_NEEDS_FLAGS, param="tool_choice")
            plan.parser, chosen, free = self._parser, specs, True
            plan.trigger, plan.trigger_at_start = self._parser.trigger, self._parser.anchored
        else:
            native = self._parser is not None and self._renders_tools
            plan.parser = self._parser if native else JsonListToolParser()
            chosen = specs if choice == "required" else [s for s in specs if s.name == choice]
            parallel, free = parallel and choice == "required", False
        try:
            grammar = plan.parser.grammar(chosen, free=free, parallel=parallel)
        except RecursionError:  # json.dumps of a schema nested past Python's limit
            raise APIError.bad_request("tools: a schema is nested too deeply", param="tools") from None
        plan.grammar = grammar
        allowed = {id(s) for s in chosen}
        plan.allowed = [(i, s) for i, s in enumerate(specs) if id(s) in allowed]
        plan.template_tools = _template_tools(req.tools) if self._renders_tools else None
        plan.conversation = self.conversation(req.messages, plan.parser)
        kind = choice if choice in ("auto", "required") else "named"
        if self._renders_tools:
            plan.route = f"{kind}, {plan.parser.name} format, tools rendered by the chat template"
        else:
            where = _describe_tools(plan.conversation, req.tools, chosen, plan.parser, free, self._system_role)
            plan.route = f"{kind}, {plan.parser.name} format, tools described in the {where}"
        return plan

    def conversation(self, messages: Sequence[ChatMessage], parser: ToolParser | None = None) -> list[dict]:
        """The messages as the chat template takes them (transformers' shape); past calls are written in ``parser``'s
        format for a template that ignores ``tool_calls``, and results become user text where the ``tool`` role is
        refused.

        Raises:
            APIError: 400 for a ``tool_call_id`` no earlier call has, or arguments that are not a JSON object.
        """
        parser = parser or self._parser or JsonListToolParser()
        out: list[dict] = []
        call_ids: dict[str, str] = {}  # id -> function name
        results: dict | None = None  # the user turn that holds the latest results, for a template without the role
        for i, m in enumerate(messages):
            msg: dict = {"role": m.template_role(), "content": utf8_text(m.text(), "messages")}
            if m.tool_calls:
                calls = []
                for j, c in enumerate(m.tool_calls):
                    call_ids[c.id] = c.function.name
                    param = f"messages[{i}].tool_calls[{j}].function.arguments"
                    try:
                        args = loads(c.function.arguments)
                    except ValueError as e:
                        raise APIError.bad_request(f"{param} must be a JSON object as text: {e}", param=param) from None
                    if not isinstance(args, dict):
                        raise APIError.bad_request(f"{param} must be a JSON object as text", param=param)
                    calls.append(
                        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}
                    )
                if self._renders_tool_calls:
                    msg["tool_calls"] = calls
                    if m.content is None:
                        msg["content"] = None
                else:
                    listed = parser.render(
                        [parser.call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
                    )
                    msg["content"] = f"{msg['content']}\n{listed}" if msg["content"] else listed
            if m.role == "tool":
                if m.tool_call_id not in call_ids:
                    raise APIError.bad_request(
                        f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no tool call of an earlier "
                        "assistant message",
                        param=f"messages[{i}].tool_call_id",
                    )
                if self._results_as_text:
                    text = f"{call_ids[m.tool_call_id]} returned: {msg['content']}"
                    if results is None:
                        results = {"role": "user", "content": text}
                        out.append(results)
                    else:
                        results["content"] += f"\n\n{text}"
                    continue
                msg["tool_call_id"] = m.tool_call_id
                if m.name:
                    msg["name"] = m.name
            if results is not None and msg["role"] == "user":
                results["content"] += f"\n\n{msg['content']}"
                continue
            results = None
            out.append(msg)
        return out


def _tool_specs(tools: list[ChatTool]) -> list[ToolSpec]:
    specs, seen = [], set()
    for i, t in enumerate(tools):
        f = t.function
        if not _NAME.fullmatch(f.name):
            raise APIError.bad_request(
                f"tools[{i}].function.name {f.name!r} must be 1 to 64 letters, digits, underscores or dashes",
                param=f"tools[{i}].function.name",
            )
        if f.name in seen:
            raise APIError.bad_request(
                f"tools[{i}].function.name {f.name!r} names two tools", param=f"tools[{i}].function.name"
            )
        seen.add(f.name)
        params = _NO_PARAMETERS if f.parameters is None else f.parameters
        if params.get("type", "object") != "object":
            raise APIError.bad_request(
                f"tools[{i}].function.parameters must be a JSON schema of type object",
                param=f"tools[{i}].function.parameters",
            )
        try:
            check_finite(params, f"tools[{i}].function.parameters")
            specs.append(ToolSpec(f.name, _closed(params)))
        except GrammarError as e:
            raise APIError.bad_request(str(e), param=e.param) from None
        except RecursionError:
            raise APIError.bad_request(
                f"tools[{i}].function.parameters is nested too deeply to be a JSON schema",
                param=f"tools[{i}].function.parameters",
            ) from None
    return specs


def _closed(schema: object) -> object:
    """``schema`` with ``additionalProperties: false`` on each object that lists its properties and does not say
    otherwise: the model writes only declared properties, which the schema allows too."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _closed(s) for name, s in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_closed(s) for s in value]
        elif key in _SCHEMA_ONE:
            out[key] = _closed(value)
    if isinstance(schema.get("properties"), dict) and not {"additionalProperties", "patternProperties"} & schema.keys():
        out["additionalProperties"] = False
    return out


def _tool_choice(choice: object, specs: list[ToolSpec]) -> str:
    """``"none"``, ``"auto"``, ``"required"`` or the named function's name.

    Raises:
        APIError: 400 for anything else, a function not in ``tools``, or a choice that needs tools without them.
    """
    if choice is None:
        return "auto" if specs else "none"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError.bad_request(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if name not in {s.name for s in specs}:
            raise APIError.bad_request(
                f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice"
            )
        return name
    if choice not in ("none", "auto", "required"):
        raise APIError.bad_request(
            f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}', param="tool_choice"
        )
    if choice == "required" and not specs:
        raise APIError.bad_request('tool_choice "required" needs tools', param="tool_choice")
    return "none" if not specs else choice


def _template_tools(tools: list[ChatTool]) -> list[dict]:
    return [t.model_dump(exclude_none=True) for t in tools]


def compile_tool_grammar(plan: ToolPlan) -> str:
    """The plan's grammar compiled and checked (slow for many tools: off the event loop).

    Raises:
        APIError: 400 naming the tool whose schema llguidance refuses (``tools`` if none alone).
    """
    try:
        grammar = build_grammar("lark", plan.grammar, "tools")
        check_grammar(grammar, "tools")
        return grammar
    except GrammarError as e:
        for i, s in plan.allowed:
            param = f"tools[{i}].function.parameters"
            try:
                check_grammar(build_grammar("json_schema", s.parameters, param), param)
            except GrammarError as culprit:
                raise APIError.bad_request(str(culprit), param=culprit.param) from None
        raise APIError.bad_request(str(e), param="tools") from None


def _describe_tools(
    conversation: list[dict],
    tools: list[ChatTool],
    chosen: list[ToolSpec],
    parser: ToolParser,
    free: bool,
    system_role: bool,
) -> str:
    """Describe the functions to a model whose template would not show them; returns where ("system message" or "first
    user message")."""
    names = {s.name for s in chosen}
    described = "\n".join(
        json.dumps(t.function.model_dump(exclude_none=True)) for t in tools if t.function.name in names
    )
    if free:
        how = f"To call one, write the call in this format:\n{parser.render([parser.example_call])}\nor answer in text."
    else:
        how = (
            f"Reply with a JSON list of the calls to make, as {parser.render([parser.example_call])}, and nothing else."
        )
    text = f"You can call functions. {how} The functions:\n{described}"
    if conversation and conversation[0]["role"] == "system":
        conversation[0]["content"] = f"{conversation[0]['content']}\n\n{text}"
    elif system_role:
        conversation.insert(0, {"role": "system", "content": text})
    else:
        user = next((m for m in conversation if m["role"] == "user"), None)
        if user is None:
            conversation.insert(0, {"role": "user", "content": text})
        else:
            user["content"] = f"{text}\n\n{user['content']}"
        return "first user message"
    return "system message"


def new_call_id() -> str:
    """A fresh ``tool_calls[].id``."""
    return f"call_{uuid.uuid4().hex[:24]}"


def message_calls(calls: list[ToolCall]) -> list[ToolCallOut]:
    """Parsed calls as ``message.tool_calls``, each with a fresh id."""
    return [ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]


class ChatToolStream:
    """One streamed choice's parser, turning its text deltas into content and ``tool_calls`` deltas."""

    def __init__(self, parser: ToolParser):
        self._stream: ToolCallStream = parser.stream()
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str | None, list[DeltaToolCall] | None]:
        """``(content, tool_calls)`` of the next delta (each None when empty)."""
        return self._deltas(self._stream.feed(text))

    def finish(self) -> tuple[str | None, list[DeltaToolCall] | None]:
        """As ``feed``, for what was held back, at the end."""
        return self._deltas(self._stream.finish())

    def _deltas(self, events: list[Event]) -> tuple[str | None, list[DeltaToolCall] | None]:
        content = "".join(e for e in events if isinstance(e, str))
        calls: list[DeltaToolCall] = []
        for e in events:
            if not isinstance(e, ToolCallDelta):
                continue
            if e.name is not None:
                self.num_calls += 1
                calls.append(
                    DeltaToolCall(
                        index=e.index,
                        id=new_call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=e.name, arguments=e.arguments),
                    )
                )
            elif calls and calls[-1].index == e.index:  # one delta per call per chunk
                calls[-1].function.arguments += e.arguments
            else:
                calls.append(DeltaToolCall(index=e.index, function=DeltaFunctionCall(arguments=e.arguments)))
        return content or None, calls or None
