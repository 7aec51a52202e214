"""Llama 3.1 / 3.2 JSON tool calls: the output is ``{"name": ..., "parameters": {...}}``, calls joined by ``; ``."""

from pipeline.io_proc.tool_parsers.base import ToolParser
from pipeline.io_proc.tool_parsers.calls import ToolSpec
from pipeline.io_proc.tool_parsers.json_call import JsonCallScanner, json_call_rules


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    trigger = "{"
    anchored = True
    separator = "; "

    def call_scanner(self) -> JsonCallScanner:
        return JsonCallScanner(("parameters", "arguments"))

    def call_rules(self, tools: list[ToolSpec]) -> str:
        return json_call_rules(tools, "parameters")
