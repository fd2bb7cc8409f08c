"""User-sequence data: definitions as code, one engine for batch and streaming, a day-partitioned
Parquet store, an HTTP serving API, and a Grain reader for the trainer. See docs/sequences.md."""

from jaxscale.sequences.definitions import (
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
from jaxscale.sequences.query import SequenceReader

__all__ = [
    "SCHEMA_VERSION",
    "DefinitionError",
    "Definitions",
    "Enrichment",
    "EventType",
    "Sequence",
    "SequenceReader",
    "compile_definitions",
    "definitions_from_json",
    "load_definitions",
]
