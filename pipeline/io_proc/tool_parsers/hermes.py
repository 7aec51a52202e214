"""Hermes 2 Pro / 3, Qwen 2.5, QwQ and Qwen 3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

from pipeline.io_proc.tool_parsers.base import ToolParser
from pipeline.io_proc.tool_parsers.calls import ToolSpec
from pipeline.io_proc.tool_parsers.json_call import JsonCallScanner, json_call_rules


class HermesToolParser(ToolParser):
    name = "hermes"
    trigger = "<tool_call>"
    call_open = "<tool_call>\n"
    call_close = "\n</tool_call>"
    separator = "\n"

    def call_scanner(self) -> JsonCallScanner:
        return JsonCallScanner()

    def call_rules(self, tools: list[ToolSpec]) -> str:
        return json_call_rules(tools)
