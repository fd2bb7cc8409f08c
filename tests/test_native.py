"""jaxscale.engine.native: the native CPU kernels and the pure-JAX kernels against brute-force NumPy references.

Every op runs under both implementations (JAXSCALE_NATIVE=1 and =0) inside jax.jit, on random shapes
(widths 1..129), duplicate-heavy and Zipf ids, padding and out-of-range ids, empty inputs, both
optimizers and apply=False; per device inside shard_map on the 8 simulated devices; and the build, the
cache and the in-place update of a donated table are checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.engine import native
from jaxscale.engine.native import build, runtime

REPO = Path(__file__).resolve().parents[1]
RTOL, ATOL = 1e-5, 1e-6
LR, EPS = 0.05, 1e-8
WIDTHS = (1, 3, 8, 17, 64, 129)


@pytest.fixture(scope="module")
def native_ready():
    """The native library must build here (g++ is part of the test environment)."""
    if os.environ.get("JAXSCALE_NATIVE") == "0":
        pytest.skip("JAXSCALE_NATIVE=0 set for this run: native kernels disabled on purpose")
    assert native.available(), f"native kernels unavailable: {native.unavailable_reason()}"


@pytest.fixture(params=["native", "jax"])
def impl(request, monkeypatch, native_ready):
    monkeypatch.setenv("JAXSCALE_NATIVE", "1" if request.param == "native" else "0")
    return request.param


# ----------------------------------------------------------------------------------- NumPy references


def ref_gather_rows(table, rows):
    out = np.zeros((len(rows), table.shape[1]), np.float32)
    for i, r in enumerate(rows):
        if 0 <= r < table.shape[0]:
            out[i] = table[r]
    return out


def ref_gather_pool(table, ids, pooling):
    b, L = ids.shape
    emb = ref_gather_rows(table, ids.reshape(-1)).reshape(b, L, table.shape[1]).astype(np.float64)
    if pooling is None:
        return emb
    s = emb.sum(1)
    if pooling == "mean":
        s /= np.maximum(((ids >= 0) & (ids < table.shape[0])).sum(1, keepdims=True), 1)
    return s


def ref_update(table, acc, rows, grads, optimizer, apply=True, increment=None):
    """FBGEMM semantics, float64, brute force: sum per row, then one optimizer step per unique row."""
    table, acc = table.astype(np.float64).copy(), None if acc is None else acc.astype(np.float64).copy()
    if not apply:
        return table, acc
    sums, first = {}, {}
    for i, r in enumerate(rows):
        if 0 <= r < table.shape[0]:
            sums[r] = sums.get(r, 0.0) + grads[i].astype(np.float64)
            first.setdefault(r, i)
    for r, g in sums.items():
        if optimizer == "sgd":
            table[r] -= LR * g
        else:
            acc[r] += increment[first[r]] if increment is not None else np.mean(g * g)
            table[r] -= LR * g / (np.sqrt(acc[r]) + EPS)
    return table, acc


def ref_update_pooled(table, acc, ids, grad, pooling, optimizer, apply=True):
    b, L = ids.shape
    valid = (ids >= 0) & (ids < table.shape[0])
    if pooling is None:
        per = grad.reshape(b * L, -1)
    else:
        g = grad / np.maximum(valid.sum(1, keepdims=True), 1) if pooling == "mean" else grad
        per = np.repeat(g, L, axis=0)
    return ref_update(table, acc, ids.reshape(-1), per, optimizer, apply)


def close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------------------- random data


def zipf_ids(rng, rows, shape, a=1.1):
    return ((rng.zipf(a, size=shape).astype(np.int64) - 1) * 2654435761 % rows).astype(np.int32)


def make_ids(rng, kind, rows, shape):
    """'uniform', 'zipf', 'dupes' (a handful of rows) or 'messy' (padding, negative and >= rows ids)."""
    if kind == "uniform":
        return rng.integers(0, rows, shape).astype(np.int32)
    if kind == "zipf":
        return zipf_ids(rng, rows, shape)
    if kind == "dupes":
        return rng.choice(rng.integers(0, rows, 3), shape).astype(np.int32)
    x = rng.integers(0, rows, shape).astype(np.int32)
    r = rng.random(shape)
    x[r < 0.2] = -1
    x[(r >= 0.2) & (r < 0.27)] = rows + rng.integers(0, 5, shape)[(r >= 0.2) & (r < 0.27)]
    x[(r >= 0.27) & (r < 0.3)] = -7
    return x


def state(rng, rows, w):
    table = rng.normal(size=(rows, w)).astype(np.float32)
    acc = rng.uniform(0, 0.5, rows).astype(np.float32)
    return table, acc


CASES = [  # (seed, rows, width, b, L, ids kind)
    (0, 50, 1, 7, 3, "messy"),
    (1, 300, 3, 16, 5, "zipf"),
    (2, 40, 8, 33, 4, "dupes"),
    (3, 500, 17, 9, 11, "messy"),
    (4, 1000, 64, 64, 20, "zipf"),
    (5, 70, 129, 5, 6, "uniform"),
    (6, 1, 16, 4, 3, "dupes"),
]


def _case_id(c):
    return f"R{c[1]}-w{c[2]}-b{c[3]}xL{c[4]}-{c[5]}"


# ------------------------------------------------------------------------------------------- lowering


def lowers_to_native(fn, *args) -> bool:
    return "jaxscale_" in jax.jit(fn).lower(*args).as_text()


def test_native_mode_really_uses_the_kernels(native_ready, monkeypatch):
    t = jnp.zeros((10, 4))
    ids = jnp.zeros((2, 3), jnp.int32)
    monkeypatch.setenv("JAXSCALE_NATIVE", "1")
    assert lowers_to_native(lambda t, x: native.gather_pool(t, x, pooling="sum"), t, ids)
    monkeypatch.setenv("JAXSCALE_NATIVE", "0")
    assert not lowers_to_native(lambda t, x: native.gather_pool(t, x, pooling="sum"), t, ids)


# -------------------------------------------------------------------------------------------- gathers


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gather_rows(impl, case):
    seed, rows, w, b, L, kind = case
    rng = np.random.default_rng(seed)
    table, _ = state(rng, rows, w)
    r = make_ids(rng, kind, rows, (b * L,))
    out = jax.jit(native.gather_rows)(table, r)
    assert out.shape == (b * L, w) and out.dtype == jnp.float32
    close(out, ref_gather_rows(table, r))


@pytest.mark.parametrize("pooling", ["sum", "mean", None])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gather_pool(impl, case, pooling):
    seed, rows, w, b, L, kind = case
    rng = np.random.default_rng(seed)
    table, _ = state(rng, rows, w)
    ids = make_ids(rng, kind, rows, (b, L))
    if kind == "messy":
        ids[0] = -1  # an all-padding bag: zeros
    out = jax.jit(lambda t, x: native.gather_pool(t, x, pooling=pooling))(table, ids)
    assert out.shape == ((b, w) if pooling else (b, L, w))
    close(out, ref_gather_pool(table, ids, pooling))


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (0, 0)])
def test_empty_lookups(impl, shape):
    table = np.ones((5, 6), np.float32)
    ids = np.zeros(shape, np.int32)
    for pooling in ("sum", "mean", None):
        out = jax.jit(lambda t, x, p=pooling: native.gather_pool(t, x, pooling=p))(table, ids)
        close(out, ref_gather_pool(table, ids, pooling))
    assert jax.jit(native.gather_rows)(table, ids.reshape(-1)).shape == (0, 6)


def test_gather_is_differentiable_in_the_table(impl):
    rng = np.random.default_rng(7)
    table, _ = state(rng, 30, 5)
    ids = make_ids(rng, "messy", 30, (6, 4))
    ct = rng.normal(size=(6, 5)).astype(np.float32)
    for pooling in ("sum", "mean"):
        got = jax.jit(jax.grad(lambda t, p=pooling: jnp.sum(native.gather_pool(t, ids, pooling=p) * ct)))(table)
        # d/dtable of sum(out * ct) = sum over each valid id of its bag's (scaled) cotangent
        valid = (ids >= 0) & (ids < 30)
        scale = 1.0 / np.maximum(valid.sum(1), 1) if pooling == "mean" else np.ones(6)
        want = np.zeros_like(table, np.float64)
        for bi in range(6):
            for j in range(4):
                if valid[bi, j]:
                    want[ids[bi, j]] += ct[bi] * scale[bi]
        close(got, want)
    rows = ids.reshape(-1)
    ct_rows = rng.normal(size=(rows.size, 5)).astype(np.float32)
    got = jax.grad(lambda t: jnp.sum(native.gather_rows(t, rows) * ct_rows))(table)
    want = np.zeros_like(table, np.float64)
    for i, r in enumerate(rows):
        if 0 <= r < 30:
            want[r] += ct_rows[i]
    close(got, want)


# -------------------------------------------------------------------------------------------- updates


@pytest.mark.parametrize("order", ["as_drawn", "sorted"])  # sorted: the kernel skips its radix sort
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_update_rows(impl, case, optimizer, order):
    seed, rows, w, b, L, kind = case
    rng = np.random.default_rng(100 + seed)
    table, acc = state(rng, rows, w)
    r = make_ids(rng, kind, rows, (b * L,))
    r = np.sort(r) if order == "sorted" else r
    g = rng.normal(size=(b * L, w)).astype(np.float32)
    acc_in = acc if optimizer == "rowwise_adagrad" else None
    fn = jax.jit(
        lambda t, a, r, g: native.update_rows(t, a, r, g, optimizer=optimizer, learning_rate=LR, eps=EPS),
        donate_argnums=(0, 1),
    )
    new_t, new_a = fn(jnp.asarray(table), None if acc_in is None else jnp.asarray(acc_in), r, g)
    want_t, want_a = ref_update(table, acc_in, r, g, optimizer)
    close(new_t, want_t)
    if optimizer == "sgd":
        assert new_a is None
    else:
        close(new_a, want_a)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_update_rows_apply_false_and_empty(impl, optimizer):
    rng = np.random.default_rng(11)
    table, acc = state(rng, 20, 9)
    r = make_ids(rng, "dupes", 20, (15,))
    g = rng.normal(size=(15, 9)).astype(np.float32)
    fn = jax.jit(
        lambda t, a, r, g, ap: native.update_rows(t, a, r, g, optimizer=optimizer, learning_rate=LR, eps=EPS, apply=ap),
        donate_argnums=(0, 1),
    )
    new_t, new_a = fn(jnp.asarray(table), jnp.asarray(acc), r, g, False)
    np.testing.assert_array_equal(np.asarray(new_t), table)
    np.testing.assert_array_equal(np.asarray(new_a), acc)
    empty_rows, empty_grads = np.zeros((0,), np.int32), np.zeros((0, 9), np.float32)
    new_t, new_a = fn(jnp.asarray(table), jnp.asarray(acc), empty_rows, empty_grads, True)
    np.testing.assert_array_equal(np.asarray(new_t), table)
    np.testing.assert_array_equal(np.asarray(new_a), acc)
    all_bad = np.array([-1, 20, 99, -5], np.int32)
    new_t, new_a = fn(jnp.asarray(table), jnp.asarray(acc), all_bad, np.ones((4, 9), np.float32), True)
    np.testing.assert_array_equal(np.asarray(new_t), table)
    np.testing.assert_array_equal(np.asarray(new_a), acc)


def test_update_rows_on_a_large_table(impl):
    """5M rows: 23-bit row ids, three radix passes in the native sort; ids spread over the whole range."""
    rng = np.random.default_rng(14)
    R = 5_000_003
    table = np.zeros((R, 2), np.float32)
    acc = np.zeros(R, np.float32)
    r = np.concatenate([rng.integers(0, R, 300), [R - 1, R - 1, 0, 1 << 22, (1 << 22) - 1, R, -1]]).astype(np.int32)
    g = rng.normal(size=(r.size, 2)).astype(np.float32)
    new_t, new_a = jax.jit(
        lambda t, a, r, g: native.update_rows(t, a, r, g, optimizer="rowwise_adagrad", learning_rate=LR, eps=EPS),
        donate_argnums=(0, 1),
    )(jnp.asarray(table), jnp.asarray(acc), r, g)
    valid = (r >= 0) & (r < R)
    touched = np.unique(r[valid])
    local = np.where(valid, np.searchsorted(touched, r), -1)  # the reference runs on the touched rows only
    sub_t, sub_a = ref_update(table[touched], acc[touched], local, g, "rowwise_adagrad")
    new_t, new_a = np.asarray(new_t), np.asarray(new_a)
    close(new_t[touched], sub_t)
    close(new_a[touched], sub_a)
    untouched = np.ones(R, bool)
    untouched[touched] = False
    assert not new_t[untouched].any() and not new_a[untouched].any()


def test_update_rows_acc_increment(impl):
    rng = np.random.default_rng(12)
    table, acc = state(rng, 60, 7)
    r = make_ids(rng, "zipf", 60, (80,))
    r[::9] = -1
    g = rng.normal(size=(80, 7)).astype(np.float32)
    per_row = rng.uniform(0.1, 2.0, 60).astype(np.float32)
    inc = per_row[np.clip(r, 0, 59)]  # every entry of a row carries the row's value
    inc[r < 0] = 123.0  # ignored with its row
    new_t, new_a = jax.jit(
        lambda t, a, r, g, i: native.update_rows(
            t, a, r, g, optimizer="rowwise_adagrad", learning_rate=LR, eps=EPS, acc_increment=i
        )
    )(table, acc, r, g, inc)
    want_t, want_a = ref_update(table, acc, r, g, "rowwise_adagrad", increment=inc)
    close(new_t, want_t)
    close(new_a, want_a)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("pooling", ["sum", "mean", None])
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4]], ids=_case_id)
def test_update_pooled(impl, case, pooling, optimizer):
    seed, rows, w, b, L, kind = case
    rng = np.random.default_rng(200 + seed)
    table, acc = state(rng, rows, w)
    ids = make_ids(rng, kind, rows, (b, L))
    grad = rng.normal(size=(b, w) if pooling else (b, L, w)).astype(np.float32)
    acc_in = acc if optimizer == "rowwise_adagrad" else None
    new_t, new_a = jax.jit(
        lambda t, a, x, g: native.update_pooled(
            t, a, x, g, pooling=pooling, optimizer=optimizer, learning_rate=LR, eps=EPS
        ),
        donate_argnums=(0, 1),
    )(jnp.asarray(table), None if acc_in is None else jnp.asarray(acc_in), ids, grad)
    want_t, want_a = ref_update_pooled(table, acc_in, ids, grad, pooling, optimizer)
    close(new_t, want_t)
    if acc_in is not None:
        close(new_a, want_a)


def test_update_pooled_apply_false_and_empty(impl):
    rng = np.random.default_rng(13)
    table, acc = state(rng, 25, 6)
    fn = jax.jit(
        lambda t, a, x, g, ap: native.update_pooled(
            t, a, x, g, pooling="mean", optimizer="rowwise_adagrad", learning_rate=LR, eps=EPS, apply=ap
        )
    )
    ids = make_ids(rng, "messy", 25, (5, 4))
    new_t, new_a = fn(table, acc, ids, np.ones((5, 6), np.float32), jnp.asarray(False))
    np.testing.assert_array_equal(np.asarray(new_t), table)
    np.testing.assert_array_equal(np.asarray(new_a), acc)
    for shape in [(0, 4), (5, 0)]:
        new_t, new_a = fn(table, acc, np.zeros(shape, np.int32), np.ones((shape[0], 6), np.float32), True)
        np.testing.assert_array_equal(np.asarray(new_t), table)
        np.testing.assert_array_equal(np.asarray(new_a), acc)


def test_native_equals_pure_jax_on_a_zipf_training_run(native_ready, monkeypatch):
    """Five lookup+update steps on fresh Zipf batches: both implementations end on the same table."""
    rng = np.random.default_rng(21)
    table, acc = state(rng, 2000, 32)
    batches = [(zipf_ids(rng, 2000, (128, 10)), rng.normal(size=(128, 32)).astype(np.float32)) for _ in range(5)]
    finals = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("JAXSCALE_NATIVE", mode)

        @jax.jit
        def step(t, a, x, g):
            out = native.gather_pool(t, x, pooling="sum")
            t, a = native.update_pooled(
                t, a, x, g + 1e-3 * out, pooling="sum", optimizer="rowwise_adagrad", learning_rate=LR, eps=EPS
            )
            return t, a

        t, a = jnp.asarray(table), jnp.asarray(acc)
        for x, g in batches:
            t, a = step(t, a, x, g)
        finals[mode] = (np.asarray(t), np.asarray(a))
    np.testing.assert_allclose(finals["1"][0], finals["0"][0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(finals["1"][1], finals["0"][1], rtol=RTOL, atol=ATOL)
    assert not np.allclose(finals["1"][0], table)


# ------------------------------------------------------------ per-slot pooling (the partial-sums path)


def ref_segment_sum(table, rows, segments, num_segments):
    out = np.zeros((num_segments, table.shape[1]))
    for r, s in zip(rows, segments):
        if 0 <= r < table.shape[0] and 0 <= s < num_segments:
            out[s] += table[r]
    return out


@pytest.mark.parametrize("order", ["as_drawn", "sorted"])  # sorted (the engine's usual input): no sort
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gather_segment_sum(impl, case, order):
    seed, rows, w, b, L, kind = case
    rng = np.random.default_rng(300 + seed)
    table, _ = state(rng, rows, w)
    r = make_ids(rng, kind, rows, (b * L,))
    segs = rng.integers(-2, b + 2, b * L).astype(np.int32)  # out-of-range slots contribute nothing
    if order == "sorted":  # in-range segments in order, the out-of-range ones left where they fall
        ok = (segs >= 0) & (segs < b)
        segs[ok] = np.sort(segs[ok])
    out = jax.jit(lambda t, r, s: native.gather_segment_sum(t, r, s, num_segments=b))(table, r, segs)
    assert out.shape == (b, w)
    close(out, ref_segment_sum(table, r, segs, b))


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=_case_id)
def test_update_rows_indexed(impl, case, optimizer):
    seed, rows, w, b, L, kind = case
    rng = np.random.default_rng(400 + seed)
    table, acc = state(rng, rows, w)
    r = make_ids(rng, kind, rows, (b * L,))
    gi = rng.integers(-1, b + 1, b * L).astype(np.int32)
    grads = rng.normal(size=(b, w)).astype(np.float32)
    acc_in = acc if optimizer == "rowwise_adagrad" else None
    new_t, new_a = jax.jit(
        lambda t, a, r, gi, g: native.update_rows_indexed(
            t, a, r, gi, g, optimizer=optimizer, learning_rate=LR, eps=EPS
        ),
        donate_argnums=(0, 1),
    )(jnp.asarray(table), None if acc_in is None else jnp.asarray(acc_in), r, gi, grads)
    ok = (gi >= 0) & (gi < b)
    per_row = np.where(ok[:, None], grads[np.clip(gi, 0, b - 1)], 0.0).astype(np.float32)
    want_t, want_a = ref_update(table, acc_in, np.where(ok, r, -1), per_row, optimizer)
    close(new_t, want_t)
    if acc_in is not None:
        close(new_a, want_a)


def test_segment_path_equals_pooled_path(impl):
    """Pooling by slot + the indexed update == gather_pool + update_pooled when the slot is the bag."""
    rng = np.random.default_rng(41)
    table, acc = state(rng, 300, 16)
    ids = make_ids(rng, "messy", 300, (12, 7))
    grad = rng.normal(size=(12, 16)).astype(np.float32)
    bags = np.repeat(np.arange(12, dtype=np.int32), 7)

    def via_segments(t, a, x, g):
        out = native.gather_segment_sum(t, x.reshape(-1), bags, num_segments=12)
        t, a = native.update_rows_indexed(
            t, a, x.reshape(-1), bags, g, optimizer="rowwise_adagrad", learning_rate=LR, eps=EPS, after=out
        )
        return out, t, a

    def via_pooled(t, a, x, g):
        out = native.gather_pool(t, x, pooling="sum")
        t, a = native.update_pooled(
            t, a, x, g, pooling="sum", optimizer="rowwise_adagrad", learning_rate=LR, eps=EPS, after=out
        )
        return out, t, a

    got = jax.jit(via_segments)(table, acc, ids, grad)
    want = jax.jit(via_pooled)(table, acc, ids, grad)
    for x, y in zip(got, want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL)


def test_gather_segment_sum_is_differentiable(impl):
    rng = np.random.default_rng(42)
    table, _ = state(rng, 40, 6)
    r = make_ids(rng, "messy", 40, (30,))
    segs = rng.integers(0, 5, 30).astype(np.int32)
    ct = rng.normal(size=(5, 6)).astype(np.float32)
    got = jax.grad(lambda t: jnp.sum(native.gather_segment_sum(t, r, segs, num_segments=5) * ct))(table)
    want = np.zeros_like(table, np.float64)
    for ri, si in zip(r, segs):
        if 0 <= ri < 40:
            want[ri] += ct[si]
    close(got, want)


# -------------------------------------------------------------------------------------- errors / input


def test_bad_inputs_raise_clear_errors(monkeypatch):
    monkeypatch.setenv("JAXSCALE_NATIVE", "0")
    t = jnp.zeros((10, 4))
    a = jnp.zeros((10,))
    r = jnp.zeros((3,), jnp.int32)
    g = jnp.zeros((3, 4))
    with pytest.raises(TypeError, match="table must be a float32"):
        native.gather_rows(t.astype(jnp.int32), r)
    with pytest.raises(TypeError, match="rows must be an int32"):
        native.gather_rows(t, r.astype(jnp.float32))
    with pytest.raises(TypeError, match="ids must be an int32"):
        native.gather_pool(t, r, pooling="sum")
    with pytest.raises(ValueError, match="pooling must be"):
        native.gather_pool(t, r.reshape(1, 3), pooling="max")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        native.update_rows(t, a, r, g, optimizer="adam", learning_rate=0.1)
    with pytest.raises(ValueError, match="needs the accumulator"):
        native.update_rows(t, None, r, g, optimizer="rowwise_adagrad", learning_rate=0.1)
    with pytest.raises(TypeError, match=r"grads must be a float32 array of shape \[3, 4\]"):
        native.update_rows(t, a, r, g[:, :2], optimizer="sgd", learning_rate=0.1)
    with pytest.raises(TypeError, match=r"acc must be a float32 \[R\] = \[10\]"):
        native.update_rows(t, a[:5], r, g, optimizer="rowwise_adagrad", learning_rate=0.1)
    with pytest.raises(TypeError, match=r"grad must be a float32 array of shape \[1, 3, 4\]"):
        native.update_pooled(t, a, r.reshape(1, 3), g, pooling=None, optimizer="sgd", learning_rate=0.1)
    with pytest.raises(ValueError, match="learning_rate must be finite"):
        native.update_rows(t, a, r, g, optimizer="sgd", learning_rate=float("nan"))
    with pytest.raises(TypeError, match="learning_rate must be a static Python number"):
        jax.jit(lambda lr: native.update_rows(t, a, r, g, optimizer="sgd", learning_rate=lr))(0.1)
    with pytest.raises(TypeError, match="apply must be a boolean scalar"):
        native.update_rows(t, a, r, g, optimizer="sgd", learning_rate=0.1, apply=jnp.ones((2,), bool))
    with pytest.raises(ValueError, match="acc_increment only applies"):
        native.update_rows(t, a, r, g, optimizer="sgd", learning_rate=0.1, acc_increment=jnp.zeros(3))
    with pytest.raises(TypeError, match="segments must have the shape of rows"):
        native.gather_segment_sum(t, r, r[:2], num_segments=4)
    with pytest.raises(TypeError, match="num_segments must be a static non-negative int"):
        native.gather_segment_sum(t, r, r, num_segments=-1)
    with pytest.raises(TypeError, match="owners must be a static non-negative int"):
        native.rank_within_owner(r, owners=-1)
    with pytest.raises(TypeError, match="owners must be a static non-negative int below"):
        native.rank_within_owner(r, owners=2**31)
    with pytest.raises(TypeError, match="owner must be an int32"):
        native.rank_within_owner(r.astype(jnp.float32), owners=2)
    with pytest.raises(TypeError, match="capacity must be a static non-negative int"):
        native.slot_bags(r.reshape(1, 3), capacity=True)
    with pytest.raises(TypeError, match="counts must be an int32"):
        native.slot_bags(r, capacity=4)
    with pytest.raises(TypeError, match="grad_index must have the shape of rows"):
        native.update_rows_indexed(t, a, r, r[:1], g, optimizer="sgd", learning_rate=0.1)
    with pytest.raises(TypeError, match=r"grads must be a float32 array of shape \[3, 4\]"):
        native.update_rows_indexed(t, a, r, r, g[:, :3], optimizer="sgd", learning_rate=0.1)


def test_bad_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv("JAXSCALE_NATIVE", "yes")
    with pytest.raises(ValueError, match="JAXSCALE_NATIVE='yes'"):
        native.available()


# ----------------------------------------------------------------------------- in place, jit, shard_map


def _table_copies(compiled, rows, w) -> int:
    return sum(1 for line in compiled.as_text().splitlines() if " copy(" in line and f"f32[{rows},{w}]" in line)


@pytest.mark.parametrize("mode", ["1", "0"])
def test_donated_table_is_updated_in_place(native_ready, monkeypatch, mode):
    """The in-place trap: an update that does not depend on the lookup output makes XLA copy the table.

    With `after=out` (or a gradient computed from the output, as in training) no copy is left and the
    temporary memory is far below one table.
    """
    monkeypatch.setenv("JAXSCALE_NATIVE", mode)
    R, w = 4096, 32
    t = jnp.zeros((R, w))
    a = jnp.zeros((R,))
    x = jnp.zeros((16, 4), jnp.int32)
    G = jnp.zeros((16, w))

    def step(t, a, x, g, how):
        out = native.gather_pool(t, x, pooling="sum")
        if how == "grad_from_output":
            g = g + out
        after = out if how == "after" else None
        t, a = native.update_pooled(
            t, a, x, g, pooling="sum", optimizer="rowwise_adagrad", learning_rate=LR, after=after
        )
        return out, t, a

    table_bytes = R * w * 4
    compiled = {
        how: jax.jit(step, donate_argnums=(0, 1), static_argnums=4).lower(t, a, x, G, how).compile()
        for how in ("independent", "after", "grad_from_output")
    }
    assert _table_copies(compiled["independent"], R, w) >= 1  # the trap exists: documented in docs/native.md
    assert compiled["independent"].memory_analysis().temp_size_in_bytes >= table_bytes
    for how in ("after", "grad_from_output"):
        assert _table_copies(compiled[how], R, w) == 0, how
        assert compiled[how].memory_analysis().temp_size_in_bytes < table_bytes // 4, how

    # And the in-place step computes the right thing.
    rng = np.random.default_rng(3)
    table, acc = state(rng, R, w)
    ids = make_ids(rng, "zipf", R, (16, 4))
    grad = rng.normal(size=(16, w)).astype(np.float32)
    out, new_t, new_a = compiled["after"](jnp.asarray(table), jnp.asarray(acc), ids, grad)
    close(out, ref_gather_pool(table, ids, "sum"))
    want_t, want_a = ref_update_pooled(table, acc, ids, grad, "sum", "rowwise_adagrad")
    close(new_t, want_t)
    close(new_a, want_a)


def test_donated_buffer_is_reused(native_ready, monkeypatch):
    monkeypatch.setenv("JAXSCALE_NATIVE", "1")
    t = jnp.asarray(np.random.default_rng(0).normal(size=(512, 16)).astype(np.float32))
    ptr = t.unsafe_buffer_pointer()
    fn = jax.jit(
        lambda t, r, g: native.update_rows(t, None, r, g, optimizer="sgd", learning_rate=LR)[0], donate_argnums=0
    )
    new = fn(t, np.arange(8, dtype=np.int32), np.ones((8, 16), np.float32))
    assert t.is_deleted()
    assert new.unsafe_buffer_pointer() == ptr


@pytest.mark.parametrize("mode", ["1", "0"])
def test_per_shard_inside_shard_map(native_ready, monkeypatch, mode):
    """Each of the 8 devices looks up and updates its own block with its own ids."""
    monkeypatch.setenv("JAXSCALE_NATIVE", mode)
    mesh = jax.make_mesh((8,), ("d",))
    S, R, w, b, L = 8, 200, 24, 6, 5
    rng = np.random.default_rng(31)
    tables = rng.normal(size=(S, R, w)).astype(np.float32)
    accs = rng.uniform(0, 1, (S, R)).astype(np.float32)
    ids = np.stack([make_ids(rng, k, R, (b, L)) for k in ["messy", "zipf", "dupes", "uniform"] * 2])
    grads = rng.normal(size=(S, b, w)).astype(np.float32)

    def body(t, a, x, g):
        out = native.gather_pool(t[0], x[0], pooling="mean")
        nt, na = native.update_pooled(
            t[0], a[0], x[0], g[0] + out, pooling="mean", optimizer="rowwise_adagrad", learning_rate=LR, eps=EPS
        )
        return out[None], nt[None], na[None]

    spec = P("d")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3), donate_argnums=(0, 1))
    put = lambda v: jax.device_put(v, NamedSharding(mesh, spec))  # noqa: E731
    out, nt, na = (np.asarray(v) for v in fn(put(tables), put(accs), put(ids), put(grads)))
    for s in range(S):
        want_out = ref_gather_pool(tables[s], ids[s], "mean")
        close(out[s], want_out)
        g = grads[s] + want_out.astype(np.float32)
        want_t, want_a = ref_update_pooled(tables[s], accs[s], ids[s], g, "mean", "rowwise_adagrad")
        close(nt[s], want_t)
        close(na[s], want_a)


# --------------------------------------------------------------------------------- determinism, threads

_DETERMINISM_SCRIPT = textwrap.dedent(
    """
    import os, sys
    if sys.argv[1] == "one":
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    os.environ["JAXSCALE_NATIVE"] = "1"
    import numpy as np, jax, jax.numpy as jnp
    from jaxscale.engine import native
    rng = np.random.default_rng(5)
    R, w = 20000, 48
    table = rng.normal(size=(R, w)).astype(np.float32)
    acc = np.zeros(R, np.float32)
    ids = ((rng.zipf(1.05, size=(2048, 16)) - 1) * 2654435761 % R).astype(np.int32)
    g = rng.normal(size=(2048, w)).astype(np.float32)
    t, a = jax.jit(lambda t, a, x, g: native.update_pooled(
        t, a, x, g, pooling="sum", optimizer="rowwise_adagrad", learning_rate=0.1, eps=1e-8))(table, acc, ids, g)
    np.save(sys.argv[2], np.concatenate([np.asarray(t).ravel(), np.asarray(a)]))
    """
)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_native_update_is_bitwise_independent_of_the_thread_count(native_ready, tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: the multi-threaded run would be single-threaded too")
    script = tmp_path / "det.py"
    script.write_text(_DETERMINISM_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    results = {}
    for threads in ("one", "all"):
        path = tmp_path / f"{threads}.npy"
        subprocess.run([sys.executable, str(script), threads, str(path)], env=env, check=True, timeout=300)
        results[threads] = np.load(path)
    np.testing.assert_array_equal(results["one"], results["all"])


# ------------------------------------------------------------------------------------- build and cache


def test_cache_key_covers_flags_and_names_the_library(native_ready, monkeypatch):
    plan = build.plan_build()
    assert plan.library.name == f"jaxscale_native-{plan.key}.so"
    assert "-O3" in plan.flags and "-fPIC" in plan.flags and "-march=native" not in plan.flags
    monkeypatch.setenv("JAXSCALE_NATIVE_CXXFLAGS", "-DJAXSCALE_TEST_FLAG=1")
    assert build.plan_build().key != plan.key
    assert build.plan_build(isa=()).key != build.plan_build(isa=("-march=x86-64-v3",)).key
    assert native.library_path() is not None and Path(native.library_path()).exists()


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(build.BuildError, match="no C\\+\\+ compiler found"):
        build.find_compiler()
    monkeypatch.setenv("CXX", "definitely-not-a-compiler")
    with pytest.raises(build.BuildError, match="CXX='definitely-not-a-compiler'"):
        build.find_compiler()


def test_the_library_is_written_whole_through_a_temporary_file(tmp_path, monkeypatch):
    """compile_library has the compiler write a temporary file beside the library and renames it into place
    (jaxscale.infra.atomic): a failed compile leaves neither a library nor a temporary file behind."""
    fake = tmp_path / "fake-c++"  # writes its -o argument like a compiler, or fails when told to
    fake.write_text('#!/bin/sh\n[ -n "$FAIL" ] && { echo boom >&2; exit 1; }\nwhile [ "$1" != -o ]; do shift; done\n'
                    'printf lib > "$2"\n')  # fmt: skip
    fake.chmod(0o755)
    cache = tmp_path / "cache"
    plan = build.BuildPlan(str(fake), "0", (), str(tmp_path), "k", cache / "lib-k.so")
    renames = []
    real = os.replace
    monkeypatch.setattr(build.atomic.os, "replace", lambda a, b: (renames.append((Path(a), Path(b))), real(a, b)))
    monkeypatch.setenv("FAIL", "1")
    with pytest.raises(build.BuildError, match="boom"):
        build.compile_library(plan)
    assert not plan.library.exists() and [p.name for p in cache.iterdir()] == ["lib-k.lock"]
    monkeypatch.delenv("FAIL")
    assert build.compile_library(plan) == plan.library and plan.library.read_text() == "lib"
    assert len(renames) == 1 and renames[0][1] == plan.library and renames[0][0].parent == cache
    assert renames[0][0].name.endswith(".tmp") and os.access(plan.library, os.X_OK)
    assert sorted(p.name for p in cache.iterdir()) == ["lib-k.lock", "lib-k.so"]


_FALLBACK_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    import numpy as np, jax
    from jaxscale.engine import native
    out = {"available": native.available(), "reason": native.unavailable_reason()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t = np.arange(12, dtype=np.float32).reshape(4, 3)
            x = np.array([[0, 3, -1], [2, 2, 9]], np.int32)
            out["pooled"] = np.asarray(jax.jit(lambda t, x: native.gather_pool(t, x, pooling="sum"))(t, x)).tolist()
            jax.jit(lambda t, x: native.gather_pool(t, x, pooling="mean"))(t, x)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    print("RESULT " + json.dumps(out))
    """
)


def _run_without_compiler(tmp_path, mode):
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", JAXSCALE_NATIVE=mode)
    env.update(CXX=str(tmp_path / "no-such-c++"), JAXSCALE_NATIVE_CACHE=str(tmp_path / "cache"))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-c", _FALLBACK_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stderr
    return json.loads(line[0][len("RESULT ") :])


def test_auto_falls_back_with_one_warning_when_the_build_fails(tmp_path):
    out = _run_without_compiler(tmp_path, "auto")
    assert out["available"] is False and "no-such-c++" in out["reason"]
    assert "error" not in out
    np.testing.assert_allclose(out["pooled"], [[9, 11, 13], [12, 14, 16]])
    assert len(out["warnings"]) == 1 and "\n" not in out["warnings"][0]
    assert "pure-JAX" in out["warnings"][0]


def test_native_1_without_compiler_raises(tmp_path):
    out = _run_without_compiler(tmp_path, "1")
    assert out["error"].startswith("NativeUnavailableError")
    assert "JAXSCALE_NATIVE=1" in out["error"] and "no-such-c++" in out["error"]


def test_native_0_never_builds(tmp_path):
    out = _run_without_compiler(tmp_path, "0")
    assert out["available"] is False and out["reason"] == "disabled by JAXSCALE_NATIVE=0"
    assert "error" not in out and out["warnings"] == []
    assert not (tmp_path / "cache").exists()


_CONCURRENT_SCRIPT = "from jaxscale.engine.native import build; print('LIB', build.build())"


@pytest.mark.slow  # compiles the library from scratch (~15 s of CPU)
def test_concurrent_first_use_builds_once(tmp_path):
    """Three processes build into an empty cache at once: one library, identical paths, no leftovers."""
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", JAXSCALE_NATIVE_CACHE=str(tmp_path))
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONCURRENT_SCRIPT],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    paths = {line.split(" ", 1)[1] for o in outs for line in o[0].splitlines() if line.startswith("LIB ")}
    assert len(paths) == 1
    libs = list(tmp_path.glob("*.so"))
    assert [str(p) for p in libs] == list(paths)
    assert not list(tmp_path.glob("*.tmp"))
    assert runtime.TARGETS  # the library is loadable and exports every handler:
    import ctypes

    lib = ctypes.CDLL(str(libs[0]))
    for symbol in runtime.TARGETS.values():
        assert hasattr(lib, symbol)
    assert lib.jaxscale_native_abi_version() == build.ABI_VERSION


# ------------------------------------------------------------------------ the benchmark and GPU scripts


def _script_env(tmp_path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", PYTHON=sys.executable)
    env.pop("XLA_FLAGS", None)
    return env


@pytest.mark.slow  # two engines x one round of the quick workload, each in its own process (~1 min)
def test_bench_native_quick_run_writes_a_checked_table(native_ready, tmp_path):
    import importlib.util

    if importlib.util.find_spec("fbgemm_gpu") is None:
        pytest.skip("fbgemm_gpu is not installed (experiments/baselines/install_torchrec.sh installs it)")
    out = tmp_path / "bench.md"
    cmd = [sys.executable, str(REPO / "experiments/bench/bench_native.py"), "--quick", "--rounds", "1"]
    cmd += ["--engines", "jaxscale-native,fbgemm", "--no-interference", "--out", str(out)]
    proc = subprocess.run(cmd, env=_script_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "| jaxscale-native |" in text and "| fbgemm |" in text and "Check (passed)" in text
    assert "Load average" in text
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["check"]["ok"] and res["check"]["max_abs_diff_native_vs_fbgemm"] <= res["check"]["tolerance"]
    assert res["info"]["jaxscale-native"]["native_kernels"] is True
    assert len(res["all_step_ms"]["fbgemm"][0]) == res["config"]["steps"]


@pytest.mark.slow  # every part of the GPU check at its quick size, on CPU (~1-2 min)
def test_gpu_check_script_runs_on_cpu_in_quick_mode(tmp_path):
    out = tmp_path / "gpu_check.txt"
    env = dict(_script_env(tmp_path), GPU_CHECK_OUT=str(out))
    cmd = ["bash", str(REPO / "experiments/gpu/check.sh"), "--quick"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    text = out.read_text()
    for header in ("(a) lookup + update", "(b) summary", "(c) ragged_all_to_all", "(d) smoke train", "all parts ran"):
        assert header in text, header
    assert "WRONG" not in text
    # XLA:CPU cannot run ragged-all-to-all (jax 0.10.2): the script reports it instead of failing.
    assert "NOT SUPPORTED on cpu" in text or "correct;" in text


def test_unwritable_cache_is_a_clear_build_error(monkeypatch, tmp_path):
    if os.geteuid() == 0:
        target = tmp_path / "not-a-dir"
        target.write_text("a file where the cache directory should be")
        monkeypatch.setenv("JAXSCALE_NATIVE_CACHE", str(target / "cache"))
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        monkeypatch.setenv("JAXSCALE_NATIVE_CACHE", str(ro))
    with pytest.raises(build.BuildError, match="JAXSCALE_NATIVE_CACHE"):
        build.compile_library(build.plan_build())
