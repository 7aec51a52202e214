"""Structured output: grammars through llguidance, no torch (docs/design.md, "Structured output").

Sources: OpenAI's structured outputs guide, vLLM's ``guided_*`` extensions, llguidance's Python API and JSON schema
support (github.com/guidance-ai/llguidance, ``python/llguidance/_lib.pyi``, ``docs/json_schema.md``).
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
    """The llguidance grammar (JSON text) for one structured-output request; compilability is found by the scheduler.

    ``kind``: ``"json_object"``, ``"json_schema"`` (dict or JSON text), ``"regex"`` (Rust ``regex`` syntax),
    ``"choice"`` (non-empty list of strings) or ``"lark"`` (llguidance's Lark); ``param`` names the field in errors.

    Raises:
        GrammarError: the schema, regex or choice list is malformed or unsupported, or admits no finite value.
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
    """Raise ``GrammarError`` naming ``param`` if llguidance cannot compile ``grammar`` (no tokenizer; tool calling
    only)."""
    if err := llguidance.LLMatcher.validate_grammar(grammar, None):
        raise GrammarError(f"{param} is invalid: {err}", param)


def load_tokenizer(tokenizer_dir: str, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer, from ``tokenizer_dir/tokenizer.json``; ids up to ``vocab_size`` get
    bits.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` (only fast tokenizers are supported).
    """
    text = (Path(tokenizer_dir) / "tokenizer.json").read_text()
    return llguidance.LLTokenizer(text, n_vocab=vocab_size)
