"""A JSON schema of ``MonoConfig``, derived from the dataclass and its validators.

Every mono decode option is described once, in ``monodecode/config.py``: a dataclass field (name,
type, default, the comment above it) and a validator (``_choice``, ``_int_range``, ...). This
module turns that into JSON schema, so whatever checks options outside Python (the Helm chart's
``values.schema.json``) accepts what ``MonoConfig.from_dict`` accepts, without a second list:

- types from the field annotations (``bool``, ``int``, ``float``, ``str``, ``tuple[int, ...]``,
  ``X | None``);
- enums and ranges from the validators' own parameters (the options of ``_choice``, the bounds
  of ``_int_range``, ``MAX_WIDTH``);
- descriptions from the comments above each field.

One rule has no JSON-schema form: widths must be ascending (``uniqueItems`` covers duplicates);
the chart checks the order in its templates. A validator this module does not know is an error
naming it, so a new kind of option cannot silently go unchecked.

``python -m monodecode.config_schema [--exclude key,...]`` prints the schema.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, fields
from typing import Any

from monodecode import config
from monodecode.config import MonoConfig
from monodecode.errors import ConfigError

# A path: not blank, no NUL byte (config._path).
_PATH_PATTERN = r"^[^\x00]*[^\x00\s][^\x00]*$"


def _validator_schema(name: str, validator: Callable[..., Any]) -> dict[str, Any]:
    """The constraints one of config's validators enforces, as JSON schema."""
    # a parametrised validator is the inner ``check`` of its factory (``_choice.<locals>.check``)
    kind = validator.__qualname__.split(".<locals>", 1)[0] if validator.__name__ == "check" else validator.__name__
    params = inspect.getclosurevars(validator).nonlocals
    if kind == "_bool":
        return {"type": "boolean"}
    if kind == "_choice":
        return {"type": "string", "enum": list(params["options"])}
    if kind == "_int_range":
        return {"type": "integer", "minimum": params["lo"], "maximum": params["hi"]}
    if kind == "_positive_float":
        return {"type": "number", "exclusiveMinimum": 0}
    if kind == "_positive_at_most":
        return {"type": "number", "exclusiveMinimum": 0, "maximum": params["hi"]}
    if kind == "_nonneg_float":
        return {"type": "number", "minimum": 0}
    if kind == "_widths":
        return {
            "type": "array",
            "minItems": 1,
            "uniqueItems": True,
            "items": {"type": "integer", "minimum": 1, "maximum": config.MAX_WIDTH},
        }
    if kind == "_path":
        return {"type": "string", "pattern": _PATH_PATTERN}
    if kind == "_optional_path":
        return {"type": ["string", "null"], "pattern": _PATH_PATTERN}
    raise ConfigError(
        f"config_schema: option {name!r} uses validator {kind}, which has no JSON schema here "
        "(add it to monodecode/config_schema.py)"
    )


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", tuple: "array", list: "array"}


def _annotation_types(annotation: Any) -> set[str]:
    """JSON types a field's annotation allows (``X | None`` adds null)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_annotation_types(a) for a in typing.get_args(annotation)))
    if annotation is type(None):
        return {"null"}
    base = origin or annotation
    if base not in _JSON_TYPES:
        raise ConfigError(f"config_schema: annotation {annotation!r} has no JSON type")
    return {_JSON_TYPES[base]}


def _field_comments() -> dict[str, str]:
    """The comment lines right above each field of MonoConfig, joined."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(MonoConfig).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        m = re.match(r"([a-z_][a-z0-9_]*)\s*:", stripped)
        if m and pending:
            comments[m.group(1)] = " ".join(pending)
        pending = []
    return comments


def _default(f: Field) -> Any:
    value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    return list(value) if isinstance(value, tuple) else value


def option_schema(f: Field, description: str = "") -> dict[str, Any]:
    """One option: its validator's constraints, checked against the field's annotation."""
    schema = _validator_schema(f.name, config._VALIDATORS[f.name])
    hints = typing.get_type_hints(MonoConfig)
    allowed = _annotation_types(hints[f.name])
    declared = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    # an int is a valid number; a validator must not accept a type the field cannot hold
    if not set(declared) <= allowed | ({"integer"} if "number" in allowed else set()):
        raise ConfigError(
            f"config_schema: option {f.name!r} is annotated {hints[f.name]!r} but its validator accepts {declared}"
        )
    if description:
        schema["description"] = description
    schema["default"] = _default(f)
    return schema


def mono_config_schema(exclude: Iterable[str] = (), *, defaults: bool = True) -> dict[str, Any]:
    """JSON schema of a ``monodecode`` options object: every MonoConfig field but ``exclude``,
    no other key."""
    excluded = set(exclude)
    names = {f.name for f in fields(MonoConfig)}
    unknown = excluded - names
    if unknown:
        raise ConfigError(f"config_schema: cannot exclude unknown option(s) {', '.join(sorted(unknown))}")
    comments = _field_comments()
    props = {}
    for f in fields(MonoConfig):
        if f.name in excluded:
            continue
        schema = option_schema(f, comments.get(f.name, ""))
        if not defaults:
            del schema["default"]
        props[f.name] = schema
    return {"type": "object", "additionalProperties": False, "properties": props}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m monodecode.config_schema", description=__doc__.split("\n")[0])
    parser.add_argument("--exclude", default="", help="comma-separated options to leave out")
    parser.add_argument("--no-defaults", action="store_true", help="omit each option's default")
    args = parser.parse_args(argv)
    try:
        schema = mono_config_schema([k for k in args.exclude.split(",") if k], defaults=not args.no_defaults)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(schema, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
