"""Hermes 2 Pro / 3, Qwen 2.5, QwQ and Qwen 3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

from pipeline.io_proc.tool_parsers.json_call import JsonToolParser


class HermesToolParser(JsonToolParser):
    name = "hermes"
    trigger = "<tool_call>"
    call_open = "<tool_call>\n"
    call_close = "\n</tool_call>"
    separator = "\n"
