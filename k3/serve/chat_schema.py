"""The subset of JSON Schema that the chat endpoint checks a response_format's content against: the shape of a
schema (`check_schema`, at the request) and where a value breaks it (`schema_errors`, after generation)."""

from __future__ import annotations

import json
import math


def json_short(v, limit: int = 80) -> str:
    """`v` as JSON for a message, clipped to `limit` characters."""
    try:
        r = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        r = repr(v)
    return r if len(r) <= limit else r[:limit - 3] + "..."


JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_COUNT_KEYS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")


def check_schema(schema, where: str) -> None:
    """Raise ValueError naming the place of the first keyword of `schema` with a wrong shape. Checked: type, enum,
    const, properties, required, additionalProperties, items, anyOf/oneOf/allOf, numeric and length bounds;
    other keywords are accepted and not enforced."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object, got {json_short(schema)}")
    t = schema.get("type")
    if t is not None:
        ts = t if isinstance(t, list) else [t]
        if not ts or any(x not in JSON_TYPES for x in ts):
            raise ValueError(f"{where}.type = {json_short(t)} is invalid: one of {list(JSON_TYPES)} or a list of them")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise ValueError(f"{where}.enum must be a list, got {json_short(schema['enum'])}")
    if "required" in schema and not (isinstance(schema["required"], list) and
                                     all(isinstance(x, str) for x in schema["required"])):
        raise ValueError(f"{where}.required must be a list of property names, got {json_short(schema['required'])}")
    for k in _NUMBER_KEYS:
        if k in schema and (isinstance(schema[k], bool) or not isinstance(schema[k], (int, float))):
            raise ValueError(f"{where}.{k} must be a number, got {json_short(schema[k])}")
    for k in _COUNT_KEYS:
        if k in schema and (isinstance(schema[k], bool) or not isinstance(schema[k], int) or schema[k] < 0):
            raise ValueError(f"{where}.{k} must be a non-negative integer, got {json_short(schema[k])}")
    for k in _SCHEMA_MAPS:
        if k in schema:
            if not isinstance(schema[k], dict):
                raise ValueError(f"{where}.{k} must be an object of schemas, got {json_short(schema[k])}")
            for name, sub in schema[k].items():
                check_schema(sub, f"{where}.{k}.{name}")
    for k in _SCHEMA_LISTS:
        if k in schema:
            if not isinstance(schema[k], list) or not schema[k]:
                raise ValueError(f"{where}.{k} must be a non-empty list of schemas, got {json_short(schema[k])}")
            for j, sub in enumerate(schema[k]):
                check_schema(sub, f"{where}.{k}[{j}]")
    for k in ("items", "additionalProperties"):
        if k in schema:
            check_schema(schema[k], f"{where}.{k}")


def _type_ok(v, t: str) -> bool:
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    if t == "string":
        return isinstance(v, str)
    if t == "boolean":
        return isinstance(v, bool)
    if t == "null":
        return v is None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return t == "number" or isinstance(v, int) or (math.isfinite(v) and v == int(v))


def schema_errors(v, schema, where: str = "$") -> list[str]:
    """Where `v` breaks `schema` (a schema check_schema accepts), as messages naming the place ($ is the root)."""
    if schema is True or schema == {}:
        return []
    if schema is False:
        return [f"{where}: no value is allowed here"]
    errs: list[str] = []
    t = schema.get("type")
    if t is not None:
        ts = t if isinstance(t, list) else [t]
        if not any(_type_ok(v, x) for x in ts):
            return [f"{where}: {json_short(v, 40)} is not of type {' or '.join(ts)}"]
    if "enum" in schema and v not in schema["enum"]:
        errs.append(f"{where}: {json_short(v, 40)} is not one of {json_short(schema['enum'])}")
    if "const" in schema and v != schema["const"]:
        errs.append(f"{where}: {json_short(v, 40)} is not {json_short(schema['const'])}")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        for k, bad in (("minimum", lambda b: v < b), ("maximum", lambda b: v > b),
                       ("exclusiveMinimum", lambda b: v <= b), ("exclusiveMaximum", lambda b: v >= b)):
            if k in schema and bad(schema[k]):
                errs.append(f"{where}: {v} breaks {k} {schema[k]}")
    size = len(v) if isinstance(v, (str, list, dict)) else None
    kinds = {str: ("minLength", "maxLength"), list: ("minItems", "maxItems"), dict: ("minProperties", "maxProperties")}
    if size is not None:
        lo, hi = kinds[type(v)]
        if lo in schema and size < schema[lo]:
            errs.append(f"{where}: has {size}, fewer than {lo} {schema[lo]}")
        if hi in schema and size > schema[hi]:
            errs.append(f"{where}: has {size}, more than {hi} {schema[hi]}")
    if isinstance(v, dict):
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            if k not in v:
                errs.append(f"{where}: the required property {k!r} is missing")
        extra = schema.get("additionalProperties", True)
        for k, x in v.items():
            if k in props:
                errs += schema_errors(x, props[k], f"{where}.{k}")
            elif extra is False:
                errs.append(f"{where}: the property {k!r} is not allowed (additionalProperties is false)")
            elif isinstance(extra, dict):
                errs += schema_errors(x, extra, f"{where}.{k}")
    if isinstance(v, list) and isinstance(schema.get("items"), (dict, bool)):
        for j, x in enumerate(v):
            errs += schema_errors(x, schema["items"], f"{where}[{j}]")
    for sub in schema.get("allOf", []):
        errs += schema_errors(v, sub, where)
    for k in ("anyOf", "oneOf"):
        if k in schema:
            ok = sum(not schema_errors(v, sub, where) for sub in schema[k])
            if ok == 0 or (k == "oneOf" and ok > 1):
                errs.append(f"{where}: matches {ok} of the {len(schema[k])} schemas of {k}")
    return errs
