"""Alpha-beta model of one weak-scaling training step: exact bytes per collective + published link figures.

Bytes. `step_bytes(shape, nodes, local)` gives, per collective category (see jaxscale.comm_report), the
bytes one device sends per step, split intra-node / inter-node, as closed-form functions of the model
and mesh. They are derived from the engine's static shapes (padded all-to-all with capacity C per
destination) and checked to be EXACTLY equal to the compiled HLO of small configs on the 2x4 and 4x2
CPU meshes (run_ablation.py, tests/test_scaling_model.py). With S = shard-group size, Rep = replicas,
G = nodes x local, T item tables, n = B x L ids per table per device, w = communicated dim:
  C            = T x min(ceil(f n / S), ceil(rows / S), n)      slots per destination (f = capacity_factor)
  emb_ids      = (S-1) C 4                     one int32 all-to-all (XLA CSEs the lookup's and update's)
  emb_rows     = (S-1) C (wire_fwd + wire_bwd)  wire: fp32 4w, bf16/fp16 2w, fp8 w+4 (per-row scale)
  replica_sync = (Rep-1) S C (4 + wire_bwd)    exact sync: all_gather of the received rows + gradients
  dense_grad   = 2 (G-1)/G x 4 (P + K E)       ring all-reduce of the P fp32 dense parameters, into which
                                               XLA combines the backward of the negative pool's all-reduce
  model_gather = 2 (G-1)/G x 4 (K E + 1)       the strided pool of K = max_negatives in-batch negatives
                                               (E-dim item vectors) is built by a masked all-reduce
  (with max_negatives = 0 GSPMD instead all-gathers every next item: (G-1)/G x M (4 + 1 + 4E), M = G B (L-1);
  the residual the cross-check shows in dense_grad is 3 fp32 scalars XLA also combines into it)
An all-to-all's bytes go R/G to each peer, so the inter-node part is the share of peers on other nodes:
1d: (N-1)l/(Nl-1) of the bytes; 2d_ar: all (one shard per node); 2d_a2a: none. Ring collectives over
groups spanning k nodes with m members each are split hierarchically (intra 2(m-1)/m R, inter
2(k-1)/k R/m for an all-reduce; intra (m-1)/m R, inter (k-1)/k R/m for an all-gather).

Time. Per collective t = alpha + intra/B_intra + inter/B_inter (the intra and inter phases of a
hierarchical collective run one after the other; conservative for an all-to-all, whose NVLink and NIC
traffic could overlap). Embedding all-to-alls (and the exact replica sync, which needs the backward
all-to-all's output) sit on the critical path; the dense all-reduce overlaps the backward pass (DDP
buckets): exposed = max(0, t_dense - overlap x compute). The step time is compute + exposed comm, and
the slowest device sets the all-to-all time: embedding all-to-all time is multiplied by the layout's
load imbalance (max/mean bytes a shard serves, from the planner's cost model).
Weak-scaling speedup at N nodes = N x T(1 node) / T(N nodes) (throughput relative to one node).

Every link figure is a published number (see LINKS / PARAMS docs); nothing is fitted to the target
table.
"""

from __future__ import annotations

import dataclasses
import math

WIRE_BYTES = {"fp32": lambda w: 4 * w, "bf16": lambda w: 2 * w, "fp16": lambda w: 2 * w, "fp8": lambda w: w + 4}

# -------------------------------------------------------------------------------------------- links

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Links:
    """Link figures, bytes/s per direction, per GPU.

    intra_bw: NVLink 4 on H100 SXM: 900 GB/s total bidirectional = 450 GB/s per direction (NVIDIA H100
      Tensor Core GPU datasheet / Hopper architecture whitepaper, 2022).
    inter_bw_per_node: the node's NIC line rate, shared by its GPUs (bytes/s per direction):
      100 Gbps  = one 100 GbE / EDR-class NIC per node (12.5 GB/s);
      400 Gbps  = one ConnectX-7 NDR 400G per node, or AWS p4d's 400 Gbps EFA (50 GB/s);
      3200 Gbps = 8 x 400G per node: DGX H100 (8 ConnectX-7 NDR) or AWS p5 (3200 Gbps EFAv2) (400 GB/s).
    alpha_intra / alpha_inter: per-message start-up latency; NCCL's small-message latencies are a few us
      over NVLink and ~5-10 us over InfiniBand/EFA (nccl-tests); 5 us and 10 us are assumed round values.
      They matter only for tiny messages.
    efficiency: achievable fraction of line rate (1.0 = line rate: optimistic; nccl-tests bus bandwidth
      typically reaches ~0.8-0.9 of it). Kept at 1.0, not fitted.
    """

    name: str
    intra_bw: float = 450 * GB
    inter_bw_per_node: float = 400 * GB
    alpha_intra: float = 5e-6
    alpha_inter: float = 10e-6
    efficiency: float = 1.0

    def inter_bw(self, local: int) -> float:
        return self.inter_bw_per_node * self.efficiency / local


FABRICS = {
    "100 Gbps/node": Links("100 Gbps/node", inter_bw_per_node=100e9 / 8),
    "400 Gbps/node": Links("400 Gbps/node", inter_bw_per_node=400e9 / 8),
    "3200 Gbps/node": Links("3200 Gbps/node", inter_bw_per_node=3200e9 / 8),
}

# ---------------------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the bytes depend on (per device): the embedding workload and the dense model.

    batch: sequences per device; seq_len: events per sequence; tables: item tables (each looked up once
    per event); dim: item_dim (communicated dim is dim/2 under half_dim); rows: rows per table;
    capacity_factor: f of the padded all-to-all; dense_params: P (fp32 gradients all-reduced);
    item_out_dim: E, the dim of the combined item vector; max_negatives: the in-batch negative pool
    (0 = every next item of the global batch).
    """

    batch: int
    seq_len: int
    tables: int
    dim: int
    rows: int
    capacity_factor: float | None
    dense_params: int
    item_out_dim: int
    max_negatives: int = 0


def shard_group(topology: str, nodes: int, local: int) -> tuple[int, int]:
    """(S shards, Rep replicas)."""
    return {"1d": (nodes * local, 1), "2d_ar": (nodes, local), "2d_a2a": (local, nodes)}[topology]


def capacity(shape: Shape, S: int, half_dim: bool) -> int:
    """Slots per destination of the padded all-to-all (EmbeddingCollection._capacity, row_wise tables)."""
    rows = shape.rows * (2 if half_dim else 1)
    n = shape.batch * shape.seq_len
    if S == 1:
        per_table = min(rows, n)
    else:
        bound = math.ceil(shape.capacity_factor * n / S) if shape.capacity_factor is not None else n
        per_table = min(bound, math.ceil(rows / S), n)
    stack_rows = shape.tables * math.ceil(rows / S)
    return max(1, min(shape.tables * per_table, stack_rows * S))


def negatives_pool(shape: Shape, devices: int) -> int:
    """Rows of the gathered negative pool: every next item of the global batch (see notes in RESULTS.md)."""
    return devices * shape.batch * (shape.seq_len - 1)


def step_bytes(
    shape: Shape, nodes: int, local: int, topology: str, fwd: str, bwd: str, half_dim: bool, replica_sync: str = "exact"
) -> dict[str, tuple[float, float]]:
    """{category: (intra-node, inter-node) bytes one device sends per step}."""
    S, rep = shard_group(topology, nodes, local)
    G = nodes * local
    w = shape.dim // 2 if half_dim else shape.dim
    C = capacity(shape, S, half_dim)
    wf, wb = WIRE_BYTES[fwd](w), WIRE_BYTES[bwd](w)

    def a2a_split(total: float) -> tuple[float, float]:
        if S <= 1:
            return 0.0, 0.0
        remote = {"1d": S - local, "2d_ar": S - 1, "2d_a2a": 0}[topology]
        inter = total * remote / (S - 1)
        return total - inter, inter

    def ring_split(kind: str, R: float, k: int, m: int) -> tuple[float, float]:
        g = k * m
        if g <= 1:
            return 0.0, 0.0
        total = (2 if kind == "all-reduce" else 1) * (g - 1) / g * R
        if k == 1:
            return total, 0.0
        inter = (2 if kind == "all-reduce" else 1) * (k - 1) / k * R / m
        return total - inter, inter

    out = {
        "emb_ids": a2a_split((S - 1) * C * 4),
        "emb_rows": a2a_split((S - 1) * C * (wf + wb)),
    }
    if rep > 1 and replica_sync == "exact":
        k, m = (1, rep) if topology == "2d_ar" else (rep, 1)
        out["replica_sync"] = ring_split("all-gather", rep * S * C * (4 + wb), k, m)
    else:
        out["replica_sync"] = (0.0, 0.0)
    out["dense_grad"] = ring_split("all-reduce", 4 * shape.dense_params, nodes, local)
    K, E = shape.max_negatives, shape.item_out_dim
    if K > 0:  # the strided negative pool is formed by a masked all-reduce of [K, E] (+ one combined scalar)
        out["model_gather"] = ring_split("all-reduce", 4 * (K * E + 1), nodes, local)
        # ... and its backward all-reduce of [K, E] is combined into the gradient all-reduce
        out["dense_grad"] = ring_split("all-reduce", 4 * (shape.dense_params + K * E), nodes, local)
    else:  # GSPMD all-gathers every next item's id (s32), mask (pred) and vector (f32[E])
        M = negatives_pool(shape, G)
        out["model_gather"] = ring_split("all-gather", M * (4 + 1 + 4 * E), nodes, local)
    return out


# ------------------------------------------------------------------------------------------ time

EMBEDDING_CATEGORIES = ("emb_ids", "emb_rows")


def collective_time(intra: float, inter: float, links: Links, local: int, alpha_msgs: tuple[int, int]) -> float:
    if intra == 0 and inter == 0:
        return 0.0
    a_i, a_x = alpha_msgs
    a_i, a_x = (a_i if intra > 0 else 0), (a_x if inter > 0 else 0)  # no bytes on a link class, no messages
    return a_i * links.alpha_intra + a_x * links.alpha_inter + intra / links.intra_bw + inter / links.inter_bw(local)


def step_time(
    bytes_: dict,
    compute_s: float,
    links: Links,
    nodes: int,
    local: int,
    *,
    imbalance: float = 1.0,
    overlap: float = 2 / 3,
) -> dict:
    """Step-time breakdown (seconds). `imbalance` scales the embedding all-to-all time; `overlap` is the
    fraction of compute (the backward pass) the dense all-reduce can hide behind."""
    msgs = (1, 1 if nodes > 1 else 0)
    ring = (2 * (local - 1), 2 * (nodes - 1))
    t = {}
    for cat, (intra, inter) in bytes_.items():
        alpha = ring if cat in ("dense_grad", "replica_sync", "model_gather") else msgs
        if cat == "replica_sync" and intra == 0:
            alpha = (0, nodes - 1)
        t[cat] = collective_time(intra, inter, links, local, alpha)
    for cat in EMBEDDING_CATEGORIES:
        if cat in t:
            t[cat] *= imbalance
    exposed_dense = max(0.0, t.get("dense_grad", 0.0) - overlap * compute_s)
    critical = sum(v for k, v in t.items() if k != "dense_grad")
    return {
        "compute": compute_s,
        "comm": t,
        "exposed_dense": exposed_dense,
        "total": compute_s + critical + exposed_dense,
    }


def speedup(times_by_nodes: dict[int, float]) -> dict[int, float]:
    """Weak scaling: N x T(1) / T(N)."""
    t1 = times_by_nodes[1]
    return {n: n * t1 / t for n, t in times_by_nodes.items()}


# --------------------------------------------------------------------------------------- compute

H100_BF16_DENSE_FLOPS = 989e12  # NVIDIA H100 SXM datasheet, dense BF16 tensor core (no sparsity)


def transformer_step_flops(shape: Shape, d_model: int, num_layers: int) -> float:
    """Training FLOPs per device per step: 6 P per token (fwd+bwd matmuls) + attention scores
    12 x layers x L x d per token (QK^T and AV, forward 4 L d, backward 2x)."""
    tokens = shape.batch * shape.seq_len
    return tokens * (6 * shape.dense_params + 12 * num_layers * shape.seq_len * d_model)


def compute_time_from_flops(
    shape: Shape, d_model: int, num_layers: int, mfu: float = 0.4, peak: float = H100_BF16_DENSE_FLOPS
) -> float:
    """mfu 0.4: an assumed, typical model-FLOPs utilisation for a bf16 transformer on H100 (not fitted)."""
    return transformer_step_flops(shape, d_model, num_layers) / (mfu * peak)


def compute_time_from_published(
    batch_per_gpu: int, examples_per_s: float = 490e3, gpus: int = 64, efficiency: float = 0.9375
) -> float:
    """Per-step compute implied by the published 490k examples/s on 64 GPUs at 93.75% of ideal: the ideal
    per-GPU rate is 490k / 64 / 0.9375; a step of `batch_per_gpu` examples takes batch / rate.
    (Upper bound on compute: the 6.25% loss is all attributed to communication.)"""
    return batch_per_gpu / (examples_per_s / gpus / efficiency)
