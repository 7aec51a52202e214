"""How deeply a request's free-form JSON may nest (docs/design.md, "Bounds per client"): past ``MAX_JSON_DEPTH`` a 400
names the field, before any later walk hits ``RecursionError``."""

from __future__ import annotations

import json

from pydantic import AfterValidator

# Containers inside containers; a JSON schema with 10 levels of nested objects is about 21.
MAX_JSON_DEPTH = 64


def nests_too_deeply(value: object) -> bool:
    """Whether ``value`` (parsed JSON) has containers more than ``MAX_JSON_DEPTH`` deep; iterative."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        if depth > MAX_JSON_DEPTH:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def too_deep_message(what: str) -> str:
    return f"{what} is nested more than {MAX_JSON_DEPTH} levels deep"


def _shallow(value: object) -> object:
    if nests_too_deeply(value):
        raise ValueError(too_deep_message("the value"))
    return value


# On a request field that holds free-form JSON (``Annotated[dict | None, Shallow]``, on the whole
# field so that the error names it and no union member): a validation error, 400, when too deep.
Shallow = AfterValidator(_shallow)


def loads(text: str) -> object:
    """``text`` parsed as JSON.

    Raises:
        ValueError: not JSON, or nested more than ``MAX_JSON_DEPTH`` deep.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(too_deep_message("the JSON")) from None
    if nests_too_deeply(value):
        raise ValueError(too_deep_message("the JSON"))
    return value
