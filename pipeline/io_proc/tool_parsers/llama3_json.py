"""Llama 3.1 / 3.2 JSON tool calls: the output is ``{"name": ..., "parameters": {...}}``, calls joined by ``; ``."""

from pipeline.io_proc.tool_parsers.json_call import JsonToolParser


class Llama3JsonToolParser(JsonToolParser):
    name = "llama3_json"
    trigger = "{"
    anchored = True
    separator = "; "
    args_keys = ("parameters", "arguments")
