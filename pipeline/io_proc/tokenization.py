"""Loading the tokenizer and turning requests into prompt token ids (``transformers`` is imported lazily: it pulls in
torch)."""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError

from pipeline.common.process import start_background_thread
from pipeline.io_proc.detokenizer import NewDetokenizer, new_detokenizer
from pipeline.io_proc.openai.logprobs_json import TokenTexts
from pipeline.io_proc.openai.protocol import APIError


def load_tokenizer(model_dir: str) -> tuple[Any, tuple[int, ...]]:
    """Load a Hugging Face model directory's tokenizer; returns ``(tokenizer, stop_token_ids)``, the stop ids being its
    EOS plus ``generation_config.json``'s ``eos_token_id``.

    Raises:
        FileNotFoundError: ``model_dir`` is not a directory (nothing is downloaded).
        OSError, ValueError: no usable tokenizer; ``json.JSONDecodeError`` for a broken ``generation_config.json``.
    """
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"{model_dir!r} is not a directory")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    stop_ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        stop_ids.append(int(tokenizer.eos_token_id))
    gen_config = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_config):
        with open(gen_config, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        for t in eos if isinstance(eos, list) else [eos] if eos is not None else []:
            if int(t) not in stop_ids:
                stop_ids.append(int(t))
    return tokenizer, tuple(stop_ids)


def utf8_text(text: str, param: str) -> str:
    """``text`` if it is valid Unicode (JSON can carry lone surrogates).

    Raises:
        APIError: 400 naming ``param``.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError.bad_request(
            f"{param} is not valid Unicode text: {e.reason} at position {e.start}", param=param
        ) from None
    return text


# Function names and a text no template would write unless it renders what it was given.
_PROBE_TOOL, _PROBE_CALL, _PROBE_TEXT = (
    "pipeline_probe_tool_3f9a",
    "pipeline_probe_call_7c2e",
    "pipeline_probe_text_5b1d",
)
# Threads that encode prompts, so one long prompt never queues the others
# behind it (encoding releases the GIL).
ENCODE_THREADS = 4
# A tokenizer whose normalizer may rewrite text (e.g. NFC composition) may
# make it shorter before splitting; the character bound allows this factor.
_NORMALIZER_MARGIN = 4


class Tokenization:
    """Prompt encoding on ``num_threads`` threads sharing the tokenizer (safe: no call changes truncation or padding),
    and decoders for output tokens.

    ``renders_tools``, ``renders_tool_calls``, ``system_role``, ``tool_role``: what the chat template renders;
    ``max_token_chars``: the most characters one token stands for, with a margin if the tokenizer normalizes.
    """

    def __init__(self, tokenizer: Any, num_threads: int = ENCODE_THREADS, chat_template: str | None = None):
        self._tokenizer = tokenizer
        self._chat_template = chat_template or getattr(tokenizer, "chat_template", None) or None
        self.renders_tools, self.renders_tool_calls, self.system_role, self.tool_role = self._probe_template()
        self.vocab_size = len(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        margin = 1 if backend is not None and backend.normalizer is None else _NORMALIZER_MARGIN
        self.max_token_chars = margin * max(1, max(map(len, tokenizer.get_vocab())))
        self._executor = ThreadPoolExecutor(num_threads, "tokenize", start_background_thread, ("tokenize",))

    def max_prompt_chars(self, max_tokens: int) -> int:
        """Characters beyond which a text surely encodes to more than ``max_tokens`` tokens."""
        return max_tokens * self.max_token_chars

    async def encode_chat(
        self, conversation: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Prompt token ids of a conversation: ``render_chat`` then ``encode_rendered`` (raising as they do)."""
        return await self.encode_rendered(await self.render_chat(conversation, add_generation_prompt, tools))

    async def render_chat(
        self, conversation: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The prompt text of a conversation, rendered with the chat template, ``tools`` and the generation prompt.

        Raises:
            APIError: 400 if the model has no chat template or the template rejects the conversation.
        """
        if not self._chat_template:
            raise APIError.bad_request(
                "this model has no chat template: give one with --chat-template, or use /v1/completions",
                param="messages",
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._render_chat, conversation, add_generation_prompt, tools)

    def _render_chat(self, conversation: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        try:
            return self._tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                chat_template=self._chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except (TemplateError, TypeError) as e:  # a template's own TypeError: it cannot render these messages
            raise APIError.bad_request(f"the chat template rejected the messages: {e}", param="messages") from e

    async def encode_rendered(self, text: str) -> list[int]:
        """Prompt token ids of a rendered chat prompt, no special tokens added (as ``apply_chat_template`` tokenizes).

        Raises:
            APIError: 400 if the text is not valid Unicode (a tool's lone surrogate, which ``tojson`` keeps).
        """
        utf8_text(text, "messages")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._encode_text, text, False)

    def _probe_template(self) -> tuple[bool, bool, bool, bool]:
        """Whether the template renders tools, past tool calls, a system and a tool message (probed)."""
        if not self._chat_template:
            return False, False, False, False

        def render(messages: list[dict], tools: list[dict] | None = None) -> str:
            try:
                return self._tokenizer.apply_chat_template(
                    messages, tools=tools, chat_template=self._chat_template, tokenize=False
                )
            except TemplateSyntaxError:
                raise
            except Exception:  # a template that cannot render the probe cannot render these
                return ""

        tool = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "", "parameters": {}}}
        call = {"id": "call_0", "type": "function", "function": {"name": _PROBE_CALL, "arguments": {}}}
        user = {"role": "user", "content": "hi"}
        history = [user, {"role": "assistant", "content": None, "tool_calls": [call]}]
        history.append({"role": "tool", "tool_call_id": "call_0", "content": "ok"})
        system = {"role": "system", "content": _PROBE_TEXT}
        answered = [user, {"role": "assistant", "content": "ok"}, {**history[2], "content": _PROBE_TEXT}]
        return (
            _PROBE_TOOL in render([user], [tool]),
            _PROBE_CALL in render(history, [tool]),
            _PROBE_TEXT in render([system, user]),
            _PROBE_TEXT in render(answered),
        )

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Prompt token ids of a completion prompt (with the tokenizer's usual special tokens, e.g. BOS, unless
        ``add_special_tokens`` is false, as vLLM does)."""
        utf8_text(text, "prompt")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._encode_text, text, add_special_tokens)

    def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens kept, as vLLM's ``echo`` and ``/detokenize`` give it)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._tokenizer.decode, token_ids)

    @functools.cached_property
    def token_texts(self) -> TokenTexts:
        """Each token's text and bytes, for log-probabilities (event loop only)."""
        return TokenTexts(self._tokenizer)

    def make_detokenizer(self) -> NewDetokenizer:
        """A per-request detokenizer factory for the output-reader thread, over a private copy of the tokenizer.

        Raises:
            ValueError: the tokenizer is not a fast one (no ``tokenizer.json``).
        """
        backend = getattr(copy.deepcopy(self._tokenizer), "backend_tokenizer", None)
        if backend is None:
            raise ValueError("pipeline needs a fast tokenizer (a tokenizer.json in the model directory)")
        return new_detokenizer(backend)

    def close(self) -> None:
        """Stop the encoding threads; queued work is cancelled."""
        self._executor.shutdown(wait=False, cancel_futures=True)
