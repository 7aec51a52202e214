"""The format of ``tool_choice`` ``required`` or a named function where no parser fits the template:
``[{"name": ..., "arguments": {...}}, ...]`` (vLLM forces the same list, with ``parameters``)."""

from pipeline.io_proc.tool_parsers.base import ToolParser
from pipeline.io_proc.tool_parsers.calls import ToolSpec
from pipeline.io_proc.tool_parsers.json_call import JsonCallScanner, json_call_rules


class JsonListToolParser(ToolParser):
    name = "json_list"
    trigger = "["
    anchored = True
    region_open = "["
    separator = ", "
    region_close = "]"

    def call_scanner(self) -> JsonCallScanner:
        return JsonCallScanner()

    def call_rules(self, tools: list[ToolSpec]) -> str:
        return json_call_rules(tools)
