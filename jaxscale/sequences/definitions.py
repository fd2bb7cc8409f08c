"""Sequence definitions as code: event types, enrichments and sequences, compiled to portable JSON.

A definitions file is plain Python that builds these frozen dataclasses; `compile` validates them and
writes JSON with a schema version. Every runtime (backfill, stream, serve, the training reader) reads only
that JSON, so one definition drives all of them.

    CLICK = EventType("click", raw=("click", "pin_click"))      # raw event_type values -> "click"
    ITEMS = Enrichment("items", key="item_id", fields={"category": "int64"})   # join a table on item_id
    ENGAGEMENT = Sequence("engagement", event_types=("click",), fields=("item_id", "ts", "category"),
                          max_length=256)

Every error is a `DefinitionError` naming the definition and the field.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
"""Version of the compiled JSON format; runtimes reject any other."""
KIND = "jaxscale.sequences/definitions"

RAW_FIELDS: dict[str, str] = {
    "user_id": "int64",
    "ts": "int64",
    "event_type": "string",
    "item_id": "int64",
    "surface": "string",
}
"""The raw event schema: column -> type. `ts` is epoch milliseconds. Extra columns are allowed (ignored)."""
EVENT_FIELDS = ("item_id", "ts", "event_type", "surface")
"""Raw fields a sequence may carry (user_id is the sequence's key, not a field)."""
FIELD_TYPES = ("int64", "float64", "string")
"""Types an enrichment field may have."""
TYPE_DEFAULTS = {"int64": -1, "float64": 0.0, "string": ""}
"""Value of an enrichment field when the key is not in the table (overridable per field)."""
ORDERINGS = ("ts",)
"""Sequence orderings: by event time (ties broken by arrival order)."""

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RAW_VALUE_MAX = 256


class DefinitionError(ValueError):
    """A definition is invalid; the message names the definition and the field."""

    def __init__(self, definition: str, field: str | None, message: str):
        where = f"{definition}, field {field!r}" if field else definition
        super().__init__(f"{where}: {message}")
        self.definition, self.field = definition, field


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_name(owner: str, value, field: str = "name") -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise DefinitionError(owner, field, f"must be an identifier (letters, digits, _), got {value!r}")


def _str_tuple(owner: str, field: str, value, *, allow_empty: bool = False) -> tuple[str, ...]:
    """A tuple of distinct non-empty strings (a lone string is an error: ('a') is a common slip)."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise DefinitionError(owner, field, f"must be a tuple of strings, got {type(value).__name__} {value!r}")
    items = tuple(value)
    for v in items:
        if not isinstance(v, str) or not v:
            raise DefinitionError(owner, field, f"must hold non-empty strings, got {v!r}")
        if len(v) > _RAW_VALUE_MAX:
            raise DefinitionError(
                owner, field, f"values must be at most {_RAW_VALUE_MAX} characters, got {v[:40]!r}..."
            )
    dup = sorted({v for v in items if items.count(v) > 1})
    if dup:
        raise DefinitionError(owner, field, f"lists {dup} more than once")
    if not items and not allow_empty:
        raise DefinitionError(owner, field, "must not be empty")
    return items


@dataclasses.dataclass(frozen=True)
class EventType:
    """A normalized event type: raw `event_type` values that map to it (default: its own name)."""

    name: str
    raw: tuple[str, ...] = ()

    def __post_init__(self):
        _check_name("event type", self.name)
        owner = f"event type {self.name!r}"
        object.__setattr__(self, "raw", _str_tuple(owner, "raw", self.raw or (self.name,)))

    def to_json(self) -> dict:
        return {"name": self.name, "raw": list(self.raw)}


@dataclasses.dataclass(frozen=True)
class Enrichment:
    """Joins a table on a raw field (`key`) and adds its `fields` ({name: type}) to every event.

    The table is given to the runtimes by `source` name (`--items PATH` is the source 'items',
    `--table NAME=PATH` any other). An event whose key is not in the table gets `defaults` (per field;
    -1 / 0.0 / "" by type).
    """

    name: str
    fields: Mapping[str, str]
    key: str = "item_id"
    source: str = ""
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _check_name("enrichment", self.name)
        owner = f"enrichment {self.name!r}"
        object.__setattr__(self, "source", self.source or self.name)
        _check_name(owner, self.source, "source")
        if self.key not in RAW_FIELDS or self.key == "ts":
            keys = [k for k in RAW_FIELDS if k != "ts"]
            raise DefinitionError(owner, "key", f"must be a raw event field {keys}, got {self.key!r}")
        if not isinstance(self.fields, Mapping) or not self.fields:
            raise DefinitionError(owner, "fields", f"must be a non-empty mapping name -> type, got {self.fields!r}")
        fields = {}
        for name, typ in self.fields.items():
            _check_name(owner, name, "fields")
            if typ not in FIELD_TYPES:
                raise DefinitionError(owner, "fields", f"{name!r} has type {typ!r}; types are {list(FIELD_TYPES)}")
            fields[name] = typ
        if not isinstance(self.defaults, Mapping):
            raise DefinitionError(owner, "defaults", f"must be a mapping field -> value, got {self.defaults!r}")
        defaults = {}
        for name in fields:
            value = self.defaults.get(name, TYPE_DEFAULTS[fields[name]])
            if not _fits(value, fields[name]):
                raise DefinitionError(owner, "defaults", f"{name!r} default {value!r} is not a {fields[name]}")
            defaults[name] = float(value) if fields[name] == "float64" else value
        unknown = sorted(set(self.defaults) - set(fields))
        if unknown:
            raise DefinitionError(owner, "defaults", f"names {unknown}, which are not among its fields {list(fields)}")
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "defaults", defaults)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            "key": self.key,
            "fields": dict(self.fields),
            "defaults": dict(self.defaults),
        }


def _fits(value, typ: str) -> bool:
    if typ == "int64":
        return _is_int(value) and -(2**63) <= value < 2**63
    if typ == "float64":
        return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    return isinstance(value, str)


@dataclasses.dataclass(frozen=True)
class Sequence:
    """A per-user event sequence: which (normalized) event types, which fields, ordering, max length.

    Fields are raw event fields (item_id, ts, event_type, surface) or enrichment fields. `ordering` 'ts'
    orders events by time, ties by arrival. `max_length` caps what one query returns (the store keeps
    every event, so any point in time can be served). `engaged` lists the event types the training
    reader labels engaged=1. `vocabularies` lists int64 id fields (`item_id` or an int64 enrichment field)
    that get a dense id vocabulary in the store (`jaxscale.sequences.vocabulary`): index 0 padding, 1
    out-of-vocabulary, real ids from 2, built at backfill and extended append-only by the stream.
    """

    name: str
    event_types: tuple[str, ...]
    fields: tuple[str, ...]
    max_length: int
    ordering: str = "ts"
    engaged: tuple[str, ...] = ()
    vocabularies: tuple[str, ...] = ()

    def __post_init__(self):
        _check_name("sequence", self.name)
        owner = f"sequence {self.name!r}"
        object.__setattr__(self, "event_types", _str_tuple(owner, "event_types", self.event_types))
        object.__setattr__(self, "fields", _str_tuple(owner, "fields", self.fields))
        object.__setattr__(self, "engaged", _str_tuple(owner, "engaged", self.engaged, allow_empty=True))
        vocabs = _str_tuple(owner, "vocabularies", self.vocabularies, allow_empty=True)
        object.__setattr__(self, "vocabularies", vocabs)
        if not _is_int(self.max_length) or not 1 <= self.max_length <= 1_000_000:
            raise DefinitionError(owner, "max_length", f"must be an integer in [1, 1000000], got {self.max_length!r}")
        if self.ordering not in ORDERINGS:
            raise DefinitionError(owner, "ordering", f"must be one of {list(ORDERINGS)}, got {self.ordering!r}")
        if "user_id" in self.fields:
            raise DefinitionError(owner, "fields", "'user_id' is the sequence's key, not a field")
        extra = [e for e in self.engaged if e not in self.event_types]
        if extra:
            raise DefinitionError(owner, "engaged", f"{extra} are not among its event_types {list(self.event_types)}")
        for f in self.vocabularies:
            if f not in self.fields:
                raise DefinitionError(owner, "vocabularies", f"{f!r} is not among its fields {list(self.fields)}")
            if f in RAW_FIELDS and f != "item_id":
                raise DefinitionError(
                    owner,
                    "vocabularies",
                    f"{f!r} is not an id field: a vocabulary maps int64 ids ('item_id' or an int64 enrichment field)",
                )

    def to_json(self) -> dict:
        out = {
            "name": self.name,
            "event_types": list(self.event_types),
            "fields": list(self.fields),
            "max_length": self.max_length,
            "ordering": self.ordering,
            "engaged": list(self.engaged),
        }
        if self.vocabularies:  # absent when empty: stores and JSON written before the key stay identical
            out["vocabularies"] = list(self.vocabularies)
        return out


@dataclasses.dataclass(frozen=True)
class Definitions:
    """A validated set of definitions: the unit that compiles to JSON.

    `surfaces` optionally fixes the surface vocabulary for the training reader (code = 1 + position,
    0 = any other surface); without it codes are a stable hash of the surface string.
    """

    event_types: tuple[EventType, ...]
    sequences: tuple[Sequence, ...]
    enrichments: tuple[Enrichment, ...] = ()
    surfaces: tuple[str, ...] = ()

    def __post_init__(self):
        for field, cls in (("event_types", EventType), ("sequences", Sequence), ("enrichments", Enrichment)):
            value = getattr(self, field)
            if isinstance(value, (str, Mapping)) or not isinstance(value, (tuple, list)):
                raise DefinitionError("definitions", field, f"must be a tuple of {cls.__name__}, got {value!r}")
            for v in value:
                if not isinstance(v, cls):
                    raise DefinitionError("definitions", field, f"must hold {cls.__name__} objects, got {v!r}")
            object.__setattr__(self, field, tuple(value))
        object.__setattr__(self, "surfaces", _str_tuple("definitions", "surfaces", self.surfaces, allow_empty=True))
        if not self.sequences:
            raise DefinitionError("definitions", "sequences", "defines no sequence")
        self._check_names()
        self._check_sequences()

    def _check_names(self) -> None:
        for kind, items in (
            ("event type", self.event_types),
            ("sequence", self.sequences),
            ("enrichment", self.enrichments),
        ):
            seen = set()
            for d in items:
                if d.name in seen:
                    raise DefinitionError(f"{kind} {d.name!r}", "name", f"conflicts: two {kind}s are named {d.name!r}")
                seen.add(d.name)
        owner_of_raw: dict[str, str] = {}
        for et in self.event_types:
            for r in et.raw:
                if r in owner_of_raw:
                    raise DefinitionError(
                        f"event type {et.name!r}", "raw", f"raw value {r!r} is already mapped to {owner_of_raw[r]!r}"
                    )
                owner_of_raw[r] = et.name
        provider: dict[str, str] = {}
        for en in self.enrichments:
            for f in en.fields:
                if f in RAW_FIELDS:
                    raise DefinitionError(
                        f"enrichment {en.name!r}", "fields", f"{f!r} conflicts with the raw event field"
                    )
                if f in provider:
                    raise DefinitionError(
                        f"enrichment {en.name!r}", "fields", f"{f!r} conflicts with enrichment {provider[f]!r}"
                    )
                provider[f] = en.name

    def _check_sequences(self) -> None:
        known_types = [e.name for e in self.event_types]
        enriched = self.enriched_fields()
        for s in self.sequences:
            owner = f"sequence {s.name!r}"
            for t in s.event_types:
                if t not in known_types:
                    raise DefinitionError(owner, "event_types", f"{t!r} is not a defined event type {known_types}")
            for f in s.fields:
                if f not in EVENT_FIELDS and f not in enriched:
                    raise DefinitionError(
                        owner,
                        "fields",
                        f"{f!r} is neither a raw event field {list(EVENT_FIELDS)} nor provided by an enrichment "
                        f"{sorted(enriched) or '(none defined)'}: missing enrichment source",
                    )
            for f in s.vocabularies:
                if f in enriched and enriched[f].fields[f] != "int64":
                    raise DefinitionError(
                        owner,
                        "vocabularies",
                        f"{f!r} is a {enriched[f].fields[f]} field of enrichment {enriched[f].name!r}; "
                        "a vocabulary maps int64 ids",
                    )

    def enriched_fields(self) -> dict[str, Enrichment]:
        """Enrichment field name -> the enrichment providing it."""
        return {f: en for en in self.enrichments for f in en.fields}

    def sequence(self, name: str) -> Sequence:
        for s in self.sequences:
            if s.name == name:
                return s
        raise KeyError(f"no sequence {name!r}; defined: {[s.name for s in self.sequences]}")

    def to_json(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": KIND,
            "event_types": [e.to_json() for e in self.event_types],
            "enrichments": [e.to_json() for e in self.enrichments],
            "sequences": [s.to_json() for s in self.sequences],
            "surfaces": list(self.surfaces),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n"


# --------------------------------------------------------------------------------------------- JSON in


def _strict(obj, owner: str, keys: dict[str, bool]) -> dict:
    """Checks a JSON object has only `keys` ({key: required})."""
    if not isinstance(obj, dict):
        raise DefinitionError(owner, None, f"must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(keys))
    if unknown:
        raise DefinitionError(owner, unknown[0], f"unknown key (known: {sorted(keys)})")
    missing = [k for k, req in keys.items() if req and k not in obj]
    if missing:
        raise DefinitionError(owner, missing[0], "is missing")
    return obj


def _tuple_or_error(owner: str, field: str, value):
    if not isinstance(value, list):
        raise DefinitionError(owner, field, f"must be a JSON list, got {value!r}")
    return tuple(value)


def definitions_from_json(data: Mapping) -> Definitions:
    """Definitions from their compiled JSON; rejects other schema versions and unknown keys."""
    if not isinstance(data, dict):
        raise DefinitionError("definitions", None, f"must be a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise DefinitionError(
            "definitions",
            "schema_version",
            f"is {version!r}; this jaxscale reads schema_version {SCHEMA_VERSION} (recompile the definitions)",
        )
    keys = {"schema_version": True, "kind": False, "event_types": True, "enrichments": False, "sequences": True}
    _strict(data, "definitions", keys | {"surfaces": False})
    if data.get("kind", KIND) != KIND:
        raise DefinitionError("definitions", "kind", f"must be {KIND!r}, got {data.get('kind')!r}")
    ets = []
    for i, e in enumerate(_tuple_or_error("definitions", "event_types", data["event_types"])):
        e = _strict(e, f"event_types[{i}]", {"name": True, "raw": False})
        ets.append(EventType(e["name"], _tuple_or_error(f"event type {e['name']!r}", "raw", e.get("raw", []))))
    ens = []
    for i, e in enumerate(_tuple_or_error("definitions", "enrichments", data.get("enrichments", []))):
        e = _strict(
            e, f"enrichments[{i}]", {"name": True, "source": False, "key": False, "fields": True, "defaults": False}
        )
        ens.append(
            Enrichment(
                e["name"],
                e["fields"],
                key=e.get("key", "item_id"),
                source=e.get("source", ""),
                defaults=e.get("defaults", {}),
            )
        )
    seqs = []
    seq_keys = {
        "name": True,
        "event_types": True,
        "fields": True,
        "max_length": True,
        "ordering": False,
        "engaged": False,
        "vocabularies": False,
    }
    for i, s in enumerate(_tuple_or_error("definitions", "sequences", data["sequences"])):
        s = _strict(s, f"sequences[{i}]", seq_keys)
        owner = f"sequence {s['name']!r}"
        seqs.append(
            Sequence(
                s["name"],
                _tuple_or_error(owner, "event_types", s["event_types"]),
                _tuple_or_error(owner, "fields", s["fields"]),
                s["max_length"],
                ordering=s.get("ordering", "ts"),
                engaged=_tuple_or_error(owner, "engaged", s.get("engaged", [])),
                vocabularies=_tuple_or_error(owner, "vocabularies", s.get("vocabularies", [])),
            )
        )
    surfaces = _tuple_or_error("definitions", "surfaces", data.get("surfaces", []))
    return Definitions(tuple(ets), tuple(seqs), tuple(ens), surfaces)


def load_definitions(path) -> Definitions:
    """Reads compiled definitions JSON (what every runtime uses)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"definitions file {path} does not exist (compile it first)") from None
    except json.JSONDecodeError as e:
        raise DefinitionError(f"definitions file {path}", None, f"is not valid JSON: {e}") from None
    return definitions_from_json(data)


# ------------------------------------------------------------------------------------------- Python in


def definitions_from_module(path) -> Definitions:
    """Runs a definitions .py file and collects its definitions.

    A module-level `DEFINITIONS` (a `Definitions`) is used as is; otherwise every module-level
    EventType, Enrichment and Sequence is collected in definition order (and `SURFACES`, if any).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"definitions file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_jaxscale_sequence_defs_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    found = getattr(module, "DEFINITIONS", None)
    if found is not None:
        if not isinstance(found, Definitions):
            raise DefinitionError(f"{path}", "DEFINITIONS", f"must be a Definitions, got {type(found).__name__}")
        return found
    groups: dict[type, list] = {EventType: [], Enrichment: [], Sequence: []}
    for value in vars(module).values():
        for cls, items in groups.items():
            if isinstance(value, cls) and not any(v is value for v in items):
                items.append(value)
    if not groups[Sequence]:
        raise DefinitionError(f"{path}", None, "defines no Sequence (and no DEFINITIONS)")
    surfaces = getattr(module, "SURFACES", ())
    return Definitions(tuple(groups[EventType]), tuple(groups[Sequence]), tuple(groups[Enrichment]), surfaces)


def compile_definitions(src, out) -> Definitions:
    """Validates the definitions in `src` (.py) and writes their JSON to `out` atomically."""
    from jaxscale.infra import atomic

    defs = definitions_from_module(src)
    atomic.write_text(out, defs.dumps())
    return defs
