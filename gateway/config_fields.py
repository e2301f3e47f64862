"""Field-by-field validation of config tables, so that one run reports every problem.

``msgspec.convert`` stops at the first error of a struct. Operators fixing a config want the whole
list, so each table is checked key by key against its struct: unknown keys, missing required
fields, and each value converted on its own (nested tables and arrays of tables recursively).
"""

from __future__ import annotations

import functools
import re
import types
import typing
from typing import Any

import msgspec

from gateway.secret import Secret


def decode_secret(kind: type, value: Any) -> Any:
    """msgspec hook that wraps configured secrets in :class:`Secret`."""
    if kind is Secret:
        if isinstance(value, str):
            return Secret(value)
        raise TypeError(f"Expected `str`, got `{type(value).__name__}`")
    raise NotImplementedError


def check_table(value: Any, struct: type[msgspec.Struct], path: str, problems: list[str]) -> bool:
    """Append every problem of one table to ``problems``; True when there were none."""
    if not isinstance(value, dict):
        problems.append(f"{path or '<root>'}: expected a table, got {_kind(value)}")
        return False
    fields = msgspec.structs.fields(struct)
    known = {f.encode_name for f in fields}
    ok = True
    for key in value:
        if key not in known:
            problems.append(f"{join(path, key)}: unknown field")
            ok = False
    hints = _hints(struct)
    for field in fields:
        where = join(path, field.encode_name)
        if field.encode_name in value:
            ok = check_value(value[field.encode_name], hints[field.name], where, problems) and ok
        elif field.required:
            problems.append(f"{where}: required field is missing")
            ok = False
    return ok


def check_value(value: Any, annotation: Any, path: str, problems: list[str]) -> bool:
    """Check one value against its annotation, descending into tables and arrays of tables."""
    struct, many = _nested_struct(annotation)
    if struct is not None and value is not None:
        if not many:
            return check_table(value, struct, path, problems)
        if not isinstance(value, list):
            problems.append(f"{path}: expected an array of tables, got {_kind(value)}")
            return False
        results = [check_table(item, struct, f"{path}[{i}]", problems) for i, item in enumerate(value)]
        if not all(results):
            return False
    try:
        msgspec.convert(value, annotation, dec_hook=decode_secret)
    except msgspec.ValidationError as exc:
        problems.append(describe(exc, path))
        return False
    return True


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.DOTALL)


def describe(exc: msgspec.ValidationError, path: str) -> str:
    """``path.to.field: message`` for a msgspec validation error raised at ``path``."""
    match = _AT.match(str(exc))
    assert match is not None
    message, where = match.group(1), match.group(2) or ""
    full = path + where if where.startswith("[") or not where else join(path, where.lstrip("."))
    return f"{full}: {message[:1].lower()}{message[1:]}"


def _kind(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


@functools.cache
def _hints(struct: type[msgspec.Struct]) -> dict[str, Any]:
    return typing.get_type_hints(struct, include_extras=True)


def _nested_struct(annotation: Any) -> tuple[type[msgspec.Struct] | None, bool]:
    """The struct inside ``annotation`` (``S``, ``S | None``, ``list[S]``), and whether it is a list."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) != 1:
            return None, False
        return _nested_struct(options[0])
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation, False
    if typing.get_origin(annotation) is list:
        struct, _ = _nested_struct(typing.get_args(annotation)[0])
        return struct, struct is not None
    return None, False
