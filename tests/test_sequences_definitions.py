"""Definitions as code: validation errors name the definition and field; JSON round trip and versioning."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxscale.sequences import (
    SCHEMA_VERSION,
    DefinitionError,
    Definitions,
    Enrichment,
    EventType,
    Sequence,
    compile_definitions,
    definitions_from_json,
    load_definitions,
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "experiments" / "sequences" / "engagement.py"


def test_example_compiles_and_round_trips(tmp_path):
    defs = compile_definitions(EXAMPLE, tmp_path / "defs.json")
    data = json.loads((tmp_path / "defs.json").read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    seq = data["sequences"][0]
    assert seq == {
        "name": "engagement",
        "event_types": ["click", "save", "closeup"],
        "fields": ["item_id", "ts", "event_type", "surface", "category"],
        "max_length": 256,
        "ordering": "ts",
        "engaged": ["save"],
        "vocabularies": ["item_id"],
    }
    assert data["enrichments"][0]["fields"] == {"category": "int64"} and data["enrichments"][0]["defaults"] == {
        "category": -1
    }
    assert load_definitions(tmp_path / "defs.json") == defs


def _seq(**kw):
    args = dict(name="s", event_types=("a",), fields=("item_id", "ts"), max_length=5) | kw
    return Sequence(**args)


@pytest.mark.parametrize(
    "build, match",
    [
        (
            lambda: Definitions((EventType("a"),), (_seq(fields=("item_id", "colour")),)),
            r"sequence 's', field 'fields': 'colour' is neither a raw event",
        ),
        (lambda: _seq(max_length="256"), r"sequence 's', field 'max_length': must be an integer"),
        (lambda: _seq(max_length=0), r"field 'max_length'"),
        (lambda: _seq(event_types="a"), r"sequence 's', field 'event_types': must be a tuple of strings"),
        (lambda: _seq(ordering="random"), r"field 'ordering'"),
        (lambda: _seq(engaged=("b",)), r"field 'engaged'"),
        (lambda: _seq(fields=("user_id",)), r"'user_id' is the sequence's key"),
        (lambda: _seq(name="bad name"), r"sequence, field 'name': must be an identifier"),
        (lambda: EventType("a", raw=("x", "x")), r"event type 'a', field 'raw': lists \['x'\] more than once"),
        (lambda: Enrichment("items", fields={"category": "int32"}), r"enrichment 'items', field 'fields'.*int32"),
        (lambda: Enrichment("items", fields={"c": "int64"}, key="colour"), r"enrichment 'items', field 'key'"),
        (lambda: Enrichment("items", fields={"c": "int64"}, defaults={"c": "x"}), r"field 'defaults'"),
        (lambda: Enrichment("items", fields={"c": "int64"}, defaults={"d": 1}), r"field 'defaults'.*'d'"),
        # conflicting names
        (lambda: Definitions((EventType("a"), EventType("a")), (_seq(),)), r"event type 'a', field 'name': conflicts"),
        (
            lambda: Definitions((EventType("a", raw=("x",)), EventType("b", raw=("x",))), (_seq(),)),
            r"event type 'b', field 'raw': raw value 'x' is already mapped to 'a'",
        ),
        (lambda: Definitions((EventType("a"),), (_seq(), _seq())), r"sequence 's', field 'name': conflicts"),
        (
            lambda: Definitions((EventType("a"),), (_seq(),), (Enrichment("e", fields={"surface": "string"}),)),
            r"enrichment 'e', field 'fields': 'surface' conflicts with the raw event field",
        ),
        (
            lambda: Definitions(
                (EventType("a"),),
                (_seq(),),
                (Enrichment("e", fields={"c": "int64"}), Enrichment("f", fields={"c": "int64"})),
            ),
            r"enrichment 'f', field 'fields': 'c' conflicts with enrichment 'e'",
        ),
        # missing sources
        (
            lambda: Definitions((EventType("a"),), (_seq(fields=("ts", "category")),)),
            r"sequence 's', field 'fields': 'category' .*missing enrichment source",
        ),
        (lambda: Definitions((EventType("a"),), (_seq(event_types=("b",)),)), r"field 'event_types': 'b' is not a def"),
    ],
)
def test_compile_errors_name_definition_and_field(build, match):
    with pytest.raises(DefinitionError, match=match):
        build()


def test_unknown_fields_in_python_are_errors():
    with pytest.raises(TypeError, match="colour"):
        Sequence("s", ("a",), ("ts",), 5, colour=1)


def test_json_is_checked_strictly(tmp_path):
    good = Definitions((EventType("a"),), (_seq(),)).to_json()
    assert definitions_from_json(json.loads(json.dumps(good))).sequences[0].name == "s"
    for version in (0, 2, "1", None):
        bad = dict(good, schema_version=version)
        with pytest.raises(DefinitionError, match=r"schema_version.*reads schema_version 1"):
            definitions_from_json(bad)
    bad = json.loads(json.dumps(good))
    bad["sequences"][0]["colour"] = 1
    with pytest.raises(DefinitionError, match=r"sequences\[0\], field 'colour': unknown key"):
        definitions_from_json(bad)
    bad = json.loads(json.dumps(good))
    bad["sequences"][0]["max_length"] = 2.5
    with pytest.raises(DefinitionError, match="max_length"):
        definitions_from_json(bad)
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(DefinitionError, match="not valid JSON"):
        load_definitions(tmp_path / "x.json")


def test_module_without_definitions_object_collects_module_level_ones(tmp_path):
    src = tmp_path / "d.py"
    src.write_text(
        "from jaxscale.sequences import EventType, Sequence\n"
        "A = EventType('a')\nS = Sequence('s', ('a',), ('ts', 'item_id'), 3)\nSURFACES = ('home',)\n"
    )
    defs = compile_definitions(src, tmp_path / "d.json")
    assert [e.name for e in defs.event_types] == ["a"] and defs.surfaces == ("home",)


def test_cli_compile_error_exits_2_naming_the_field(tmp_path):
    src = tmp_path / "bad.py"
    src.write_text(
        "from jaxscale.sequences import EventType, Sequence\n"
        "A = EventType('a')\nS = Sequence('s', ('a',), ('ts', 'category'), 3)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-m", "jaxscale.sequences", "compile", str(src), "--out", str(tmp_path / "o.json")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "sequence 's', field 'fields': 'category'" in r.stderr
    assert not (tmp_path / "o.json").exists()
