"""The Trainer's checkpoints, in-process on conftest's 8 simulated CPU devices (nothing is compiled but the
state initialisers, so this module is fast): restore across mesh shapes and topologies is exact, corrupt and
mismatched checkpoints are refused with a CheckpointError without touching the files, earlier checkpoints still
restore, keep_checkpoints prunes, and a run resumed from an earlier step sets later checkpoints aside.

The end-to-end runs (training, resume, SIGTERM, two processes) are in test_train_cli.py.
"""

import hashlib
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxscale
from jaxscale.training.config import load_config
from jaxscale.training.trainer import CheckpointError, Trainer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "jaxscale" / "configs" / "foundation_tiny.yaml"


def _cfg(*overrides):
    return load_config(str(TINY), list(overrides))


def _trainer(workdir, *overrides, mesh=None):
    cfg = _cfg(*overrides)
    return Trainer(
        cfg,
        mesh if mesh is not None else jaxscale.make_mesh(cfg.mesh.nodes, cfg.mesh.local),
        workdir=str(workdir),
        progress=False,
        log=False,
    )


def _nontrivial_state(tr, seed=1):
    """init_state with random tables AND random optimizer slots (init slots are constant: a wrong slot
    restore would go unnoticed), at train step 0."""
    state = tr.init_state()
    rng = np.random.default_rng(seed)
    tables = {t.name: rng.standard_normal((t.rows, t.dim)).astype(np.float32) for t in tr.tables}
    slots = {
        s: {t.name: rng.uniform(0.1, 2.0, t.rows).astype(np.float32) for t in tr.tables}
        for s in tr.ec.settings.optimizer.slots
    }
    state["emb"] = tr.ec.load_dense(tables, slots, step=7)
    return state, tables, slots


def _at_step(tr, state, step):
    return dict(state, step=jax.device_put(np.asarray(step, np.int32), tr.replicated))


def _save(tr, *states):
    mgr = tr._manager()
    try:
        for s in states:
            tr.save(mgr, s)
        mgr.wait_until_finished()
        return sorted(mgr.all_steps())
    finally:
        mgr.close()


def _listing(root: Path) -> dict:
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
        for p in sorted(root.rglob("*"))
    }


def _dense_host(state):
    return [np.asarray(x) for x in jax.tree.leaves(state["dense"])]


def test_restore_is_exact_across_meshes_and_topologies(tmp_path):
    src = _trainer(tmp_path)  # 2x4, 1d: 8 shards x 1 replica
    state, tables, slots = _nontrivial_state(src)
    assert _save(src, _at_step(src, state, 3)) == [3]
    dense = _dense_host(state)

    targets = [
        ("mesh.nodes=1", "mesh.local=8"),  # same plan, other mesh: orbax reshards
        ("mesh.nodes=4", "mesh.local=2", "embedding.topology=2d_a2a"),  # 2 shards x 4 replicas
        ("mesh.nodes=2", "mesh.local=4", "embedding.topology=2d_ar"),  # 2 shards x 4 replicas
        ("mesh.nodes=2", "mesh.local=4", "embedding.sharding=column_wise"),
    ]
    for overrides in targets:
        tr = _trainer(tmp_path, *overrides)
        restored, step = tr.restore(tr.init_state())
        assert step == 3 and int(np.asarray(restored["step"])) == 3, overrides
        got = tr.ec.to_dense(restored["emb"])
        for name, want in tables.items():
            np.testing.assert_array_equal(got[name], want, err_msg=f"{overrides}: table {name}")
        for replica in range(tr.ec.num_replicas):  # every replica, not just the first
            for name, want in tables.items():
                np.testing.assert_array_equal(tr.ec.to_dense(restored["emb"], replica)[name], want)
        got_slots = tr.ec.slots_to_dense(restored["emb"])
        for s in tr.ec.settings.optimizer.slots:
            for name, want in slots[s].items():
                g = got_slots[s][name]
                g = g if g.ndim == 1 else g[:, 0]  # column-wise keeps one copy per column shard
                np.testing.assert_array_equal(g, want, err_msg=f"{overrides}: slot {s} {name}")
        assert int(np.asarray(restored["emb"]["step"])) == 7
        for a, b in zip(_dense_host(restored), dense):
            np.testing.assert_array_equal(a, b)
        # the restored arrays live on the new mesh
        assert jax.tree.leaves(restored["dense"])[0].sharding.mesh.devices.shape == tr.mesh.devices.shape


# A restore that fails on corrupt array data leaves tensorstore's pending reads to complete after orbax has
# closed its event loop; their callbacks are ignored exceptions ("Event loop is closed"), orbax's, not a leak
# of ours (the managers this test's restores open are closed: Checkpointer.restore / steps).
@pytest.mark.filterwarnings("ignore:Exception ignored in. None:pytest.PytestUnraisableExceptionWarning")
def test_corrupt_and_mismatched_checkpoints_are_refused_without_touching_them(tmp_path):
    tr = _trainer(tmp_path)
    state, tables, _ = _nontrivial_state(tr)
    assert _save(tr, _at_step(tr, state, 5), _at_step(tr, state, 10)) == [5, 10]
    ckpts = tmp_path / "checkpoints"

    # Another model shape: refused before any array is read, naming what differs.
    for overrides, words in (
        (("model.foundation.item_dim=8",), ["another model", "item_h0", "dim 16", "8 now"]),
        (("model.foundation.d_model=16",), ["another model", "dense parameters differ"]),
        (("embedding.optimizer.kind=sgd",), ["another model", "optimizer slots"]),
    ):
        other = _trainer(tmp_path, *overrides)
        with pytest.raises(CheckpointError) as e:
            other.restore(other.init_state())
        for w in words:
            assert w in str(e.value), (overrides, str(e.value))

    # Corrupt the latest step's array data (same size, garbage in the middle).
    data_files = sorted((ckpts / "10" / "state" / "d").iterdir())
    assert data_files
    blob = bytearray(data_files[0].read_bytes())
    mid = len(blob) // 3
    blob[mid : mid + 2000] = b"\x7f" * 2000
    data_files[0].write_bytes(bytes(blob))
    before = _listing(ckpts)

    with pytest.raises(CheckpointError) as e:
        tr.restore(tr.init_state())
    msg = str(e.value)
    assert "step 10" in msg and "corrupt" in msg and "--resume-step" in msg and "[5]" in msg, msg
    assert len(msg) < 1500, "the tensorstore spec should be cut from the message"
    with pytest.raises(CheckpointError, match="no checkpoint for step 7"):
        tr.restore(tr.init_state(), step=7)
    # A truncated file and a garbage metadata file are refused as well (on copies).
    for name, damage in (
        ("trunc", lambda d: _truncate(sorted((d / "10" / "state" / "d").iterdir())[0])),
        ("meta", lambda d: (d / "10" / "meta" / "metadata").write_text("{garbage")),
    ):
        wd = tmp_path / name
        import shutil

        shutil.copytree(ckpts, wd / "checkpoints")
        damage(wd / "checkpoints")
        t2 = _trainer(wd)
        with pytest.raises(CheckpointError, match="unreadable"):
            t2.restore(t2.init_state())

    assert _listing(ckpts) == before, "a refused restore changed the checkpoint directory"

    # The earlier checkpoint still restores, exactly.
    restored, step = tr.restore(tr.init_state(), step=5)
    assert step == 5 and int(np.asarray(restored["step"])) == 5
    np.testing.assert_array_equal(tr.ec.to_dense(restored["emb"])["item_h0"], tables["item_h0"])
    assert _listing(ckpts) == before


def _truncate(p: Path):
    with open(p, "r+b") as f:
        f.truncate(1000)


def test_keep_checkpoints_and_resuming_from_an_earlier_step(tmp_path, capsys):
    tr = _trainer(tmp_path, "train.keep_checkpoints=2", "train.log_every=1")
    tr.is_writer = True  # print the set-aside message
    state, _, _ = _nontrivial_state(tr)
    assert _save(tr, *[_at_step(tr, state, s) for s in (5, 10, 15)]) == [10, 15]  # the last 2 kept
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "15"]

    # A run resumed from step 10 (say 15 was corrupt) saves step 10 again: 10 and 15 belong to the abandoned
    # run and are moved aside (never deleted), so `latest` is this run's checkpoint.
    changed = dict(state, emb=tr.ec.load_dense({"item_h0": np.ones((2000, 16), np.float32)}))
    assert _save(tr, _at_step(tr, changed, 10)) == [10]
    out = capsys.readouterr().out
    assert "abandoned" in out and "15" in out
    aside = sorted(p.name.split("-")[0] for p in (tmp_path / "abandoned_checkpoints").iterdir())
    assert aside == ["10", "15"]
    restored, step = tr.restore(tr.init_state())
    assert step == 10
    np.testing.assert_array_equal(tr.ec.to_dense(restored["emb"])["item_h0"], 1.0)


def test_empty_workdir_restore_is_a_clear_error(tmp_path):
    tr = _trainer(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        tr.restore(tr.init_state())
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        tr.restore(tr.init_state())
