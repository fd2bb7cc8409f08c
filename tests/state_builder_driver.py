"""The tiny contextual two-tower, sequence definitions and brute-force histories shared by
tests/test_state_builder.py and the subprocess it SIGKILLs (`python tests/state_builder_driver.py STORE DEFS
OUT`: one builder update, then a second one that stops for good inside its publication: the version file is
written but not yet renamed into place, and the driver prints PUBLISHING and sleeps until killed)."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before JAX is imported: the 8 simulated devices of the tests
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

MODEL_VERSION = "tiny-v1"
C, L, ITEM_ROWS = 8, 6, 64
SURFACES = ("home", "search")
TINY = dict(
    item_rows=ITEM_ROWS,
    num_categories=C,
    item_dim=8,
    d_model=16,
    num_layers=1,
    num_heads=2,
    mlp_ratio=2,
    max_seq_len=L,
    context_dim=8,
    head_hidden=(16,),
    item_hidden=(16,),
    embed_dim=8,
    num_actions=4,
    num_surfaces=4,
)


def definitions():
    from jaxscale.sequences import Definitions, Enrichment, EventType, Sequence

    return Definitions(
        event_types=(EventType("click", raw=("click", "tap")), EventType("save")),
        enrichments=(Enrichment("items", fields={"category": "int64"}, defaults={"category": -1}),),
        sequences=(Sequence("s1", ("click", "save"), ("item_id", "ts", "event_type", "surface", "category"), 50),),
        surfaces=SURFACES,
    )


def tiny_model():
    """(model, ec, emb_state): the same weights in every process (seeded)."""
    from flax import nnx

    import jaxscale
    from jaxscale_models.contextual_two_tower import ContextualTwoTower, ContextualTwoTowerConfig, two_tower_tables

    cfg = ContextualTwoTowerConfig(**TINY)
    ec = jaxscale.EmbeddingCollection(
        two_tower_tables(cfg), jaxscale.make_mesh(2, 4), jaxscale.EmbeddingSettings(sharding="row_wise")
    )
    rng = np.random.default_rng(0)
    emb_state = ec.from_dense({t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in ec.tables})
    return ContextualTwoTower(cfg, rngs=nnx.Rngs(0)), ec, emb_state


def events(users, per_user, t0_ms, span_ms, seed) -> list[dict]:
    """Raw events (arrival order shuffled), distinct event times per user."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in users:
        ts = t0_ms + np.sort(rng.choice(span_ms, size=per_user, replace=False))
        for t in ts:
            rows.append(
                {
                    "user_id": int(u),
                    "ts": int(t),
                    "event_type": str(rng.choice(["click", "tap", "save"])),
                    "item_id": int(rng.integers(0, ITEM_ROWS)),
                    "surface": str(rng.choice(["home", "search", "elsewhere"])),
                }
            )
    return [rows[i] for i in rng.permutation(len(rows))]


def brute_force_histories(log, users) -> tuple[dict, np.ndarray]:
    """(HISTORY_KEYS batch of each user's last L events by event time, newest event time ms), row by row."""
    out = {
        "item_ids": np.full((len(users), L), -1, np.int32),
        "item_categories": np.full((len(users), L), -1, np.int32),
        "timestamps": np.full((len(users), L), -1, np.int32),
        "actions": np.full((len(users), L), -1, np.int32),
        "surfaces": np.full((len(users), L), -1, np.int32),
        "mask": np.zeros((len(users), L), bool),
    }
    newest = np.full(len(users), -1, np.int64)
    for i, u in enumerate(users):
        evs = sorted((e for e in log if e["user_id"] == u), key=lambda e: e["ts"])[-L:]
        for j, e in enumerate(evs):
            out["item_ids"][i, j] = e["item_id"]
            out["item_categories"][i, j] = e["item_id"] % C
            out["timestamps"][i, j] = e["ts"] // 1000
            out["actions"][i, j] = 1 if e["event_type"] == "save" else 0
            out["surfaces"][i, j] = SURFACES.index(e["surface"]) + 1 if e["surface"] in SURFACES else 0
            out["mask"][i, j] = True
        if evs:
            newest[i] = evs[-1]["ts"]
    return out, newest


def items_table(path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    items = np.arange(ITEM_ROWS, dtype=np.int64)
    pq.write_table(pa.table({"item_id": items, "category": items % C}), path)


def builder(store, defs_path, out, encoder=None, **kw):
    """A state builder with the tiny model (`encoder`: an `OfflineEncoder` to share its compilation)."""
    from jaxscale.serving.states import StateBuilder
    from jaxscale_models.contextual_two_tower import ContextualTwoTowerConfig
    from jaxscale_models.contextual_two_tower_sequences import history_source
    from jaxscale_models.two_tower_inference import OfflineEncoder

    histories = history_source(store, "s1", defs_path, ContextualTwoTowerConfig(**TINY))
    encoder = encoder or OfflineEncoder(*tiny_model())
    return StateBuilder(out, histories, encoder, model_version=MODEL_VERSION, **{"batch_size": 16, **kw})


def main(store, defs_path, out) -> None:
    import time

    from jaxscale.serving import states

    b = builder(store, defs_path, out)
    print(f"UPDATED {b.update().version}", flush=True)
    real = states.atomic.replacing

    import contextlib

    @contextlib.contextmanager
    def stalled(path):
        with real(path) as tmp:
            yield tmp
            if str(path).endswith(".arrow"):  # the version file is written, not yet renamed into place
                print(f"PUBLISHING {tmp}", flush=True)
                time.sleep(600)

    states.atomic.replacing = stalled
    while True:  # the test adds events, then this update stalls inside its publication
        b.update()
        time.sleep(0.05)


if __name__ == "__main__":
    main(*sys.argv[1:4])
