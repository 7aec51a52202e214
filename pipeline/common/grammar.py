"""Structured output: grammars through llguidance (no torch).

io_proc turns ``response_format`` (and vLLM's ``guided_*`` fields) into an
llguidance grammar and validates it (:func:`build_grammar`); the grammar
travels as text in ``SamplingParams.grammar``. The scheduler holds one
:class:`GrammarState` per constrained request: it advances the matcher with
each output token that arrives and writes the token bitmask of the next
sampled position into the step's descriptor (docs/design.md, "Structured
output").

Sources: OpenAI's structured outputs guide (``response_format``
``json_object`` and ``json_schema``), vLLM's guided decoding extensions
(``guided_json``, ``guided_regex``, ``guided_choice``), and llguidance's
Python API and JSON schema support (github.com/guidance-ai/llguidance,
``python/llguidance/_lib.pyi`` and ``docs/json_schema.md``).
"""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np

from pipeline.common.step_protocol import MASK_BITS


class GrammarError(ValueError):
    """A grammar llguidance cannot compile; ``param`` names the request field it came from."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def build_grammar(kind: str, spec: object, param: str) -> str:
    """The llguidance grammar for one structured-output request, validated.

    Args:
        kind: ``"json_object"`` (any JSON object), ``"json_schema"`` (``spec``
            a JSON schema as a dict or JSON text), ``"regex"`` (``spec`` a
            regular expression in Rust's ``regex`` syntax), ``"choice"``
            (``spec`` a non-empty list of strings: exactly one of them) or
            ``"lark"`` (``spec`` a grammar in llguidance's Lark dialect, as
            tool calling builds them).
        spec: as ``kind`` says; ignored for ``json_object``.
        param: the request field ``spec`` came from, for the error.

    Returns:
        The grammar as llguidance's JSON text (``LLMatcher`` takes it).

    Raises:
        GrammarError: the schema, regex or choice list is malformed or not supported.
    """
    if kind == "json_object":
        kind, spec = "json_schema", {"type": "object"}
    try:
        if kind == "json_schema":
            text = spec if isinstance(spec, str) else json.dumps(spec)
            if not isinstance(json.loads(text), dict):
                raise GrammarError("the JSON schema must be an object", param)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            if not spec or not all(isinstance(c, str) and c for c in spec):
                raise GrammarError("guided_choice must be a non-empty list of non-empty strings", param)
            grammar = llguidance.grammar_from("choice", json.dumps(spec))
        elif kind == "lark":
            grammar = llguidance.LLMatcher.grammar_from_lark(spec)
        else:
            raise GrammarError(f"unknown grammar kind {kind!r}", param)
    except (ValueError, TypeError) as e:  # llguidance raises ValueError; json.loads its subclass
        if isinstance(e, GrammarError):
            raise
        raise GrammarError(f"{param} is invalid: {e}", param) from None
    except RecursionError:  # json's parser and encoder recurse once per level of nesting
        raise GrammarError(f"{param} is nested too deeply to be a JSON schema", param) from None
    if err := llguidance.LLMatcher.validate_grammar(grammar, None):
        raise GrammarError(f"{param} is invalid: {err}", param)
    return grammar


def load_tokenizer(tokenizer_dir: str, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer, from ``tokenizer_dir/tokenizer.json``.

    Building it takes about 0.2 s for a 49,152-token vocabulary, so the
    scheduler does it once at start-up. Token ids up to ``vocab_size`` (the
    model's embedding rows, which may exceed the tokenizer's) get mask bits.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` (only fast tokenizers are supported).
    """
    text = (Path(tokenizer_dir) / "tokenizer.json").read_text()
    return llguidance.LLTokenizer(text, n_vocab=vocab_size)


class GrammarState:
    """The matcher of one constrained request, on the scheduler side.

    The matcher has consumed exactly the request's output tokens so far
    (they arrive in order from the StepOutputs), so its mask is the one
    for the next output position, however the request was preempted or
    chunked. Ending is the model's choice among the request's stop token
    ids, which are allowed exactly when the grammar accepts; when the
    grammar cannot continue they are the only tokens allowed, so the
    request finishes with ``"stop"`` in the scheduler and in io_proc
    alike (``check_finish``).

    Args:
        tokenizer: from :func:`load_tokenizer`.
        grammar: from :func:`build_grammar`.
        stop_token_ids: the request's stop ids (non-empty).
    """

    __slots__ = ("_matcher", "_stop_ids", "_eos_id")

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, stop_token_ids: tuple[int, ...]):
        self._matcher = llguidance.LLMatcher(tokenizer, grammar)
        self._stop_ids = np.asarray(stop_token_ids, np.int64)
        self._eos_id = tokenizer.eos_token

    def needs_mask(self, in_flight: int) -> bool:
        """Whether the next sampled token needs a mask, with ``in_flight`` of its tokens not consumed yet.

        Always for a grammar that constrains every token; a row that needs one
        waits for its tokens in flight first.
        """
        return True

    def fork(self) -> GrammarState:
        """A copy of this matcher in its current state (llguidance's deep copy: no recompilation)."""
        copy = GrammarState.__new__(GrammarState)
        copy._matcher, copy._stop_ids, copy._eos_id = self._matcher.deep_copy(), self._stop_ids, self._eos_id
        return copy

    def consume_tokens(self, token_ids: list[int]) -> bool:
        """Advance past ``token_ids`` (text, not stop ids); False if the grammar rejects one."""
        return all(self._matcher.consume_token(t) for t in token_ids)

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into ``out`` (int32 ``[ceil(V / 32)]``, bit set = allowed)."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, out.reshape(1, -1), 0)
        # The tokenizer's EOS stands for "the grammar may end": the request's own stop ids take its place.
        _set_bit(out, np.asarray([self._eos_id]), False)
        if self._matcher.is_accepting() or self._matcher.is_stopped():
            _set_bit(out, self._stop_ids, True)

    def accept(self, token_id: int) -> bool:
        """Advance past output token ``token_id``; a stop id (the end) is not consumed.

        Returns:
            False if the grammar rejects the token (the worker's mask forbids that).
        """
        if token_id in self._stop_ids:
            return True
        return self._matcher.consume_token(token_id)


def _set_bit(mask: np.ndarray, ids: np.ndarray, value: bool) -> None:
    words, bits = ids // MASK_BITS, (ids % MASK_BITS).astype(np.uint32)
    view, bit = mask.view(np.uint32), np.left_shift(np.uint32(1), bits)
    # ufunc.at: several ids may share a word.
    if value:
        np.bitwise_or.at(view, words, bit)
    else:
        np.bitwise_and.at(view, words, ~bit)
