"""The dense gradient all-reduce in bf16 (train.dense_grad_precision=bf16): half the bytes on the wire, the
same training up to bf16 rounding of the summed gradients."""

import jax
import numpy as np
import pytest

from jaxscale.engine.comm_inspect import list_collectives
from jaxscale.training.config import load_config
from jaxscale.training.trainer import Trainer, make_train_step

DLRM = [
    "model.kind=dlrm",
    "model.dlrm.num_sparse_features=2",
    "model.dlrm.rows=256",
    "model.dlrm.emb_dim=8",
    "model.dlrm.bottom_mlp=[32, 8]",
    "model.dlrm.top_mlp=[32]",
    "model.dlrm.num_dense=4",
    "train.batch_size=32",
    "train.eval_every=0",
    "data.eval_batches=0",
    "mesh.nodes=2",
    "mesh.local=4",
]


def _trainer(tmp_path, precision):
    cfg = load_config(None, DLRM + [f"train.dense_grad_precision={precision}", f"train.workdir={tmp_path / precision}"])
    return Trainer(cfg, progress=False)


def _dense_reduces(tr, stage):
    """(dense parameter count, the step's all-reduces of non-scalar float arrays: the dense gradients)."""
    state, batch = tr.init_state(), tr.batch(0)
    step = make_train_step(
        tr.spec,
        tr.ec,
        tr.graphdef,
        tr.tx,
        model_cfg=tr.model_cfg,
        dense_grad_precision=tr.cfg.train.dense_grad_precision,
    )
    params = sum(x.size for x in jax.tree.leaves(state["dense"]))
    cs = list_collectives(jax.jit(step), state, batch.data, batch.ids, mesh=tr.mesh, stage=stage)
    floats = [c for c in cs if c.kind == "all-reduce" and any(d in ("f32", "bf16") for d in c.dtypes)]
    return params, [c for c in floats if any(len(shape) > 0 for shape in c.shapes)]


def test_bf16_dense_gradients_travel_in_bf16_and_train_alike(tmp_path):
    fp32, bf16 = _trainer(tmp_path, "fp32"), _trainer(tmp_path, "bf16")
    # XLA inserts the fp32 all-reduce itself (GSPMD): it exists only in the compiled HLO
    params, reduces32 = _dense_reduces(fp32, "compiled")
    _, reduces16 = _dense_reduces(bf16, "lowered")
    assert reduces32 and all(set(c.dtypes) == {"f32"} for c in reduces32)
    # the intended wire format (pre-optimisation HLO: what a GPU sends; XLA:CPU upcasts bf16 collectives)
    assert reduces16 and all(set(c.dtypes) == {"bf16"} for c in reduces16), reduces16
    bytes32 = sum(c.result_bytes for c in reduces32)
    bytes16 = sum(c.result_bytes for c in reduces16)
    assert bytes32 == pytest.approx(4 * params, rel=0.05) and bytes16 == pytest.approx(2 * params, rel=0.05), (
        bytes16,
        bytes32,
        params,
    )
    a, b = fp32.run(steps=4)["losses"], bf16.run(steps=4)["losses"]
    assert a[0] == pytest.approx(b[0], rel=1e-6)  # the first loss precedes any update
    np.testing.assert_allclose(a, b, rtol=2e-2)
    assert a[-1] != b[-1]  # the gradients really went through bf16


def test_bf16_dense_gradients_need_the_forward_objective_split():
    from jaxscale.training import registry

    spec = registry.get("dlrm")
    import dataclasses

    bare = dataclasses.replace(spec, forward=None)
    with pytest.raises(ValueError, match="forward and objective"):
        make_train_step(bare, None, None, None, dense_grad_precision="bf16")
