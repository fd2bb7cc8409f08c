"""The contextual two-tower model's examples from a `jaxscale.sequences` store (`data.source: sequences`).

An example is an anchor (user, ts) of the store, exactly as in `jaxscale.sequences.examples`: every distinct
(user, event time) with at least `min_history` earlier events; the store's last `eval_days` days are the
eval split, the days before them the train split. For anchor (user, ts):

  history   the user's last max_seq_len events with event time strictly before ts (point in time: nothing at
            or after ts, so neither the label nor any later event leaks in), in the foundation model's
            encoding (`item_ids`, `timestamps`, `actions`, `surfaces`, `mask`; see
            `jaxscale.sequences.examples`)
            plus `item_categories`: each event's value of the category field.
  label     the anchor event itself: `label_item` = its item id (`item_ids_to_int32`, the history's
            mapping), `label_category` = its category. Several events of the user at the same ts: the anchor
            event is the first stored one (earliest arrival); the others are in neither history nor label.
  context   `context_surface` = the anchor event's surface (`surface_code`, the history's mapping),
            `context_hour` = the hour of day (UTC) of ts. The subject category: the store has no subject item
            of a request, so
              * train split: pseudo-context derived from the label (`derive_pseudo_context`, the same
                semantics as the synthetic train split): the label's category with probability = a drawn
                confidence (uniform in `confidence_range`), else a random category. The draws hash (seed,
                user, ts), so an example gets the same pseudo-context in every epoch and in every process.
              * eval split: missing (`context_category` -1, `context_confidence` 0). Evaluation measures the
                context-missing mode of the query tower with the real surface and hour.

Categories come from one int64 field of the sequence (`ContextualTwoTowerConfig.category_field`, default
'category'; typically an enrichment's field, e.g. `Enrichment("items", fields={"category": "int64"})`).
A stored -1 (an enrichment's default for an item missing from its table) is the 'missing' category: with
`ContextualTwoTowerConfig.missing_category` (source option `missing_category=True`) it is read as the
reserved index num_categories, a learned row of the category table, wherever the model reads a category
(history, label, corpus); a label in that bucket gives a missing pseudo-context (-1, confidence 0). Without
it a -1 is refused. A sequence without that field, a field that is not int64, or any other stored value
outside [0, num_categories) is a ValueError naming the field and the value, raised when the source is built.

Item ids are not hashed by this model: they must be in [0, item_rows). When the store has an `item_id`
vocabulary (`Sequence(..., vocabularies=("item_id",))`) the ids are its dense indices (see
`jaxscale.sequences.examples.model_item_ids`) and item_rows must be >= the vocabulary's num_indices (checked
when the source is built, naming both). An id outside (in a history, a label) is left in the batch, and the
Trainer's host check applies `data.invalid_ids` to it: 'error' raises naming the feature, the id and this
source's `provenance` (store, split, step, rows); 'count' counts and pads it.

The corpus (eval split by default): the Trainer's full-corpus recall needs every item id in [0, item_rows)
once per eval batch with its category (`corpus_items` / `corpus_categories`, laid out over the global batch
as `corpus_layout`). The categories are the store's catalogue: an item's category is the one of its latest
event in the whole store (both splits: it is item metadata, not a label; ties: the last in store order).
Items never seen in the store are still in the corpus (they are candidates the model must rank) with
category -1: the padding id, so their item vector reads a zero category embedding. Store ids >= item_rows
are not in the corpus (a warning counts them; the batches that carry them meet `data.invalid_ids`).

`ContextualSequenceBatches` is `SequenceBatches` with this source: the same Grain pipeline (shuffle with
`seed`, reshuffled every epoch, repeated, batched, sliced per process: the slices of all processes
concatenate to the one-process batch), the same `get_state` / `set_state` for checkpoints.
"""

from __future__ import annotations

import warnings

import numpy as np

from jaxscale.sequences.examples import PointInTimeExamples, SequenceBatches, check_item_rows
from jaxscale.training.data import hash64, uniform
from jaxscale_models.contextual_two_tower_data import (
    CONTEXT_KEYS,
    HISTORY_KEYS,
    HOURS,
    LABEL_KEYS,
    corpus_layout,
    derive_pseudo_context,
)

MS_PER_HOUR = 3_600_000
EVAL_CONTEXTS = ("missing", "label")
"""The subject category of held-out examples: missing, or the label's own (the item being viewed)."""
BATCH_KEYS = HISTORY_KEYS + CONTEXT_KEYS + LABEL_KEYS
"""Keys of every batch (the eval split's batches add `corpus_items` and `corpus_categories`)."""

# Purpose tags of the pseudo-context draws (hash64(seed, user, ts, tag)).
_T_CONF, _T_RIGHT, _T_WRONG = 1, 2, 3


def pseudo_context_draws(seed: int, users, ts, num_categories: int, confidence_range=(0.5, 1.0)):
    """(confidence f32, right bool, wrong category int64) of anchors (users, ts): the random inputs of
    `derive_pseudo_context`, a hash of (seed, user, ts) each."""
    lo, hi = confidence_range
    users, ts = np.asarray(users, np.int64), np.asarray(ts, np.int64)
    confidence = (lo + (hi - lo) * uniform(seed, users, ts, _T_CONF)).astype(np.float32)
    right = uniform(seed, users, ts, _T_RIGHT) < confidence
    wrong = (hash64(seed, users, ts, _T_WRONG) % np.uint64(num_categories)).astype(np.int64)
    return confidence, right, wrong


class ContextualExamples(PointInTimeExamples):
    """Random-access source of the contextual two-tower's examples (a Grain `RandomAccessDataSource`): one
    per anchor, see the module docstring. `self[i]` is a dict of [max_seq_len] history arrays and 0-d
    context/label values."""

    def __init__(
        self,
        store,
        sequence: str,
        defs,
        *,
        max_seq_len: int,
        num_actions: int,
        num_surfaces: int,
        num_categories: int,
        category_field: str = "category",
        split: str = "train",
        eval_days: int = 1,
        min_history: int = 1,
        seed: int = 0,
        pseudo_context: bool | None = None,
        confidence_range: tuple[float, float] = (0.5, 1.0),
        missing_category: bool = False,
        eval_context: str = "missing",
        split_mode: str = "day",
    ):
        if eval_context not in EVAL_CONTEXTS:
            raise ValueError(f"eval_context must be one of {EVAL_CONTEXTS}, got {eval_context!r}")
        self.eval_context = eval_context
        if not isinstance(num_categories, (int, np.integer)) or isinstance(num_categories, bool) or num_categories < 1:
            raise ValueError(f"num_categories must be a positive integer, got {num_categories!r}")
        if not isinstance(category_field, str) or not category_field:
            raise ValueError(f"category_field must be a field name, got {category_field!r}")
        lo, hi = confidence_range
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"confidence_range must satisfy 0 <= low <= high <= 1, got {confidence_range}")
        self.num_categories, self.category_field = int(num_categories), category_field
        self.missing_category = bool(missing_category)
        self.missing_index = self.num_categories if self.missing_category else None
        self.seed, self.confidence_range = int(seed), (float(lo), float(hi))
        self.pseudo_context = (split == "train") if pseudo_context is None else bool(pseudo_context)
        super().__init__(
            store,
            sequence,
            defs,
            max_seq_len=max_seq_len,
            num_actions=num_actions,
            num_surfaces=num_surfaces,
            split=split,
            eval_days=eval_days,
            min_history=min_history,
            split_mode=split_mode,
        )
        self._check_categories()

    # ---------------------------------------------------------------- categories

    def _check_categories(self) -> None:
        f, name = self.category_field, self.sequence_name
        if f not in self.seq.fields:
            raise ValueError(
                f"sequence {name!r} has no field {f!r} (the model's category_field); its fields are "
                f"{list(self.seq.fields)}. Add the category to the sequence (e.g. an enrichment field "
                f"{{{f!r}: 'int64'}}) or set model.contextual_two_tower.category_field"
            )
        typ = self.reader.columns.get(f)
        if typ != "int64":
            raise ValueError(
                f"field {f!r} of sequence {name!r} (the model's category_field) is {typ}; categories must be int64"
            )
        C = self.num_categories
        for part in self.reader.partitions:
            values = part.values[f]
            bad = np.flatnonzero(((values < 0) & ~((values == -1) & self.missing_category)) | (values >= C))
            if len(bad):
                i = int(bad[0])
                user = int(part.users[np.searchsorted(part.starts, i, side="right") - 1])
                raise ValueError(
                    f"field {f!r} of sequence {name!r} has value {int(values[i])} (day {part.day}, user {user}, "
                    f"item_id {int(part.values['item_id'][i])}; {len(bad)} such events that day); categories "
                    f"must be in [0, num_categories={C}) (-1 is an enrichment's default for an item missing "
                    f"from its table: set model.contextual_two_tower.missing_category=true to read it as the "
                    f"'missing' bucket)"
                )

    def _padding(self) -> dict[str, np.ndarray]:
        out = super()._padding()
        out["item_categories"] = np.full(self.max_seq_len, -1, np.int32)
        return out

    def _model_columns(self, part) -> dict[str, np.ndarray]:
        cols = super()._model_columns(part)
        if "item_categories" not in cols:  # added once to the partition's cached columns
            cats = part.values[self.category_field]
            if self.missing_category:
                cats = np.where(cats == -1, self.missing_index, cats)
            cols["item_categories"] = cats.astype(np.int32)
        return cols

    def catalogue(self, item_rows: int) -> tuple[np.ndarray, int]:
        """(int32 [item_rows] category of every item id, -1 for ids never seen in the store; the number of
        distinct store ids >= item_rows, which the catalogue leaves out). An item's category is its latest
        event's in the whole store (ties in ts: the last in store order)."""
        ids, cats, ts = [], [], []
        for part in self.reader.partitions:
            cols = self._model_columns(part)
            ids.append(cols["item_ids"])
            cats.append(cols["item_categories"])
            ts.append(part.ts)
        ids, cats, ts = np.concatenate(ids), np.concatenate(cats), np.concatenate(ts)
        order = np.lexsort((np.arange(len(ts)), ts))[::-1]  # latest first
        ids, cats = ids[order], cats[order]
        out_of_range = int(len(np.unique(ids[ids >= item_rows])))
        keep = ids < item_rows
        uniq, first = np.unique(ids[keep], return_index=True)  # first = latest event of each id
        out = np.full(item_rows, -1, np.int32)
        out[uniq] = cats[keep][first]
        return out, out_of_range

    # ---------------------------------------------------------------- examples

    def __getitem__(self, index) -> dict[str, np.ndarray]:
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"example {index} out of range [0, {len(self)})")
        index %= len(self)
        user, ts = self.anchor(index)
        out = self.history(index)
        del out["engaged"]
        part, row = self.anchor_event(index)
        cols = self._model_columns(part)
        label_category = np.int32(cols["item_categories"][row])
        if self.pseudo_context and label_category != self.missing_index:
            confidence, right, wrong = pseudo_context_draws(
                self.seed, user, ts, self.num_categories, self.confidence_range
            )
            category, conf = derive_pseudo_context(label_category, confidence, right, wrong)
        elif not self.pseudo_context and self.eval_context == "label" and label_category != self.missing_index:
            category, conf = label_category, np.float32(1.0)  # the subject item's category, known for sure
        else:
            category, conf = np.int32(-1), np.float32(0.0)
        out.update(
            context_category=np.asarray(category, np.int32),
            context_confidence=np.asarray(conf, np.float32),
            context_surface=np.asarray(cols["surfaces"][row], np.int32),
            context_hour=np.asarray((ts // MS_PER_HOUR) % HOURS, np.int32),
            label_item=np.asarray(cols["item_ids"][row], np.int32),
            label_category=np.asarray(label_category, np.int32),
        )
        return out


class ContextualSequenceBatches(SequenceBatches):
    """The contextual two-tower's trainer data source over a sequence store (see the module docstring):
    `SequenceBatches` (Grain, per-process slices, `get_state` / `set_state`) over `ContextualExamples`,
    plus the corpus on the eval split (`corpus`, default: split == 'eval')."""

    keys = BATCH_KEYS

    def __init__(
        self,
        store,
        sequence: str,
        defs,
        *,
        global_batch_size: int,
        max_seq_len: int,
        num_actions: int,
        num_surfaces: int,
        num_categories: int,
        item_rows: int,
        category_field: str = "category",
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        split: str = "train",
        eval_days: int = 1,
        min_history: int = 1,
        pseudo_context: bool | None = None,
        corpus: bool | None = None,
        confidence_range: tuple[float, float] = (0.5, 1.0),
        missing_category: bool = False,
        eval_context: str = "missing",
        split_mode: str = "day",
        num_threads: int = 2,
        prefetch: int = 4,
        worker_count: int = 0,
    ):
        if not isinstance(item_rows, (int, np.integer)) or isinstance(item_rows, bool) or item_rows < 1:
            raise ValueError(f"item_rows must be a positive integer, got {item_rows!r}")
        self.item_rows, self.split = int(item_rows), split
        self._source_args = dict(
            num_categories=num_categories,
            category_field=category_field,
            seed=seed,
            pseudo_context=pseudo_context,
            confidence_range=confidence_range,
            missing_category=missing_category,
            eval_context=eval_context,
        )
        super().__init__(
            store,
            sequence,
            defs,
            global_batch_size=global_batch_size,
            max_seq_len=max_seq_len,
            num_actions=num_actions,
            num_surfaces=num_surfaces,
            seed=seed,
            process_index=process_index,
            process_count=process_count,
            split=split,
            eval_days=eval_days,
            min_history=min_history,
            num_threads=num_threads,
            prefetch=prefetch,
            worker_count=worker_count,
            split_mode=split_mode,
        )
        check_item_rows(self.source.reader.vocabulary("item_id"), self.item_rows, "model.contextual_two_tower")
        self.corpus = (split in ("eval", "valid", "test")) if corpus is None else bool(corpus)
        self.item_category = None
        if self.corpus:
            self.item_category, out_of_range = self.source.catalogue(self.item_rows)
            if out_of_range:
                warnings.warn(
                    f"{out_of_range} distinct item ids of sequence {sequence!r} in {store} are >= item_rows="
                    f"{self.item_rows}: they are not in the corpus, and batches that carry them meet "
                    f"data.invalid_ids",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def _make_source(self, store, sequence, defs, **kwargs) -> ContextualExamples:
        return ContextualExamples(store, sequence, defs, **kwargs, **self._source_args)

    def _rows(self) -> np.ndarray:
        """This process's rows of the global batch."""
        return self.process_index * self.local_batch_size + np.arange(self.local_batch_size)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        out = super().batch(step)
        if self.corpus:
            out.update(self.corpus_keys(self._rows()))
        return out

    def corpus_keys(self, rows) -> dict[str, np.ndarray]:
        """`corpus_items` / `corpus_categories` of global batch rows `rows`: the whole corpus laid over the
        global batch (an evaluator that builds its own batches adds them with this)."""
        if self.item_category is None:
            self.item_category, _ = self.source.catalogue(self.item_rows)
        items = corpus_layout(self.item_rows, self.global_batch_size, np.asarray(rows))
        cats = np.where(items >= 0, self.item_category[np.maximum(items, 0)], -1).astype(np.int32)
        return {"corpus_items": items, "corpus_categories": cats}

    def provenance(self, step: int) -> dict:
        """Where the batch of `step` comes from (named in the Trainer's invalid-id errors)."""
        rows = self._rows()
        return {
            "where": f"sequence {self.source.sequence_name!r} of store {self.source.store} ({self.split} split, "
            f"step {step}, rows {int(rows[0])}..{int(rows[-1])} of the global batch)"
        }


def sequence_source(cfg, config, split: str, process_index: int, process_count: int) -> ContextualSequenceBatches:
    """`data.source: sequences` for `model.kind: contextual_two_tower` (`ModelSpec.data_sources`): the store of
    `data.sequences`, the category field `cfg.category_field`, Grain's shuffle and the pseudo-context draws
    seeded by `data.seed`."""
    return ContextualSequenceBatches.from_config(
        cfg,
        config,
        split,
        process_index,
        process_count,
        num_categories=cfg.num_categories,
        item_rows=cfg.item_rows,
        category_field=cfg.category_field,
        missing_category=cfg.missing_category,
        eval_context=cfg.eval_context,
    )


def history_source(store, sequence: str, defs, model_cfg, *, vocabulary=None):
    """The state builder's histories (`jaxscale.serving.states.EncoderStateParts`): the users' current histories
    in this encoding (`HISTORY_KEYS`), read through one `SequenceReader` of their own (the builder refreshes it).
    `vocabulary`: the `item_id` vocabulary the model was trained with (`states.training_vocabulary`), when the
    followed store is another one: a store fed by a stream numbers items in its own arrival order."""
    from jaxscale.sequences.query import open_reader

    class CurrentHistories(ContextualExamples):
        """`ContextualExamples` without anchors: only `current(users)` is used (the builder needs no
        examples, and a store being filled may hold none yet)."""

        @property
        def reader(self):
            if self._reader is None:
                self._reader = open_reader(self.store, self.sequence_name)
            return self._reader

        def item_vocabulary(self):
            return super().item_vocabulary() if vocabulary is None else vocabulary

        def _anchors(self, reader):
            empty = np.zeros(0, np.int64)
            return empty, empty, [], np.zeros(0, np.int32), empty

        def prune(self) -> None:
            """Forgets the encoded columns of files the reader dropped (a long-running builder)."""
            live = {(s.day, s.signature) for p in self.reader.partitions for s in (*p.segments, p)}
            self._maps = {k: v for k, v in self._maps.items() if (k[0], k[1]) in live}

        def current(self, users) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
            """(history batch [n, max_seq_len] per key, newest event time ms [n], newest ingest time ms [n])
            of each user's last max_seq_len stored events."""
            rows, newest, ingest = [], np.full(len(users), -1, np.int64), np.full(len(users), -1, np.int64)
            for i, u in enumerate(np.asarray(users, np.int64).tolist()):
                pieces = self.reader.slices(u, None, self.max_seq_len)
                rows.append(self._fill(pieces))
                if pieces:
                    seg, r = pieces[-1]
                    newest[i] = int(seg.ts[r][-1])
                    ingest[i] = max(int(s.ingest[rr].max()) for s, rr in pieces if len(s.ingest[rr]))
            if not rows:
                return {k: np.zeros((0, self.max_seq_len), v.dtype) for k, v in self._padding().items()}, newest, ingest
            batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
            cats, rows_in = batch["item_categories"], self.num_categories + int(self.missing_category)
            bad = np.argwhere(batch["mask"] & ((cats < 0) | (cats >= rows_in)))
            if len(bad):  # what the training source refuses when it is built (a stream may add it later)
                i, j = bad[0]
                raise ValueError(
                    f"field {self.category_field!r} of sequence {self.sequence_name!r}: user {int(users[i])} has an "
                    f"event of category {int(cats[i, j])}, outside [0, num_categories={self.num_categories}) "
                    f"(missing_category={self.missing_category})"
                )
            return batch, newest, ingest

    return CurrentHistories(
        store,
        sequence,
        defs,
        max_seq_len=model_cfg.max_seq_len,
        num_actions=model_cfg.num_actions,
        num_surfaces=model_cfg.num_surfaces,
        num_categories=model_cfg.num_categories,
        category_field=model_cfg.category_field,
        missing_category=model_cfg.missing_category,
        split="eval",
    )


__all__ = [
    "BATCH_KEYS",
    "ContextualExamples",
    "ContextualSequenceBatches",
    "history_source",
    "pseudo_context_draws",
    "sequence_source",
]
