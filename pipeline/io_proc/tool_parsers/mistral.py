"""Mistral 7B v0.3 and its kin: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

The marker must reach the text: with a tokenizer that makes ``[TOOL_CALLS]`` a
special token, the detokenizer drops it (docs/design.md, "Tool calling").
"""

from pipeline.io_proc.tool_parsers.base import ToolParser
from pipeline.io_proc.tool_parsers.calls import ToolSpec
from pipeline.io_proc.tool_parsers.json_call import JsonCallScanner, json_call_rules


class MistralToolParser(ToolParser):
    name = "mistral"
    trigger = "[TOOL_CALLS]"
    trigger_in_region = False
    region_open = "["
    separator = ", "
    region_close = "]"

    def call_scanner(self) -> JsonCallScanner:
        return JsonCallScanner()

    def call_rules(self, tools: list[ToolSpec]) -> str:
        return json_call_rules(tools)
