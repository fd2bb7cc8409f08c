# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A tour of jaxscale
#
# Sharded embedding tables on a 2D `('node', 'local')` mesh of 8 simulated CPU devices: plan the
# sharding, look at what one step sends (from the compiled HLO), train a few steps of the smoke
# foundation model, and plot the loss and the communication bytes per technique stage.
#
# The simulated device count must be set before JAX starts.

# %%
import functools
import io
import json
import os
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax

jax.config.update("jax_num_cpu_devices", 8)
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Image, display

import jaxscale
from jaxscale.engine import comm_inspect, planner
from jaxscale.engine.cluster import ClusterSpec

REPO = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "jaxscale" / "configs").is_dir())
print(jax.device_count(), "devices")
assert jax.device_count() == 8

# %% [markdown]
# ## A mesh and a balanced plan
#
# Two simulated nodes of four devices. The planner (pure NumPy) measures ids per example and the
# Zipf skew of each feature from a sample, then places table pieces so the slowest device is as fast
# as possible. Its report shows the estimated per-device load.

# %%
mesh = jaxscale.make_mesh(2, 4)
tables = [
    jaxscale.TableConfig("items", rows=20_000, dim=32, pooling="sum", features=("history",)),
    jaxscale.TableConfig("users", rows=5_000, dim=32, pooling="sum"),
    jaxscale.TableConfig("category", rows=500, dim=32, pooling="mean"),
]
rng = np.random.default_rng(0)
B = 64


def zipf(rows, shape, a=1.2):
    return (((rng.zipf(a, size=shape) - 1) * 2654435761) % rows).astype(np.int32)


host_ids = {"history": zipf(20_000, (B, 16)), "users": zipf(5_000, (B, 1)), "category": zipf(500, (B, 3))}
stats = planner.measure_feature_stats(host_ids, tables)
topo = ClusterSpec(nodes=2, devices_per_node=4, device_memory_bytes=1e9)
plan = planner.plan_sharding(tables, stats, topo, batch_size_per_device=B // 8)
print({name: ts.sharding for name, ts in plan.tables.items()})
print(planner.report(plan, tables, stats, topo, batch_size_per_device=B // 8))

# %% [markdown]
# ## Shard the tables and inspect one step's communication
#
# `EmbeddingCollection` takes the plan. The train step (lookup, loss, sparse row-wise AdaGrad update) is
# jitted; `comm_inspect` lists every collective of the compiled HLO with its bytes per device.

# %%
ec = jaxscale.EmbeddingCollection(
    tables,
    mesh,
    jaxscale.EmbeddingSettings(
        topology="1d",
        optimizer=jaxscale.RowWiseAdagrad(0.002),
        comm=jaxscale.CommConfig(forward="fp8", backward="bf16"),
    ),
    plan=plan,
)
state = ec.init(jax.random.key(0))
ids = ec.shard_batch(host_ids)


@functools.partial(jax.jit, donate_argnums=0)  # donated: the tables are updated in place
def train_step(state, ids):
    emb = ec.lookup(state, ids)
    loss, grads = jax.value_and_grad(lambda e: sum(jax.numpy.mean(v**2) for v in e.values()))(emb)
    return ec.update(state, ids, grads), loss


collectives = comm_inspect.list_collectives(train_step, state, ids, mesh=mesh)
print(comm_inspect.format_table(collectives))
losses = []
for _ in range(3):
    state, loss = train_step(state, ids)
    losses.append(float(loss))
print("embedding-only loss:", losses)
assert losses[-1] < losses[0]

# %% [markdown]
# ## Train the smoke foundation model for a few steps
#
# The `Trainer` builds the PinFM-style model, its sharded item table and the synthetic data from the
# config (shrunk here: one layer, d_model 32, 16-event sequences, batch 32, so the tour runs in about a
# minute); metrics and a checkpoint go to a temporary work directory.

# %%
from jaxscale.training.config import load_config
from jaxscale.training.trainer import Trainer

workdir = tempfile.mkdtemp(prefix="jaxscale_tour_")
cfg = load_config(
    str(REPO / "jaxscale/configs/foundation_smoke.yaml"),
    [
        "train.steps=8",
        "train.eval_every=0",
        "train.log_every=2",
        f"train.workdir={workdir}",
        "model.foundation.num_layers=1",
        "model.foundation.d_model=32",
        "model.foundation.max_seq_len=16",
        "train.batch_size=32",
        "data.eval_batches=0",
    ],
)
trainer = Trainer(cfg, progress=False, log=True)
history = trainer.run()
print("loss per step:", [round(x, 3) for x in history["losses"]])
print("bytes per step per device:", trainer.comm)
assert len(history["losses"]) == 8 and np.isfinite(history["losses"]).all()

# %% [markdown]
# ## What each technique saves
#
# Bytes per example of the foundation config's embedding step on the 2x4 mesh, stage by stage
# (cumulative), read from the compiled HLO of each stage by `python -m jaxscale.bench` and recorded in
# `experiments/results/bench_suite.json` (run `python -m jaxscale.bench --parts stages` to redo them).

# %%
recorded = json.loads((REPO / "experiments/results/bench_suite.json").read_text())
stages = recorded["parts"]["stages"]["stages"]
print("recorded by:", recorded["command"])
for s in stages:
    print(
        f"{s['stage']:<12} intra {s['intra_node_bytes_per_example']:>9,.0f}  "
        f"inter {s['inter_node_bytes_per_example']:>9,.0f}  B/example"
    )

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.5))
ax0.plot(history["steps"], history["losses"], marker="o")
ax0.set(xlabel="step", ylabel="loss", title="smoke foundation model")
names = [s["stage"] for s in stages]
intra = [s["intra_node_bytes_per_example"] for s in stages]
inter = [s["inter_node_bytes_per_example"] for s in stages]
ax1.bar(names, intra, label="intra-node")
ax1.bar(names, inter, bottom=intra, label="inter-node")
ax1.set(ylabel="bytes / example", title="embedding comm per technique stage")
ax1.legend()
fig.tight_layout()
buf = io.BytesIO()
fig.savefig(buf, format="png", dpi=80)  # Agg: render to PNG and show it inline
plt.close(fig)
display(Image(data=buf.getvalue()))
