"""A ``/v1/responses`` answer being built: its output items, whole or as the stream's semantic events."""

from __future__ import annotations

import time
import uuid

from pipeline.io_proc.openai.response_store import StoredResponse
from pipeline.io_proc.openai.responses_input import ResponsesRequest
from pipeline.io_proc.openai.serving import json_body


class Events:
    """Server-sent events of a Responses stream, numbered in order."""

    def __init__(self):
        self._seq = 0

    def __call__(self, kind: str, **data: object) -> bytes:
        body = json_body({"type": kind, "sequence_number": self._seq, **data})
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


class ResponseBuilder:
    """A response being built: its output items, whole or streamed; ``previous`` is the stored response it continues
    (None: none)."""

    def __init__(self, req: ResponsesRequest, model: str, previous: StoredResponse | None):
        self.req, self.model, self.previous = req, model, previous
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self.num_calls = 0
        self._open: dict | None = None  # the item a stream is writing

    def add_message(self, text: str) -> dict:
        item = {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex}",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }
        self.output.append(item)
        return item

    def add_call(self, call_id: str, name: str, arguments: str) -> dict:
        item = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": "completed",
        }
        self.output.append(item)
        self.num_calls += 1
        return item

    def object(self, finish_reason: str | None, usage: object) -> dict:
        """The response object: in progress while ``finish_reason`` is None."""
        req = self.req
        status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": self.output if finish_reason is not None else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "usage": None if usage is None else _usage(usage),
        }

    def stream_delta(self, ev: Events, content: str | None, calls: list | None, empty: bool = False) -> list[bytes]:
        """Events for a delta's text and call pieces, opening and closing items as they start and end (``empty``: open a
        message for no text)."""
        out: list[bytes] = []
        if content or empty:
            if self._open is None or self._open["type"] != "message":
                out += self.close_open(ev)
                item = self.add_message("")
                item["status"] = "in_progress"
                self._open = item
                part = item["content"][0]
                out.append(ev("response.output_item.added", output_index=len(self.output) - 1, item=_in_progress(item)))
                out.append(
                    ev(
                        "response.content_part.added",
                        item_id=item["id"],
                        output_index=len(self.output) - 1,
                        content_index=0,
                        part={**part, "text": ""},
                    )
                )
            item = self._open
            item["content"][0]["text"] += content
        if content:
            out.append(
                ev(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=len(self.output) - 1,
                    content_index=0,
                    delta=content,
                    logprobs=[],
                )
            )
        for d in calls or []:
            if d.id is not None:  # a new call
                out += self.close_open(ev)
                item = self.add_call(d.id, d.function.name, "")
                item["status"] = "in_progress"
                self._open = item
                out.append(ev("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
            fragment = d.function.arguments or ""
            if fragment:
                self._open["arguments"] += fragment
                out.append(
                    ev(
                        "response.function_call_arguments.delta",
                        item_id=self._open["id"],
                        output_index=len(self.output) - 1,
                        delta=fragment,
                    )
                )
        return out

    def close_open(self, ev: Events) -> list[bytes]:
        """The ``*.done`` events of the item being written, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        index, out = len(self.output) - 1, []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                ev(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            out.append(
                ev("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
            )
        else:
            out.append(
                ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(ev("response.output_item.done", output_index=index, item=item))
        return out


def _in_progress(item: dict) -> dict:
    return {**item, "content": []}


def _usage(u) -> dict:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }
