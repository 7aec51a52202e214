"""Tool-call parsers by ``--tool-call-parser`` name (vLLM's names); adding one is a module and a line here."""

from pipeline.io_proc.tool_parsers.base import ToolParser
from pipeline.io_proc.tool_parsers.calls import ToolCall, ToolCallDelta, ToolSpec
from pipeline.io_proc.tool_parsers.hermes import HermesToolParser
from pipeline.io_proc.tool_parsers.json_list import JsonListToolParser
from pipeline.io_proc.tool_parsers.llama3_json import Llama3JsonToolParser
from pipeline.io_proc.tool_parsers.mistral import MistralToolParser
from pipeline.io_proc.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}

__all__ = ["TOOL_PARSERS", "JsonListToolParser", "ToolCall", "ToolCallDelta", "ToolParser", "ToolSpec"]
