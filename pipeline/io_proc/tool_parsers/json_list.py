"""The format of ``tool_choice`` ``required`` or a named function where no parser fits the template: ``[{"name": ...,
"arguments": {...}}, ...]`` (vLLM forces the same list, with ``parameters``)."""

from pipeline.io_proc.tool_parsers.mistral import MistralToolParser


class JsonListToolParser(MistralToolParser):
    """Mistral's list without its marker, at the output's start."""

    name = "json_list"
    trigger = "["
    anchored = True
    trigger_in_region = True
