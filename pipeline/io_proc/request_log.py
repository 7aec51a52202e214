"""``--enable-log-requests``: one log line per finished HTTP request, without its text unless ``--log-prompts``."""

from __future__ import annotations

import logging

import msgspec

from pipeline.common.messages import SamplingParams
from pipeline.io_proc.request_state import RequestState

logger = logging.getLogger("pipeline.requests")

_DEFAULTS = SamplingParams(max_tokens=0)


def _params(params: SamplingParams, n: int, stop: list[str], stream: bool) -> str:
    """The sampling parameters that differ from the defaults (a grammar and biases by their size)."""
    out = {"n": n, "stream": stream}
    for name in params.__struct_fields__:
        if name == "lora_id":  # logged by its name
            continue
        v = getattr(params, name)
        if name == "max_tokens" or v != getattr(_DEFAULTS, name):
            out[name] = v
    if params.grammar:
        out["grammar"] = f"{len(params.grammar)} chars"
    if params.logit_bias:
        out["logit_bias"] = f"{len(params.logit_bias)} ids"
    if stop:
        out["stop"] = stop
    return ", ".join(f"{k}={v!r}" if isinstance(v, str) and k != "grammar" else f"{k}={v}" for k, v in out.items())


def _seconds(values: list[float | None], pick) -> str:
    known = [v for v in values if v is not None]
    return f"{pick(known):.3f}s" if known else "-"


def log_request(
    request_id: str,
    states: list[RequestState],
    n: int,
    stop: list[str],
    stream: bool,
    prompt: object = None,
    tools: str = "",
    lora: str = "",
) -> None:
    """Log one finished (or abandoned) request: its id, prompt tokens, parameters, how its tools reached the model
    (``tools``, a chat request's ``ToolPlan.route``), finish reasons, output tokens, time to first token (the earliest
    choice's) and end-to-end latency (the last choice's).

    ``prompt`` (the request's prompt or messages) is logged only when given: ``--log-prompts``;
    ``lora``: the LoRA adapter it ran with ("" for the base model).
    """
    one = len(states) == 1
    reasons = [st.finish_reason or "abort" for st in states]
    tokens = [st.num_output_tokens for st in states]
    line = (
        f"{request_id}: "
        + (f"lora_adapter={lora!r}, " if lora else "")
        + f"prompt_tokens={sum(st.prompt_len for st in states[::n])}, "
        f"params=({_params(states[0].params, n, stop, stream)}), "
        + (f"tools=({tools}), " if tools else "")
        + f"finish_reason={reasons[0] if one else reasons}, completion_tokens={tokens[0] if one else tokens}, "
        f"ttft={_seconds([st.ttft for st in states], min)}, e2e={_seconds([st.e2e for st in states], max)}"
    )
    if prompt is not None:
        line += f", prompt={msgspec.json.encode(prompt).decode()}"
    logger.info("%s", line)
