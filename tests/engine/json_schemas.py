"""Forty JSON schemas for the structured-output tests: nested objects, arrays with bounds, enums,
anyOf, patterns, numbers with ranges, booleans, nulls, optional fields. Strings and integers are
bounded so that a small model's output ends within the tests' token budget (unbounded, a greedy
135M model writes digits until it runs out)."""

S = {"type": "string", "maxLength": 12}


def obj(props: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS = [
    obj({"name": S}),
    obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    obj({"point": obj({"x": {"type": "integer", "minimum": -99, "maximum": 99},
                       "y": {"type": "integer", "minimum": -99, "maximum": 99}})}),
    obj({"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    obj({"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}}),
    obj({"nothing": {"type": "null"}}),
    obj({"name": S, "nick": S}, required=["name"]),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9},
                                               "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}),
    obj({"person": obj({"name": S, "address": obj({"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})}),
    obj({"status": {"const": "done"}}),
    obj({"count": {"type": "integer", "minimum": 10, "maximum": 20}}),
    obj({"temp": {"type": "number", "minimum": -50, "maximum": 50}}),
    obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 1, "maximum": 5}}),
    obj({"items": {"type": "array", "items": obj({"sku": S, "qty": {"type": "integer", "minimum": 1,
                                                                     "maximum": 9}}), "maxItems": 2}}),
    obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    obj({"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4}}),
    obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    obj({"level": {"type": "integer", "enum": [1, 2, 3]}}),
    obj({"pair": {"type": "array", "prefixItems": [S, {"type": "integer", "minimum": 0, "maximum": 999}],
                  "items": False, "minItems": 2}}),
    obj({"maybe": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}}),
    obj({"a": obj({"b": obj({"c": obj({"d": {"type": "integer", "minimum": 0, "maximum": 5}})})})}),
    obj({"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}, "genre": {"enum": ["drama",
                                                                                                      "comedy"]}}),
    obj({"ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 10}}),
    obj({"words": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 3, "maxItems": 3}}),
    obj({"code": {"type": "string", "pattern": "^[a-z]{2,4}$"}}),
    obj({"shape": {"anyOf": [obj({"circle": {"type": "integer", "minimum": 1, "maximum": 9}}),
                             obj({"square": {"type": "integer", "minimum": 1, "maximum": 9}})]}}),
    obj({"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]\\.[0-9]$"}}),
    obj({"empty": obj({})}),
    obj({"users": {"type": "array", "items": obj({"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                                  "admin": {"type": "boolean"}}), "minItems": 1, "maxItems": 2}}),
    obj({"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "number", "minimum": 0, "maximum": 9},
         "z": {"type": "boolean"}}),
    obj({"kind": {"enum": ["cat", "dog"]}, "legs": {"const": 4}}),
    obj({"note": S}, required=[]),
    obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    obj({"grid": {"type": "array", "items": {"enum": [0, 1]}, "minItems": 4, "maxItems": 4}}),
    obj({"city": S, "population": {"type": "integer", "minimum": 0, "maximum": 100000000}}),
    obj({"result": {"anyOf": [obj({"ok": {"const": True}}), obj({"error": S})]}}),
]
assert len(SCHEMAS) == 40

# Twenty schemas that bound none of their integers, numbers or strings (what a newcomer writes):
# the server's closing bounds must end each output within 200 tokens.
STR, INT, NUM = {"type": "string"}, {"type": "integer"}, {"type": "number"}
UNBOUNDED = [
    {"type": "object", "properties": {"city": STR, "population_millions": INT},
     "required": ["city", "population_millions"]},
    obj({"name": STR, "age": INT}),
    obj({"title": STR, "year": INT, "rating": NUM}),
    obj({"id": INT}),
    obj({"count": INT, "label": STR}),
    obj({"product": STR, "price": NUM, "stock": INT}),
    obj({"country": STR, "capital": STR}),
    obj({"x": INT, "y": INT, "z": INT}),
    obj({"first_name": STR, "last_name": STR, "email": STR}),
    obj({"temperature": NUM, "unit": STR}),
    obj({"book": obj({"title": STR, "pages": INT})}),
    obj({"tags": {"type": "array", "items": STR, "maxItems": 3}}),
    obj({"answer": STR}),
    obj({"score": INT, "comment": STR}),
    obj({"latitude": NUM, "longitude": NUM}),
    obj({"user": obj({"username": STR, "followers": INT})}),
    obj({"min": INT, "max": INT}),
    obj({"language": STR, "speakers_millions": NUM}),
    obj({"animal": STR, "legs": INT, "can_fly": {"type": "boolean"}}),
    obj({"summary": STR, "words": {"type": "integer", "minimum": 0}}),
]
assert len(UNBOUNDED) == 20
