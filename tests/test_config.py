"""Config loading: YAML files, dotted overrides, type checks that name the dotted key, safe YAML only."""

import json
from pathlib import Path

import pytest
import yaml

from jaxscale.training.config import Config, ConfigError, config_from_dict, config_to_dict, dump_config, load_config
from jaxscale_models.foundation import FoundationConfig

CONFIGS = Path(__file__).resolve().parent.parent / "jaxscale" / "configs"
FILES = ["foundation_smoke", "dlrm_smoke", "foundation_large", "dlrm_large"]


@pytest.mark.parametrize("name", FILES)
def test_experiment_configs_load_and_round_trip(name):
    path = CONFIGS / f"{name}.yaml"
    first = path.read_text().splitlines()[0]
    assert first == f"# python -m jaxscale.train --config jaxscale/configs/{name}.yaml"
    cfg = load_config(str(path), [])
    assert cfg.model.kind == name.split("_")[0]
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert config_from_dict(yaml.safe_load(dump_config(cfg))) == cfg
    params = (
        cfg.model.foundation.embedding_params if cfg.model.kind == "foundation" else cfg.model.dlrm.embedding_params
    )
    assert (params > 1e9) == name.endswith("large")


def test_defaults_are_the_smoke_run():
    cfg = load_config(None, [])
    assert cfg == Config()
    assert (cfg.mesh.nodes, cfg.mesh.local) == (1, 8)
    assert cfg.model.kind == "foundation" and cfg.model.foundation == FoundationConfig.smoke()
    assert cfg.train.batch_size % 8 == 0 and cfg.embedding.capacity_factor is None
    assert load_config(str(CONFIGS / "foundation_smoke.yaml"), []).model == cfg.model


def test_overrides_parse_yaml_values():
    cfg = load_config(
        str(CONFIGS / "dlrm_smoke.yaml"),
        [
            "train.steps=7",
            "train.learning_rate=1e-3",
            "train.grad_clip_norm=null",
            "data.scramble_ids=true",
            "model.dlrm.rows=[5, 6, 7, 8, 9, 10, 11, 12]",
            "embedding.capacity_factor=2",
            "embedding.sharding={sparse_0: table_wise, sparse_1: row_wise}",
            "mesh.nodes=4",
            "mesh.local=2",
            "model.foundation.item_reshape=half_dim",
        ],
    )
    assert cfg.train.steps == 7 and cfg.train.learning_rate == 1e-3 and cfg.train.grad_clip_norm is None
    assert cfg.data.scramble_ids is True
    assert cfg.model.dlrm.rows == (5, 6, 7, 8, 9, 10, 11, 12)
    assert cfg.embedding.capacity_factor == 2.0 and isinstance(cfg.embedding.capacity_factor, float)
    assert cfg.embedding.sharding == {"sparse_0": "table_wise", "sparse_1": "row_wise"}
    assert (cfg.mesh.nodes, cfg.mesh.local) == (4, 2)
    assert cfg.model.foundation.item_reshape == "half_dim"
    assert load_config(None, ["train.steps=3", "train.steps=4"]).train.steps == 4  # last one wins


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.stepz=3", "train.stepz"),
        ("trian.steps=3", "trian"),
        ("train.steps=ten", "train.steps"),
        ("train.steps=1.5", "train.steps"),
        ("train.steps=null", "train.steps"),
        ("train.steps=0", "train.steps"),
        ("train.learning_rate=fast", "train.learning_rate"),
        ("data.scramble_ids=1", "data.scramble_ids"),
        ("embedding.topology=3d", "embedding.topology"),
        ("embedding.optimizer=adam", "embedding.optimizer"),
        ("embedding.comm_forward=fp4", "embedding.comm_forward"),
        ("embedding.sharding=diagonal", "embedding.sharding"),
        ("embedding.sharding={item_h0: 3}", "embedding.sharding.item_h0"),
        ("embedding.capacity_factor=-1", "embedding.capacity_factor"),
        ("model.kind=gpt", "model.kind"),
        ("model.foundation.d_model=50", "model.foundation.num_heads"),
        ("model.foundation.item_dim=0", "model.foundation.item_dim"),
        ("model.foundation.time_encoding=rope", "model.foundation.time_encoding"),
        ("model.foundation.bogus=1", "model.foundation.bogus"),
        ("model.dlrm.rows=[1, 2]", "model.dlrm.rows"),
        ("model.dlrm.bottom_mlp=[64, x]", "model.dlrm.bottom_mlp[1]"),
        ("model.dlrm=7", "model.dlrm"),
        ("data.source=parquet", "data.path"),
        ("mesh.nodes=3", "train.batch_size"),
        ("train.nonfinite_policy=ignore", "train.nonfinite_policy"),
        ("train.steps.sub=1", "train.steps"),
    ],
)
def test_errors_name_the_dotted_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(str(CONFIGS / "foundation_smoke.yaml"), [override])
    assert str(e.value).startswith(f"{key}:"), str(e.value)


def test_bad_files(tmp_path):
    evil = tmp_path / "evil.yaml"
    marker = tmp_path / "pwned"
    evil.write_text(f'train: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(ConfigError, match="safe"):
        load_config(str(evil), [])
    assert not marker.exists()
    with pytest.raises(ConfigError):
        load_config(None, [f'train.workdir=!!python/object/apply:os.system ["touch {marker}"]'])
    assert not marker.exists()
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(listy), [])
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert load_config(str(empty), []) == Config()
    with pytest.raises(ConfigError, match="dotted"):
        load_config(None, ["train.steps"])


def test_no_registered_model_kinds_says_install_the_package(monkeypatch):
    """A source tree on PYTHONPATH without the package installed has no entry points: the error says so."""
    from jaxscale.training import registry

    monkeypatch.setattr(registry, "_entry_points", dict)
    monkeypatch.setattr(registry, "_SPECS", {})
    with pytest.raises(
        ConfigError, match=r"^model\.kind: must be one of \[\], got 'foundation': none is registered, install"
    ):
        load_config(str(CONFIGS / "foundation_smoke.yaml"), [])


def test_yaml_12_floats_are_numbers(tmp_path):
    """`1e-8` without a dot is a float (YAML 1.2), in a file and in an override; a saved config reloads equal."""
    path = tmp_path / "c.yaml"
    path.write_text("embedding:\n  optimizer:\n    kind: rowwise_adagrad\n    learning_rate: 5e-2\n    eps: 1e-8\n")
    path.write_text(path.read_text() + "train:\n  learning_rate: 3E-4\n")
    cfg = load_config(str(path), ["train.weight_decay=1e-5", "train.warmup_steps=7"])
    assert cfg.embedding.optimizer.eps == 1e-8 and cfg.train.learning_rate == 3e-4
    assert cfg.train.weight_decay == 1e-5 and cfg.train.warmup_steps == 7
    with pytest.raises(ConfigError, match=r"^train\.learning_rate:"):
        load_config(None, ["train.learning_rate=1e-3x"])
    saved = tmp_path / "saved.yaml"
    saved.write_text(json.dumps(config_to_dict(cfg)))  # JSON is YAML: how a checkpoint's config tree reads back
    assert load_config(str(saved)) == cfg
    with pytest.raises(ConfigError, match=r"^embedding\.optimizer\.learning_rate: is required"):
        load_config(None, ["embedding.optimizer={kind: sgd}"])
