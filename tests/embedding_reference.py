"""Plain single-device NumPy reference of lookups and FBGEMM's fused optimizers (for tests)."""

from __future__ import annotations

import numpy as np


def lookup(tables: dict, configs, ids: dict) -> dict:
    """{feature: pooled [B, dim] or sequence [B, L, dim]}, padding (-1) ignored."""
    by_feature = {f: t for t in configs for f in t.features}
    out = {}
    for f, x in ids.items():
        t = by_feature[f]
        w = tables[t.name]
        x = np.asarray(x)
        valid = x >= 0
        emb = np.where(valid[..., None], w[np.where(valid, x, 0)], 0.0).astype(np.float32)
        if t.pooling is None:
            out[f] = emb
        else:
            s = emb.sum(1)
            if t.pooling == "mean":
                s = s / np.maximum(valid.sum(-1, keepdims=True), 1)
            out[f] = s
    return out


def row_grads(tables: dict, configs, ids: dict, grads: dict) -> dict:
    """{table: {row: summed gradient}}: duplicate ids (and features sharing a table) accumulated."""
    by_feature = {f: t for t in configs for f in t.features}
    acc: dict = {t.name: {} for t in configs}
    for f, x in ids.items():
        t = by_feature[f]
        x = np.asarray(x)
        g = np.asarray(grads[f], np.float64)
        valid = x >= 0
        for b in range(x.shape[0]):
            n = max(int(valid[b].sum()), 1)
            for j in range(x.shape[1]):
                if not valid[b, j]:
                    continue
                if t.pooling is None:
                    gr = g[b, j]
                elif t.pooling == "sum":
                    gr = g[b]
                else:
                    gr = g[b] / n
                r = int(x[b, j])
                acc[t.name][r] = acc[t.name].get(r, 0.0) + gr
    return acc


def sgd_step(tables, configs, ids, grads, lr):
    out = {k: v.copy() for k, v in tables.items()}
    for name, rows in row_grads(tables, configs, ids, grads).items():
        for r, g in rows.items():
            out[name][r] -= (lr * g).astype(np.float32)
    return out


def adagrad_step(tables, accumulators, configs, ids, grads, lr, eps, col_parts=None):
    """Exact row-wise AdaGrad. `col_parts[table]` > 1 keeps one accumulator per column block (as each
    column shard of a TorchRec/FBGEMM column-wise table does); accumulators are then [rows, col_parts]."""
    out = {k: v.copy() for k, v in tables.items()}
    acc = {k: v.copy() for k, v in accumulators.items()}
    col_parts = col_parts or {}
    for name, rows in row_grads(tables, configs, ids, grads).items():
        cp = col_parts.get(name, 1)
        for r, g in rows.items():
            blocks = np.split(g, cp)
            for c, gb in enumerate(blocks):
                w = gb.shape[0]
                if cp == 1:
                    acc[name][r] += np.mean(gb * gb)
                    a = acc[name][r]
                else:
                    acc[name][r, c] += np.mean(gb * gb)
                    a = acc[name][r, c]
                out[name][r, c * w : (c + 1) * w] -= (lr * gb / (np.sqrt(a) + eps)).astype(np.float32)
    return out, acc
