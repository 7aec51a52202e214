"""Whether a JSON schema admits a finite value, which llguidance does not check (docs/design.md, "Structured output",
"Errors").

E.g. ``{"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}}`` compiles but fails mid-output.
Productive sub-schemas are found by a linear worklist fixpoint; only references, combinators, required properties and
``minItems`` can make a value infinite.
"""

from __future__ import annotations

from collections.abc import Callable

_Productive = Callable[[object], bool]


def admits_finite_value(schema: object) -> bool:
    """Whether ``schema`` (a JSON schema, parsed) has a finite value, as far as its references and required parts tell;
    True where unsure, and for a schema without references (a finite tree)."""
    nodes = _subschemas(schema)
    if not any("$ref" in node for node in nodes):
        # A tree: only a `false` part can leave it without values, and llguidance refuses those.
        return schema is not False
    productive: set[int] = set()

    def known(s: object) -> bool:
        return not isinstance(s, dict) and s is not False or id(s) in productive

    # A worklist: each sub-schema is looked at again when one it depends on turns productive.
    dependents: dict[int, list[dict]] = {}
    for node in nodes:
        for part in _parts(node, schema):
            dependents.setdefault(id(part), []).append(node)
    pending = list(nodes)
    while pending:
        node = pending.pop()
        if id(node) not in productive and _productive(node, schema, known):
            productive.add(id(node))
            pending.extend(dependents.get(id(node), ()))
    return known(schema)


def _parts(s: dict, root: object) -> list[dict]:
    """The sub-schemas whose productivity ``_productive`` may read for ``s`` (a superset)."""
    out = [_resolve(root, s.get("$ref"))]
    for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
        if isinstance(s.get(key), list):
            out += s[key]
    if isinstance(s.get("properties"), dict):
        out += s["properties"].values()
    out.append(s.get("items"))
    return [p for p in out if isinstance(p, dict)]


def _productive(s: dict, root: object, known: _Productive) -> bool:
    if "$ref" in s:
        target = _resolve(root, s["$ref"])
        if target is not None and not known(target):
            return False
    for key, test in (("allOf", all), ("anyOf", any), ("oneOf", any)):
        parts = s.get(key)
        if isinstance(parts, list) and parts and not test(known(p) for p in parts):
            return False
    types = s.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types or any(t not in ("object", "array") for t in types):
        return True  # any type, or one with values that contain nothing
    return ("object" in types and _object_productive(s, known)) or ("array" in types and _array_productive(s, known))


def _object_productive(s: dict, known: _Productive) -> bool:
    required, props = s.get("required"), s.get("properties")
    if not isinstance(required, list) or not isinstance(props, dict):
        return True
    return all(known(props[name]) for name in required if isinstance(name, str) and name in props)


def _array_productive(s: dict, known: _Productive) -> bool:
    min_items = s.get("minItems", 0)
    if not isinstance(min_items, int) or min_items <= 0:
        return True
    prefix = s.get("prefixItems")
    prefix = prefix if isinstance(prefix, list) else []
    items = s.get("items", True)
    return all(known(prefix[i]) for i in range(min(min_items, len(prefix)))) and (
        min_items <= len(prefix) or known(items)
    )


def _resolve(root: object, ref: object) -> object | None:
    """The sub-schema a local reference (``#``, ``#/$defs/x``) names; None for any other."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _subschemas(schema: object) -> list[dict]:
    """Every object in ``schema``, parents before their parts (iterative)."""
    out: list[dict] = []
    stack = [schema]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            out.append(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out
