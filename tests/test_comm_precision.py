"""Quantized embedding comms through the engine: error bounds vs fp32, extremes, bytes, half_dim."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale
from jaxscale.engine import comm_inspect

TABLES = [
    jaxscale.TableConfig("seq", rows=400, dim=32, pooling=None),
    jaxscale.TableConfig("bag", rows=300, dim=32, pooling="sum"),
]
B, L = 32, 6
# Stated bounds: forward per-row relative error (L2) of one lookup; AdaGrad tables after 5 steps vs fp32.
FORWARD_BOUND = {"fp32": 0.0, "bf16": 0.01, "fp16": 0.002, "fp8": 0.05}
TRAIN_BOUND = {"fp32": 0.0, "bf16": 0.01, "fp16": 0.002, "fp8": 0.1}


def batch(rng):
    return {
        "seq": rng.integers(-1, 400, (B, L)).astype(np.int32),
        "bag": rng.integers(-1, 300, (B, L)).astype(np.int32),
    }


def make(mesh, precision, **kw):
    return jaxscale.EmbeddingCollection(
        TABLES,
        mesh,
        jaxscale.EmbeddingSettings(
            sharding="row_wise",
            optimizer=jaxscale.RowWiseAdagrad(0.05),
            comm=jaxscale.CommConfig(forward=precision, backward=precision),
            **kw,
        ),
    )


def row_rel_err(a, b):
    a, b = np.asarray(a).reshape(-1, a.shape[-1]), np.asarray(b).reshape(-1, b.shape[-1])
    norm = np.linalg.norm(b, axis=-1)
    keep = norm > 0
    return np.linalg.norm(a - b, axis=-1)[keep] / norm[keep]


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8"])
def test_lookup_and_training_stay_within_bounds_of_fp32(precision):
    mesh = jaxscale.make_mesh(2, 4)
    rng = np.random.default_rng(0)
    # rows with scales spread over 4 orders of magnitude: per-row scales must keep each row accurate
    w0 = {
        t.name: (rng.normal(size=(t.rows, t.dim)) * 10.0 ** rng.uniform(-2, 2, (t.rows, 1))).astype(np.float32)
        for t in TABLES
    }
    ref, q = make(mesh, "fp32"), make(mesh, precision)
    s_ref, s_q = ref.from_dense(w0), q.from_dense(w0)
    for step in range(5):
        ids = batch(rng)
        o_ref, o_q = ref.lookup(s_ref, ids), q.lookup(s_q, ids)
        if step == 0:
            # "seq" is a sequence lookup: each output row is exactly one communicated row
            err = row_rel_err(o_q["seq"], o_ref["seq"])
            assert err.max() < FORWARD_BOUND[precision], err.max()
            assert err.max() > 0  # really quantized
        grads = {f: jnp.asarray(rng.normal(size=o_ref[f].shape).astype(np.float32)) for f in ids}
        s_ref, s_q = ref.update(s_ref, ids, grads), q.update(s_q, ids, grads)
    a, b = q.to_dense(s_q), ref.to_dense(s_ref)
    for name in a:
        delta_ref = b[name] - w0[name]
        touched = np.abs(delta_ref).sum(-1) > 0
        # the update (what the backward precision affects) stays close to the fp32 update
        err = np.linalg.norm((a[name] - w0[name])[touched] - delta_ref[touched]) / np.linalg.norm(delta_ref[touched])
        assert err < TRAIN_BOUND[precision], (name, err)


def test_fp8_extremes_produce_no_inf_or_nan():
    mesh = jaxscale.make_mesh(1, 8)
    w = {"seq": np.zeros((400, 32), np.float32), "bag": np.zeros((300, 32), np.float32)}
    w["seq"][1] = 1e30
    w["seq"][2] = 1e-30
    w["seq"][3, ::2] = -3e38
    ec = make(mesh, "fp8")
    ids = {"seq": np.tile(np.array([0, 1, 2, 3, -1, 0], np.int32), (B, 1)), "bag": np.zeros((B, L), np.int32)}
    out = ec.lookup(ec.from_dense(w), ids)
    seq = np.asarray(out["seq"])
    assert np.all(np.isfinite(seq))
    np.testing.assert_array_equal(seq[:, 0], 0.0)  # all-zero row: exactly zero
    np.testing.assert_allclose(seq[:, 1], 1e30, rtol=0.07)
    np.testing.assert_allclose(seq[:, 3, ::2], -3e38, rtol=0.07)
    assert np.all(np.abs(seq[:, 2]) <= 1e-29)  # tiny rows: finite, possibly flushed to zero
    grads = {"seq": jnp.full((B, L, 32), 1e30, jnp.float32), "bag": jnp.zeros((B, 32), jnp.float32)}
    state = ec.update(ec.from_dense(w), ids, grads)
    assert all(np.all(np.isfinite(v)) for v in ec.to_dense(state).values())


def _a2a_bytes(ec, ids):
    state = ec.init(jax.random.key(0))
    ids = ec.shard_batch(ids)
    fn = jax.jit(lambda s, i: ec.lookup(s, i))
    cs = comm_inspect.list_collectives(fn, state, ids, mesh=ec.mesh)
    return sum(c.bytes_per_device for c in cs if c.kind == "all-to-all" and not any("s32" in d for d in c.dtypes))


def test_fp8_and_half_dim_shrink_the_embedding_all_to_all():
    mesh = jaxscale.make_mesh(2, 4)
    rng = np.random.default_rng(0)
    ids = {"seq": rng.integers(0, 400, (B, L)).astype(np.int32)}
    t = [jaxscale.TableConfig("seq", rows=400, dim=64, pooling=None)]
    half = [jaxscale.TableConfig("seq", rows=400, dim=64, pooling=None, reshape="half_dim")]
    f32 = _a2a_bytes(jaxscale.EmbeddingCollection(t, mesh), ids)
    fp8 = _a2a_bytes(
        jaxscale.EmbeddingCollection(t, mesh, jaxscale.EmbeddingSettings(comm=jaxscale.CommConfig(forward="fp8"))), ids
    )
    hd = _a2a_bytes(jaxscale.EmbeddingCollection(half, mesh), ids)
    assert f32 > 0
    assert fp8 <= 0.3 * f32, (fp8, f32)
    assert hd == pytest.approx(0.5 * f32, rel=0.01), (hd, f32)


def test_half_dim_table_indexes_the_doubled_rows():
    mesh = jaxscale.make_mesh(1, 8)
    t = jaxscale.TableConfig("seq", rows=100, dim=16, pooling=None, reshape="half_dim")
    assert (t.stored_rows, t.stored_dim) == (200, 8)
    ec = jaxscale.EmbeddingCollection([t], mesh)
    w = np.random.default_rng(0).normal(size=(200, 8)).astype(np.float32)
    ids = np.tile(np.array([0, 99, 100, 199, -1], np.int32)[None], (8, 1))
    out = np.asarray(ec.lookup(ec.from_dense({"seq": w}), {"seq": ids})["seq"])
    assert out.shape == (8, 5, 8)
    np.testing.assert_array_equal(out[3, :4], w[[0, 99, 100, 199]])
    np.testing.assert_array_equal(out[3, 4], 0.0)
    with pytest.raises(ValueError, match="id 200 is out of range"):
        ec.lookup(ec.from_dense({"seq": w}), {"seq": np.full((8, 1), 200, np.int32)})


def _train_losses(tmp_path, name, *overrides):
    from jaxscale.training.config import load_config
    from jaxscale.training.trainer import Trainer

    cfg = load_config(
        "jaxscale/configs/foundation_tiny.yaml",
        [
            "train.steps=200",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "train.log_every=50",
            f"train.workdir={tmp_path / name}",
            "mesh.nodes=2",
            "mesh.local=4",
            *overrides,
        ],
    )
    return Trainer(cfg, progress=False).run()["losses"]


@pytest.mark.slow  # two full training runs (~45 s)
def test_fp8_training_ends_within_one_percent_of_fp32(tmp_path):
    """200 steps on the synthetic task: fp8 comms (e4m3 forward, e5m2 backward) vs fp32 comms."""
    fp32 = _train_losses(tmp_path, "fp32")
    fp8 = _train_losses(tmp_path, "fp8", "embedding.comm.forward=fp8", "embedding.comm.backward=fp8")
    assert len(fp32) == len(fp8) == 200
    end32, end8 = np.mean(fp32[-20:]), np.mean(fp8[-20:])
    assert end32 < np.mean(fp32[:10])  # it learned
    assert fp8 != fp32  # really quantized
    assert abs(end8 - end32) / end32 < 0.01, (end8, end32)
