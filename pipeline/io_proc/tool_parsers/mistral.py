"""Mistral 7B v0.3 and its kin: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

The marker must reach the text: with a tokenizer that makes ``[TOOL_CALLS]`` a special token, the detokenizer drops it
(docs/design.md, "Tool calling").
"""

from pipeline.io_proc.tool_parsers.json_call import JsonToolParser


class MistralToolParser(JsonToolParser):
    name = "mistral"
    trigger = "[TOOL_CALLS]"
    trigger_in_region = False
    region_open = "["
    separator = ", "
    region_close = "]"
