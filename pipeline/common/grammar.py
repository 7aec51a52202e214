"""Structured output: grammars through llguidance (no torch).

io_proc turns ``response_format`` (and vLLM's ``guided_*`` fields) into an llguidance grammar (``build_grammar``); the
grammar travels as text in ``SamplingParams.grammar``. The scheduler compiles it, off its loop, and holds a matcher per
constrained request, which advances with each output token and gives the token bitmask of the next sampled position
(``pipeline.scheduler_proc.grammar_manager``; docs/design.md, "Structured output").

Sources: OpenAI's structured outputs guide (``response_format`` ``json_object`` and ``json_schema``), vLLM's guided
decoding extensions (``guided_json``, ``guided_regex``, ``guided_choice``), and llguidance's Python API and JSON schema
support (github.com/guidance-ai/llguidance, ``python/llguidance/_lib.pyi`` and ``docs/json_schema.md``).
"""

from __future__ import annotations

import json
from pathlib import Path

import llguidance

from pipeline.common.finite_schema import admits_finite_value

# llguidance's Earley parser keeps at most this many items in a row (its
# default max_items_in_row is 2,000): a choice list whose entries share a
# prefix puts one item per entry in a row, so more entries than this would
# put the matcher in its error state mid-output.
MAX_GUIDED_CHOICES = 1999


class GrammarError(ValueError):
    """A grammar llguidance cannot compile; ``param`` names the request field it came from."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def build_grammar(kind: str, spec: object, param: str) -> str:
    """The llguidance grammar for one structured-output request.

    Its form is checked here, and a JSON schema that admits only infinite values is refused; whether llguidance can
    compile it (and within the memory a request may take) is found when the scheduler compiles it.

    Args:
        kind: ``"json_object"`` (any JSON object), ``"json_schema"`` (``spec`` a JSON schema as a dict or JSON text),
            ``"regex"`` (``spec`` a regular expression in Rust's ``regex`` syntax), ``"choice"`` (``spec`` a non-empty
            list of strings: exactly one of them) or ``"lark"`` (``spec`` a grammar in llguidance's Lark dialect, as
            tool calling builds them).
        spec: as ``kind`` says; ignored for ``json_object``.
        param: the request field ``spec`` came from, for the error.

    Returns:
        The grammar as llguidance's JSON text (``LLMatcher`` takes it).

    Raises:
        GrammarError: the schema, regex or choice list is malformed or not supported, or the schema admits no finite
            value.
    """
    if kind == "json_object":
        kind, spec = "json_schema", {"type": "object"}
    try:
        if kind == "json_schema":
            text = spec if isinstance(spec, str) else json.dumps(spec)
            schema = json.loads(text)
            if not isinstance(schema, dict):
                raise GrammarError("the JSON schema must be an object", param)
            check_finite(schema, param)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            if not spec or not all(isinstance(c, str) and c for c in spec):
                raise GrammarError("guided_choice must be a non-empty list of non-empty strings", param)
            if len(spec) > MAX_GUIDED_CHOICES:
                raise GrammarError(
                    f"guided_choice has {len(spec)} choices; at most {MAX_GUIDED_CHOICES} are supported "
                    "(llguidance's max_items_in_row): use guided_regex or a JSON schema enum for more",
                    param,
                )
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
    return grammar


def check_finite(schema: object, param: str) -> None:
    """Raise ``GrammarError`` naming ``param`` if the JSON schema admits no finite value (``finite_schema``)."""
    if not admits_finite_value(schema):
        raise GrammarError(
            f"{param} admits no finite value: a required property or item refers back to a schema "
            "that contains it, with no alternative that ends",
            param,
        )


def check_grammar(grammar: str, param: str) -> None:
    """Raise ``GrammarError`` naming ``param`` if llguidance cannot compile ``grammar``.

    Checked without the tokenizer (milliseconds for a few tool schemas, on the caller's thread: llguidance lets go of
    the GIL); only tool calling checks here, to name the tool at fault. The scheduler compiles for real.
    """
    if err := llguidance.LLMatcher.validate_grammar(grammar, None):
        raise GrammarError(f"{param} is invalid: {err}", param)


def load_tokenizer(tokenizer_dir: str, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer, from ``tokenizer_dir/tokenizer.json``.

    Building it takes about 0.2 s for a 49,152-token vocabulary, so the scheduler does it once at start-up. Token ids up
    to ``vocab_size`` (the model's embedding rows, which may exceed the tokenizer's) get mask bits.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` (only fast tokenizers are supported).
    """
    text = (Path(tokenizer_dir) / "tokenizer.json").read_text()
    return llguidance.LLTokenizer(text, n_vocab=vocab_size)
