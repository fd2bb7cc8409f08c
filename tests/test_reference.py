"""jaxscale.engine.reference (the one NumPy reference of FBGEMM TBE semantics) against brute-force loops.

The loops below walk every (example, position) one at a time and apply the formulas literally; the
reference is vectorised (sort + reduceat). Random shapes, padding anywhere, empty bags, duplicate ids,
a table shared by two features, and one accumulator per column block."""

from __future__ import annotations

import numpy as np
import pytest

from jaxscale.engine import reference
from jaxscale.engine.tables import TableConfig


def _tables(dim_seq=8, dim_sum=8, dim_mean=12):
    return [
        TableConfig("shared", rows=30, dim=dim_sum, pooling="sum", features=("a", "b")),
        TableConfig("avg", rows=17, dim=dim_mean, pooling="mean"),
        TableConfig("seq", rows=25, dim=dim_seq, pooling=None, features=("s",)),
    ]


def _case(seed):
    rng = np.random.default_rng(seed)
    B, L = int(rng.integers(1, 9)), int(rng.integers(1, 7))
    configs = _tables(dim_seq=int(rng.choice([4, 8])), dim_mean=int(rng.choice([6, 12])))
    weights = {t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in configs}
    ids, grads = {}, {}
    for t in configs:
        for f in t.features:
            x = rng.integers(0, min(t.rows, 6), size=(B, L))  # few distinct ids: many duplicates
            x[rng.random((B, L)) < 0.2] = t.rows - 1
            x[rng.random((B, L)) < 0.3] = -1
            if B > 1:
                x[0] = -1  # an empty bag
            ids[f] = x.astype(np.int32)
            shape = (B, L, t.dim) if t.pooling is None else (B, t.dim)
            grads[f] = rng.normal(size=shape).astype(np.float32)
    return configs, weights, ids, grads


def _loop_lookup(weights, configs, ids):
    by_f = {f: t for t in configs for f in t.features}
    out = {}
    for f, x in ids.items():
        t, w = by_f[f], weights[by_f[f].name]
        B, L = x.shape
        if t.pooling is None:
            o = np.zeros((B, L, w.shape[1]))
            for b in range(B):
                for j in range(L):
                    if x[b, j] >= 0:
                        o[b, j] = w[x[b, j]]
        else:
            o = np.zeros((B, w.shape[1]))
            for b in range(B):
                n = 0
                for j in range(L):
                    if x[b, j] >= 0:
                        o[b] += w[x[b, j]]
                        n += 1
                if t.pooling == "mean" and n:
                    o[b] /= n
        out[f] = o
    return out


def _loop_row_grads(configs, ids, grads):
    by_f = {f: t for t in configs for f in t.features}
    acc: dict = {}
    for f, x in ids.items():
        t = by_f[f]
        for b in range(x.shape[0]):
            n = int((x[b] >= 0).sum())
            for j in range(x.shape[1]):
                r = int(x[b, j])
                if r < 0:
                    continue
                gf = grads[f].astype(np.float64)
                g = gf[b, j] if t.pooling is None else gf[b] / (n if t.pooling == "mean" else 1)
                acc.setdefault(t.name, {}).setdefault(r, 0.0)
                acc[t.name][r] = acc[t.name][r] + g
    return acc


def _loop_adagrad(weights, acc, configs, ids, grads, lr, eps, col_parts):
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    a = {k: v.astype(np.float64) for k, v in acc.items()}
    for name, rows in _loop_row_grads(configs, ids, grads).items():
        cp = col_parts.get(name, 1)
        for r, g in rows.items():
            width = len(g) // cp
            for c in range(cp):
                gb = g[c * width : (c + 1) * width]
                if cp == 1:
                    a[name][r] += np.mean(gb**2)
                    denom = np.sqrt(a[name][r]) + eps
                else:
                    a[name][r, c] += np.mean(gb**2)
                    denom = np.sqrt(a[name][r, c]) + eps
                w[name][r, c * width : (c + 1) * width] -= lr * gb / denom
    return w, a


@pytest.mark.parametrize("seed", range(6))
def test_lookup_matches_loops(seed):
    configs, weights, ids, _ = _case(seed)
    got = reference.lookup(weights, configs, ids)
    want = _loop_lookup(weights, configs, ids)
    assert set(got) == set(ids)
    for f in want:
        assert got[f].dtype == np.float32 and got[f].shape == want[f].shape
        np.testing.assert_allclose(got[f], want[f], rtol=1e-6, atol=1e-6, err_msg=f)


@pytest.mark.parametrize("seed", range(6))
def test_row_gradients_sum_duplicates_and_shared_features(seed):
    configs, weights, ids, grads = _case(seed)
    got = reference.row_gradients(weights, configs, ids, grads)
    want = _loop_row_grads(configs, ids, grads)
    assert set(got) == {t.name for t in configs}
    for name, rg in got.items():
        assert np.all(np.diff(rg.rows) > 0), "rows sorted and unique"
        assert sorted(want.get(name, {})) == rg.rows.tolist()
        for r, g in zip(rg.rows, rg.grads):
            np.testing.assert_allclose(g, want[name][int(r)], rtol=1e-12, atol=1e-12)
    # the dict form carries the same sums
    assert {k: sorted(v) for k, v in reference.row_grads(weights, configs, ids, grads).items()} == {
        k: sorted(v) for k, v in want.items()
    } | {t.name: [] for t in configs if t.name not in want}


@pytest.mark.parametrize("seed", range(4))
def test_sgd_step_matches_loops_and_leaves_inputs(seed):
    configs, weights, ids, grads = _case(seed)
    before = {k: v.copy() for k, v in weights.items()}
    got = reference.sgd_step(weights, configs, ids, grads, lr=0.3)
    for name, rows in _loop_row_grads(configs, ids, grads).items():
        want = weights[name].astype(np.float64)
        for r, g in rows.items():
            want[r] -= 0.3 * g
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-6)
    for k in weights:
        np.testing.assert_array_equal(weights[k], before[k])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("col_parts", [{}, {"shared": 2, "seq": 4}])
def test_adagrad_step_matches_loops(seed, col_parts):
    configs, weights, ids, grads = _case(seed)
    acc = reference.zero_accumulators(weights, col_parts)
    assert acc["shared"].shape == ((30, 2) if col_parts else (30,))
    w, a = weights, acc
    lw, la = weights, acc
    for step in range(3):  # the accumulator carries over steps
        w, a = reference.adagrad_step(w, a, configs, ids, grads, 0.05, 1e-3, col_parts)
        lw, la = _loop_adagrad(lw, la, configs, ids, grads, 0.05, 1e-3, col_parts)
        for name in w:
            np.testing.assert_allclose(w[name], lw[name], rtol=1e-5, atol=1e-6, err_msg=f"step {step} {name}")
            np.testing.assert_allclose(a[name], la[name], rtol=1e-5, atol=1e-7, err_msg=f"step {step} acc {name}")
            assert w[name].dtype == np.float32 and a[name].dtype == np.float32
    np.testing.assert_array_equal(acc["shared"], 0)  # inputs not modified


def test_rowwise_adagrad_by_hand():
    """One row looked up twice in one bag (sum pooling): g = 2 * G; acc = mean(g^2); w -= lr g/(sqrt(acc)+eps)."""
    t = TableConfig("t", rows=3, dim=2, pooling="sum")
    w = {"t": np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)}
    ids = {"t": np.array([[1, 1, -1]])}
    G = {"t": np.array([[0.5, -1.0]], np.float32)}
    new_w, acc = reference.adagrad_step(w, reference.zero_accumulators(w), [t], ids, G, lr=0.1, eps=0.0)
    g = np.array([1.0, -2.0])
    a = (1.0 + 4.0) / 2
    np.testing.assert_allclose(acc["t"], [0.0, a, 0.0])
    np.testing.assert_allclose(new_w["t"][1], np.array([3.0, 4.0]) - 0.1 * g / np.sqrt(a), rtol=1e-6)
    np.testing.assert_array_equal(new_w["t"][[0, 2]], w["t"][[0, 2]])  # untouched rows bit-identical
    np.testing.assert_allclose(reference.lookup(w, [t], ids)["t"], [[6.0, 8.0]])


def test_train_outputs_precede_each_update():
    configs, weights, ids, grads = _case(1)
    res = reference.train(weights, configs, [ids, ids], grads, optimizer="rowwise_adagrad", lr=0.05, eps=1e-8)
    np.testing.assert_allclose(res["outputs"][0]["a"], reference.lookup(weights, configs, ids)["a"])
    w1, a1 = reference.adagrad_step(weights, reference.zero_accumulators(weights), configs, ids, grads, 0.05, 1e-8)
    np.testing.assert_allclose(res["outputs"][1]["s"], reference.lookup(w1, configs, ids)["s"])
    w2, a2 = reference.adagrad_step(w1, a1, configs, ids, grads, 0.05, 1e-8)
    for name in w2:
        np.testing.assert_array_equal(res["tables"][name], w2[name])
        np.testing.assert_array_equal(res["accumulators"][name], a2[name])
    lookups_only = reference.train(weights, configs, [ids], None)
    for name in weights:
        np.testing.assert_array_equal(lookups_only["tables"][name], weights[name])
    assert "accumulators" not in lookups_only


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda ids, g: ids.__setitem__("a", np.array([[0, 30]])), r"feature 'a' \(table 'shared', 30 rows\): id 30"),
        (lambda ids, g: ids.__setitem__("avg", np.array([[-2, 1]])), r"feature 'avg' .*id -2 at \[0, 0\]"),
        (lambda ids, g: ids.__setitem__("nope", np.array([[0]])), r"feature 'nope' is not read by any table"),
        (lambda ids, g: ids.__setitem__("a", np.array([0, 1])), r"feature 'a': ids must be \[batch"),
        (lambda ids, g: ids.__setitem__("a", np.array([[0.5, 1.0]])), r"feature 'a': ids must be integers"),
        (lambda ids, g: g.__setitem__("s", np.zeros((1, 2, 3))), r"feature 's' \(sequence table 'seq'\): gradient"),
        (lambda ids, g: g.pop("avg"), r"no gradient for feature 'avg'"),
    ],
)
def test_bad_inputs_name_the_problem(mutate, match):
    configs = _tables()
    weights = {t.name: np.zeros((t.rows, t.dim), np.float32) for t in configs}
    ids = {"a": np.array([[0, 1]]), "avg": np.array([[1, -1]]), "s": np.array([[2, -1]])}
    grads = {"a": np.zeros((1, 8)), "avg": np.zeros((1, 12)), "s": np.zeros((1, 2, 8))}
    mutate(ids, grads)
    with pytest.raises(ValueError, match=match):
        reference.adagrad_step(weights, reference.zero_accumulators(weights), configs, ids, grads, 0.1, 1e-8)


def test_column_blocks_must_divide_the_dim():
    configs = _tables(dim_mean=12)
    weights = {t.name: np.zeros((t.rows, t.dim), np.float32) for t in configs}
    ids, grads = {"avg": np.array([[1]])}, {"avg": np.ones((1, 12))}
    acc = {"avg": np.zeros((17, 5), np.float32)}
    with pytest.raises(ValueError, match="col_parts must be a positive divisor of the dim 12, got 5"):
        reference.adagrad_step(weights, acc, configs, ids, grads, 0.1, 1e-8, {"avg": 5})
    with pytest.raises(ValueError, match=r"accumulator must be \(17, 3\)"):
        reference.adagrad_step(weights, acc, configs, ids, grads, 0.1, 1e-8, {"avg": 3})
    with pytest.raises(ValueError, match="optimizer must be one of"):
        reference.train(weights, configs, [ids], grads, optimizer="adam")
