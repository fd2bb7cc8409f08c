"""Input data: synthetic generators with a learnable signal, a Parquet reader, and host -> global arrays.

Every source yields *this process's* slice of the global batch as a dict of numpy arrays; `to_global`
assembles the slices into arrays sharded over every device.

Synthetic data is counter-based: every random number is a hash of (seed, split, step, example index,
position, purpose), so any process can produce its rows of any step without coordination, the slices of
`process_count` processes concatenate to exactly the one-process batch, and a restarted run replays the
same stream. The eval split uses another split id (a disjoint stream of users) over the same item world.

Foundation batch keys (int32 unless noted, [B, L], right-padded):
  item_ids    raw item ids in [0, cfg.vocab), -1 = padding
  timestamps  unix seconds, -1 = padding
  actions     0 = not engaged, 1..num_actions-1 = engagement types, -1 = padding
  surfaces    [0, num_surfaces), -1 = padding
  engaged     float32 0/1 label, 0 on padding
  mask        bool, item_ids >= 0
DLRM batch keys: dense float32 [B, num_dense]; sparse_i int32 [B, hotness_i] (-1 padded); label float32 [B].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

SPLITS = {"train": 0, "eval": 1}

# Purpose tags: each independent random quantity hashes its own tag.
_T_USER, _T_LEN, _T_LEN2, _T_TASTE, _T_HOME, _T_MOVE, _T_JUMP, _T_ITEM, _T_SURF, _T_ENG, _T_ACT = range(1, 12)
_T_START, _T_GAP, _T_GAP2, _T_ITASTE, _T_IQUAL = range(12, 17)
_T_DENSE, _T_DENSE2, _T_HOT, _T_SPARSE, _T_VALUE, _T_LABEL, _T_DW = range(17, 24)

_G = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (a bijection on uint64 with full avalanche)."""
    x = x + _G
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def hash64(*parts) -> np.ndarray:
    """Hash of broadcast integer arrays/scalars -> uint64 array (counter-based randomness)."""
    with np.errstate(over="ignore"):
        h = np.zeros((), np.uint64)
        for p in parts:
            h = _mix(h ^ np.asarray(p).astype(np.int64).astype(np.uint64))
        return np.asarray(h)


def uniform(*parts) -> np.ndarray:
    """Uniform float64 in (0, 1) from a hash."""
    return ((hash64(*parts) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def normal(*parts) -> np.ndarray:
    """Standard normal (Box-Muller); the second uniform hashes the first one's parts plus a salt."""
    u1, u2 = uniform(*parts, 1), uniform(*parts, 2)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


class ZipfSampler:
    """Bounded Zipf over ranks [0, n): P(k) proportional to (k + 1) ** -exponent, via inverse CDF.

    The head (the first `head` ranks, where the discreteness matters) is an exact table; the tail uses
    the continuous power-law inverse CDF with a half-rank correction. Memory is O(head), so n may be
    1e9; sampling is two vectorised numpy passes.
    """

    def __init__(self, n: int, exponent: float = 1.1, head: int = 1 << 16):
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"ZipfSampler: n must be a positive integer, got {n!r}")
        if not (isinstance(exponent, (int, float)) and exponent >= 0 and math.isfinite(exponent)):
            raise ValueError(f"ZipfSampler: exponent must be a finite number >= 0, got {exponent!r}")
        self.n, self.s = int(n), float(exponent)
        h = min(self.n, head)
        w = np.arange(1, h + 1, dtype=np.float64) ** -self.s
        self.head = h
        self.head_cdf = np.cumsum(w) / w.sum()
        self.a, self.b = h + 0.5, self.n + 0.5
        tail = self._integral(self.a, self.b) if self.n > h else 0.0
        self.p_head = float(w.sum() / (w.sum() + tail))

    def _integral(self, a, b):
        if abs(self.s - 1.0) < 1e-12:
            return math.log(b / a)
        return (b ** (1 - self.s) - a ** (1 - self.s)) / (1 - self.s)

    def __call__(self, u: np.ndarray) -> np.ndarray:
        """Ranks (int64) for uniforms u in (0, 1)."""
        u = np.asarray(u, np.float64)
        in_head = u < self.p_head
        k_head = np.searchsorted(self.head_cdf, np.minimum(u / self.p_head, 1.0), side="right")
        if self.n == self.head:
            return np.minimum(k_head, self.n - 1).astype(np.int64)
        v = np.clip((u - self.p_head) / (1.0 - self.p_head), 0.0, 1.0)
        if abs(self.s - 1.0) < 1e-12:
            x = self.a * np.exp(v * math.log(self.b / self.a))
        else:
            e = 1.0 - self.s
            x = (self.a**e + v * (self.b**e - self.a**e)) ** (1.0 / e)
        k_tail = np.clip(np.floor(x + 0.5), self.head + 1, self.n) - 1
        return np.where(in_head, np.minimum(k_head, self.head - 1), k_tail).astype(np.int64)

    def pmf(self, k: np.ndarray) -> np.ndarray:
        """Approximate probability of ranks k (exact in the head)."""
        k = np.asarray(k)
        total = (np.arange(1, self.head + 1, dtype=np.float64) ** -self.s).sum() / self.p_head
        return (k + 1.0) ** -self.s / total


def _coprime_multiplier(n: int) -> int:
    for a in (2654435761, 2246822519, 3266489917, 668265263, 374761393, 1000003):
        a %= max(n, 1)
        if a > 0 and math.gcd(a, n) == 1:
            return a
    return 1


def _slice(global_batch: int, process_index: int, process_count: int) -> np.ndarray:
    """Global example indices of this process's rows."""
    if not isinstance(process_count, (int, np.integer)) or process_count < 1:
        raise ValueError(f"process_count must be a positive integer, got {process_count!r}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be in [0, {process_count}), got {process_index!r}")
    if global_batch % process_count:
        raise ValueError(f"global batch {global_batch} is not divisible by process_count={process_count}")
    b = global_batch // process_count
    return np.arange(process_index * b, (process_index + 1) * b, dtype=np.int64)


def _check_batch(global_batch) -> int:
    if not isinstance(global_batch, (int, np.integer)) or isinstance(global_batch, bool) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
    return int(global_batch)


def _check_split(split) -> int:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {tuple(SPLITS)}, got {split!r}")
    return SPLITS[split]


@dataclasses.dataclass(frozen=True)
class Column:
    """How a batch key is stored in Parquet.

    kind: 'seq' (variable-length list; its length is the count of entries of `length_key` >= 0),
    'fixed' (fixed-size list), 'scalar', or 'derived' (not stored; `mask` is item_ids >= 0).
    """

    kind: str
    pad: float | int = -1
    length_key: str | None = None


class SyntheticFoundationData:
    """User activity sequences with a hidden structure the foundation model can learn.

    The item world (fixed by `seed`): item ids are grouped into `num_clusters` hidden clusters; clusters
    and items have hidden taste signs, items a hidden quality. A user has a home cluster and a taste sign;
    each next event stays in the current cluster (p_stay), moves to the cluster's hidden successor
    (p_next) or jumps at random. Within a cluster items are Zipf-popular. Engagement is
    Bernoulli(sigmoid(user taste x (cluster taste + item taste) + item quality + surface bias)), so it is
    predictable from the next item and from the user's past actions (which reveal the user's taste).
    Sequence lengths are lognormal (median `median_len_frac` * max_seq_len), truncated to
    [min_len, max_seq_len].

    With `scramble=False` the hottest items are the lowest ids (worst case for contiguous row sharding);
    `scramble=True` maps ids through a bijection of [0, vocab) so hot ids are spread.
    """

    columns = {
        "item_ids": Column("seq", -1, "item_ids"),
        "timestamps": Column("seq", -1, "item_ids"),
        "actions": Column("seq", -1, "item_ids"),
        "surfaces": Column("seq", -1, "item_ids"),
        "engaged": Column("seq", 0.0, "item_ids"),
        "mask": Column("derived", False),
    }

    def __init__(
        self,
        cfg,
        global_batch: int,
        seed: int = 0,
        *,
        split: str = "train",
        zipf_exponent: float = 1.1,
        num_clusters: int = 32,
        p_stay: float = 0.7,
        p_next: float = 0.2,
        median_len_frac: float = 0.5,
        len_sigma: float = 0.6,
        min_len: int = 2,
        scramble: bool = False,
    ):
        self.cfg = cfg
        self.global_batch = _check_batch(global_batch)
        self.seed, self.split, self.split_id = int(seed), split, _check_split(split)
        self.zipf_exponent = zipf_exponent
        vocab = cfg.vocab
        if not (isinstance(num_clusters, int) and 1 <= num_clusters <= vocab):
            raise ValueError(f"num_clusters must be an integer in [1, vocab={vocab}], got {num_clusters!r}")
        if not (0 <= p_stay and 0 <= p_next and p_stay + p_next <= 1):
            raise ValueError(f"need p_stay, p_next >= 0 and p_stay + p_next <= 1, got {p_stay}, {p_next}")
        if not (0 < median_len_frac <= 1 and len_sigma >= 0):
            raise ValueError(f"need 0 < median_len_frac <= 1 and len_sigma >= 0, got {median_len_frac}, {len_sigma}")
        if not (isinstance(min_len, int) and 1 <= min_len <= cfg.max_seq_len):
            raise ValueError(f"min_len must be an integer in [1, max_seq_len={cfg.max_seq_len}], got {min_len!r}")
        self.num_clusters, self.p_stay, self.p_next = num_clusters, p_stay, p_next
        self.median_len_frac, self.len_sigma, self.min_len = median_len_frac, len_sigma, min_len
        self.scramble = scramble
        self.per_cluster = vocab // num_clusters
        self.zipf = ZipfSampler(self.per_cluster, zipf_exponent)
        world = np.random.default_rng([self.seed, 7])
        self.successor = world.permutation(num_clusters)
        self.cluster_taste = np.where(world.random(num_clusters) < 0.5, 1.0, -1.0)
        self.multiplier = _coprime_multiplier(vocab)
        self.offset = int(hash64(self.seed, 99) % np.uint64(vocab))
        self.surface_probs = 0.5 ** np.arange(cfg.num_surfaces)
        self.surface_probs /= self.surface_probs.sum()
        self.surface_bias = np.linspace(0.5, -0.5, cfg.num_surfaces) if cfg.num_surfaces > 1 else np.zeros(1)

    def held_out(self) -> SyntheticFoundationData:
        """The eval split: the same item world, a disjoint stream of users."""
        return self._with_split("eval")

    def _with_split(self, split):
        return SyntheticFoundationData(
            self.cfg,
            self.global_batch,
            self.seed,
            split=split,
            zipf_exponent=self.zipf_exponent,
            num_clusters=self.num_clusters,
            p_stay=self.p_stay,
            p_next=self.p_next,
            median_len_frac=self.median_len_frac,
            len_sigma=self.len_sigma,
            min_len=self.min_len,
            scramble=self.scramble,
        )

    def item_id(self, cluster: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """The raw id of the `rank`-th most popular item of `cluster`."""
        base = rank * self.num_clusters + cluster
        if self.scramble:
            base = (base * self.multiplier + self.offset) % self.cfg.vocab
        return base

    def item_taste(self, ids):
        return np.where(hash64(self.seed, _T_ITASTE, ids) & np.uint64(1), 1.0, -1.0)

    def item_quality(self, ids):
        return uniform(self.seed, _T_IQUAL, ids) - 0.5

    def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        cfg, L, C = self.cfg, self.cfg.max_seq_len, self.num_clusters
        gi = _slice(self.global_batch, process_index, process_count)
        user = hash64(self.seed, self.split_id, _T_USER, step, gi)[:, None]  # [b, 1]
        t = np.arange(L)[None, :]
        median = max(self.min_len, self.median_len_frac * L)
        length = np.clip(
            np.round(median * np.exp(self.len_sigma * normal(user[:, 0], _T_LEN))), self.min_len, L
        ).astype(np.int64)
        mask = t < length[:, None]

        # Cluster walk: the only sequential part; everything random is precomputed as [b, L].
        move = uniform(user, t, _T_MOVE)
        jump = (hash64(user, t, _T_JUMP) % np.uint64(C)).astype(np.int64)
        cluster = np.empty(move.shape, np.int64)
        cluster[:, 0] = (hash64(user[:, 0], _T_HOME) % np.uint64(C)).astype(np.int64)
        for i in range(1, L):
            prev = cluster[:, i - 1]
            cluster[:, i] = np.where(
                move[:, i] < self.p_stay,
                prev,
                np.where(move[:, i] < self.p_stay + self.p_next, self.successor[prev], jump[:, i]),
            )
        ids = self.item_id(cluster, self.zipf(uniform(user, t, _T_ITEM)))

        surf = np.searchsorted(np.cumsum(self.surface_probs)[:-1], uniform(user, t, _T_SURF), side="right")
        taste = np.where(hash64(user, _T_TASTE) & np.uint64(1), 1.0, -1.0)
        logit = (
            2.0 * taste * self.cluster_taste[cluster]
            + 0.5 * taste * self.item_taste(ids)
            + 2.0 * self.item_quality(ids)
            + self.surface_bias[surf]
            - 0.2
        )
        engaged = uniform(user, t, _T_ENG) < 1.0 / (1.0 + np.exp(-logit))
        kinds = max(cfg.num_actions - 1, 1)
        actions = np.where(engaged, 1 + np.floor(uniform(user, t, _T_ACT) * kinds), 0).astype(np.int64)
        actions = np.minimum(actions, cfg.num_actions - 1)

        # Gaps: lognormal seconds, longer after an engaged event; kept so timestamps fit int32.
        gap_max = max(1.0, min(1e6, (2**31 - 1 - 1.75e9) / L))
        prev_eng = np.concatenate([np.zeros_like(engaged[:, :1]), engaged[:, :-1]], axis=1)
        gap = np.clip(np.exp(4.0 + 1.0 * prev_eng + 1.5 * normal(user, t, _T_GAP)), 1.0, gap_max)
        gap[:, 0] = 0.0
        start = 1.6e9 + np.floor(uniform(user[:, 0], _T_START) * 1.5e8)
        ts = (start[:, None] + np.cumsum(np.floor(gap), axis=1)).astype(np.int64)

        def pad(x, v):
            return np.where(mask, x, v)

        return {
            "item_ids": pad(ids, -1).astype(np.int32),
            "timestamps": pad(ts, -1).astype(np.int32),
            "actions": pad(actions, -1).astype(np.int32),
            "surfaces": pad(surf, -1).astype(np.int32),
            "engaged": pad(engaged, 0).astype(np.float32),
            "mask": mask,
        }


class SyntheticDLRMData:
    """Click logs with a learnable label: each (feature, id) has a hidden value in [-1, 1]; the label is
    Bernoulli(sigmoid(sum of per-feature pooled values + a feature-0 x feature-1 interaction + a hidden
    linear function of log dense counts)). Ids are Zipf per table; each example has 1..hotness ids per
    feature (right-padded with -1). Dense features are lognormal counts."""

    def __init__(
        self,
        cfg,
        global_batch: int,
        seed: int = 0,
        *,
        split: str = "train",
        zipf_exponent: float = 1.1,
        scramble: bool = False,
    ):
        self.cfg = cfg
        self.global_batch = _check_batch(global_batch)
        self.seed, self.split, self.split_id = int(seed), split, _check_split(split)
        self.zipf_exponent, self.scramble = zipf_exponent, scramble
        self.rows, self.hot = cfg.table_rows(), cfg.hotness()
        self.names = tuple(f"sparse_{i}" for i in range(cfg.num_sparse_features))
        self.samplers = [ZipfSampler(r, zipf_exponent) for r in self.rows]
        self.multipliers = [_coprime_multiplier(r) for r in self.rows]
        self.dense_mu = 1.0 + 2.0 * uniform(self.seed, _T_DW, np.arange(cfg.num_dense), 0)
        self.dense_w = 0.6 * (2.0 * uniform(self.seed, _T_DW, np.arange(cfg.num_dense), 1) - 1.0)
        self.columns = {
            "dense": Column("fixed", 0.0),
            "label": Column("scalar", 0.0),
            **{n: Column("seq", -1, n) for n in self.names},
        }

    def held_out(self) -> SyntheticDLRMData:
        return SyntheticDLRMData(
            self.cfg,
            self.global_batch,
            self.seed,
            split="eval",
            zipf_exponent=self.zipf_exponent,
            scramble=self.scramble,
        )

    def value(self, feature: int, ids):
        return 2.0 * uniform(self.seed, _T_VALUE, feature, ids) - 1.0

    def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        cfg = self.cfg
        gi = _slice(self.global_batch, process_index, process_count)
        ex = hash64(self.seed, self.split_id, step, gi)[:, None]  # [b, 1]
        j = np.arange(cfg.num_dense)[None]
        log_dense = self.dense_mu + normal(ex, _T_DENSE, j)
        dense = np.floor(np.exp(log_dense)).astype(np.float32)
        logit = (np.log1p(dense) - self.dense_mu - 0.5) @ self.dense_w - 0.5
        out = {"dense": dense}
        pooled = []
        for f, (name, rows, hot) in enumerate(zip(self.names, self.rows, self.hot)):
            k = np.arange(hot)[None]
            count = 1 + np.floor(uniform(ex[:, 0], _T_HOT, f) * hot).astype(np.int64)
            ids = self.samplers[f](uniform(ex, _T_SPARSE, f, k))
            if self.scramble:
                ids = (ids * self.multipliers[f] + f) % rows
            valid = k < count[:, None]
            out[name] = np.where(valid, ids, -1).astype(np.int32)
            pooled.append((self.value(f, ids) * valid).sum(1) / count)
            logit = logit + 1.5 * pooled[-1]
        if len(pooled) > 1:
            logit = logit + 2.0 * pooled[0] * pooled[1]
        out["label"] = (uniform(ex[:, 0], _T_LABEL) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return out


def to_global(batch_local: Mapping[str, np.ndarray], mesh) -> dict:
    """This process's rows -> global jax.Arrays sharded on axis 0 over ('node', 'local').

    Every process must pass the same number of rows; the global batch is rows * process_count.
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxscale.mesh import BATCH_AXES

    sharding = NamedSharding(mesh, P(BATCH_AXES))
    n = jax.process_count()
    out = {}
    for k, v in batch_local.items():
        v = np.asarray(v)
        global_shape = (v.shape[0] * n,) + v.shape[1:]
        if global_shape[0] % mesh.size:
            raise ValueError(
                f"to_global: {k!r} has {global_shape[0]} global rows, not divisible by "
                f"the {mesh.size} devices of the mesh"
            )
        out[k] = jax.make_array_from_process_local_data(sharding, v, global_shape)
    return out


# ---------------------------------------------------------------------------------------------- Parquet


def write_parquet_sample(path, data, n: int, *, row_group_size: int = 64, first_step: int = 0) -> Path:
    """Writes `n` examples of a synthetic generator to Parquet, one row per example.

    'seq' keys become variable-length lists (padding stripped), 'fixed' keys fixed-size lists, 'scalar'
    keys plain columns; 'derived' keys (mask) are not stored. Returns the path.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    batches, have, step = [], 0, first_step
    while have < n:
        batches.append(data.batch(step))
        have += data.global_batch
        step += 1
    full = {k: np.concatenate([b[k] for b in batches])[:n] for k in batches[0]}
    arrays, names = [], []
    for key, col in data.columns.items():
        x = full[key]
        if col.kind == "derived":
            continue
        if col.kind == "scalar":
            arr = pa.array(x)
        elif col.kind == "fixed":
            arr = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])
        elif col.kind == "seq":
            lengths = (full[col.length_key] >= 0).sum(axis=1)
            keep = np.arange(x.shape[1])[None, :] < lengths[:, None]
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(x[keep]))
        else:
            raise ValueError(f"unknown column kind {col.kind!r} for {key!r}")
        arrays.append(arr)
        names.append(key)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_arrays(arrays, names=names), path, row_group_size=row_group_size)
    return path


class ParquetData:
    """Reads examples from a Parquet file (one row per example), this process's row groups only.

    Process p reads row groups i with i % process_count == p, and only the requested `columns`.
    Variable-length list columns are right-padded / truncated to `seq_len` (an int, or {column: int});
    truncation keeps the last entries (`keep='last'`: the most recent events) or the first. 'mask' is
    derived as item_ids >= 0 when requested and not stored. `batch(step)` returns rows
    [step * batch_size, (step + 1) * batch_size) of this process's rows, wrapping around (epochs);
    iterating yields one epoch of full batches. Keys match the synthetic generators.
    """

    def __init__(
        self,
        path,
        columns: Sequence[str],
        *,
        batch_size: int,
        seq_len: int | Mapping[str, int] | None = None,
        process_index: int = 0,
        process_count: int = 1,
        pad_values: Mapping[str, float] | None = None,
        keep: str = "last",
    ):
        import pyarrow.parquet as pq

        self.path = Path(path)
        self.file = pq.ParquetFile(self.path)
        stored = set(self.file.schema_arrow.names)
        self.columns = tuple(columns)
        if not self.columns:
            raise ValueError("ParquetData: columns must name at least one column")
        self.derive_mask = "mask" in self.columns and "mask" not in stored
        read = [c for c in self.columns if not (c == "mask" and self.derive_mask)]
        if self.derive_mask and "item_ids" not in read:
            read.append("item_ids")
        missing = [c for c in read if c not in stored]
        if missing:
            raise ValueError(f"ParquetData: columns {missing} are not in {self.path} (has {sorted(stored)})")
        self.read_columns = tuple(read)
        if keep not in ("last", "first"):
            raise ValueError(f"ParquetData: keep must be 'last' or 'first', got {keep!r}")
        self.keep, self.seq_len, self.pad_values = keep, seq_len, dict(pad_values or {})
        self.batch_size = _check_batch(batch_size)
        _slice(process_count, process_index, process_count)  # validates the pair
        self.row_groups = [i for i in range(self.file.num_row_groups) if i % process_count == process_index]
        sizes = [self.file.metadata.row_group(i).num_rows for i in self.row_groups]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_rows = int(self.starts[-1])
        if self.num_rows == 0:
            raise ValueError(
                f"ParquetData: process {process_index} of {process_count} has no rows in {self.path} "
                f"({self.file.num_row_groups} row groups)"
            )
        self._cache: dict[int, dict[str, np.ndarray]] = {}

    def _length(self, column: str) -> int:
        if isinstance(self.seq_len, Mapping):
            if column not in self.seq_len:
                raise ValueError(f"ParquetData: no seq_len given for list column {column!r}")
            return int(self.seq_len[column])
        if self.seq_len is None:
            raise ValueError(f"ParquetData: list column {column!r} needs seq_len")
        return int(self.seq_len)

    def _group(self, j: int) -> dict[str, np.ndarray]:
        """Row group self.row_groups[j] as padded numpy arrays (a 2-entry cache)."""
        import pyarrow as pa

        if j in self._cache:
            return self._cache[j]
        table = self.file.read_row_group(self.row_groups[j], columns=list(self.read_columns))
        out = {}
        for name in self.read_columns:
            arr = table.column(name).combine_chunks()
            if pa.types.is_fixed_size_list(arr.type):
                out[name] = arr.values.to_numpy(zero_copy_only=False).reshape(len(arr), arr.type.list_size)
            elif pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
                out[name] = self._pad(name, arr)
            else:
                out[name] = arr.to_numpy(zero_copy_only=False)
        if self.derive_mask:
            out["mask"] = out["item_ids"] >= 0
        out = {k: out[k] for k in self.columns}
        if len(self._cache) >= 2:
            self._cache.pop(next(iter(self._cache)))
        self._cache[j] = out
        return out

    def _pad(self, name, arr) -> np.ndarray:
        L = self._length(name)
        values = arr.flatten().to_numpy(zero_copy_only=False)
        offsets = arr.offsets.to_numpy() - arr.offsets[0].as_py()
        lengths = np.diff(offsets)
        take = np.minimum(lengths, L)
        first = offsets[:-1] + (lengths - take if self.keep == "last" else 0)
        pos = np.arange(L)[None, :]
        valid = pos < take[:, None]
        src = np.where(valid, first[:, None] + pos, 0)
        pad = self.pad_values.get(name, 0.0 if np.issubdtype(values.dtype, np.floating) else -1)
        gathered = values[src] if values.size else np.zeros(src.shape, values.dtype)
        return np.where(valid, gathered, np.asarray(pad, values.dtype)).astype(values.dtype)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rows = (step * self.batch_size + np.arange(self.batch_size)) % self.num_rows
        groups = np.searchsorted(self.starts, rows, side="right") - 1
        parts = {k: [] for k in self.columns}
        for j in np.unique(groups):  # rows are consecutive, so each group's rows form one run
            data = self._group(int(j))
            sel = rows[groups == j] - self.starts[j]
            for k in self.columns:
                parts[k].append(data[k][sel])
        order = np.argsort(np.concatenate([np.flatnonzero(groups == j) for j in np.unique(groups)]), kind="stable")
        return {k: np.concatenate(v)[order] for k, v in parts.items()}

    def __len__(self) -> int:
        """Full batches in one epoch of this process's rows."""
        return self.num_rows // self.batch_size

    def __iter__(self):
        for step in range(len(self)):
            yield self.batch(step)


class _Bound:
    """A synthetic generator bound to one process: `batch(step)` -> this process's slice."""

    def __init__(self, source, process_index: int, process_count: int):
        _slice(source.global_batch, process_index, process_count)
        self.source, self.process_index, self.process_count = source, process_index, process_count

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self.source.batch(step, self.process_index, self.process_count)


def make_data(config, *, split: str = "train", process_index: int = 0, process_count: int = 1):
    """The data source a `jaxscale.config.Config` describes, bound to this process: `.batch(step)` returns
    this process's rows (config.train.batch_size // process_count of them) of step `step`.

    Synthetic: the eval split is the held-out stream. Parquet: data.path (train) or data.eval_path (eval);
    returns None for an eval split without eval_path.
    """
    _check_split(split)
    model, data = config.model, config.data
    mcfg = model.foundation if model.kind == "foundation" else model.dlrm
    if data.source == "synthetic":
        if model.kind == "foundation":
            source = SyntheticFoundationData(
                mcfg,
                config.train.batch_size,
                data.seed,
                split=split,
                zipf_exponent=data.zipf_exponent,
                num_clusters=data.num_clusters,
                scramble=data.scramble_ids,
            )
        else:
            source = SyntheticDLRMData(
                mcfg,
                config.train.batch_size,
                data.seed,
                split=split,
                zipf_exponent=data.zipf_exponent,
                scramble=data.scramble_ids,
            )
        return _Bound(source, process_index, process_count)
    path = data.path if split == "train" else data.eval_path
    if path is None:
        return None
    if config.train.batch_size % process_count:
        raise ValueError(f"train.batch_size={config.train.batch_size} is not divisible by {process_count} processes")
    if model.kind == "foundation":
        columns = list(SyntheticFoundationData.columns)
        seq_len: int | dict = mcfg.max_seq_len
    else:
        names = [f"sparse_{i}" for i in range(mcfg.num_sparse_features)]
        columns = ["dense", "label", *names]
        seq_len = dict(zip(names, mcfg.hotness()))
    return ParquetData(
        path,
        columns,
        batch_size=config.train.batch_size // process_count,
        seq_len=seq_len,
        process_index=process_index,
        process_count=process_count,
    )
