"""A JSON schema read as a schema: which values are subschemas (so that a property *named* `pattern`
is not taken for the keyword), and what a request's schema may not do before it is compiled."""

from __future__ import annotations

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def subschemas(schema):
    """The schemas directly inside `schema` (a dict; booleans and other values have none)."""
    if not isinstance(schema, dict):
        return
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield schema[key]
    for key in _LIST:
        if isinstance(schema.get(key), list):
            yield from (s for s in schema[key] if isinstance(s, dict))
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            yield from (s for s in schema[key].values() if isinstance(s, dict))


def walk(schema):
    """Every schema node, `schema` first (iterative: the depth bound is checked elsewhere)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(subschemas(node))


def depth(value) -> int:
    """How deep the JSON value nests (objects and arrays), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def num_values(schema) -> int:
    """The enum and const values the schema lists (each one an alternative in its grammar)."""
    count = 0
    for node in walk(schema):
        if isinstance(node.get("enum"), list):
            count += len(node["enum"])
        count += "const" in node
    return count


def external_ref(schema) -> str | None:
    """The first $ref that points outside the schema (a file, a URL, another document)."""
    return next((node["$ref"] for node in walk(schema)
                 if isinstance(node.get("$ref"), str) and not node["$ref"].startswith("#")), None)


def unenforced(schema) -> str | None:
    """A keyword combination xgrammar accepts but does not enforce (found by the tests' jsonschema
    oracle): a string's pattern wins over its minLength / maxLength. Refused rather than ignored."""
    for node in walk(schema):
        if "pattern" in node and ("minLength" in node or "maxLength" in node):
            return "a string with both pattern and minLength/maxLength (put the length in the pattern, e.g. {2,4})"
    return None
