"""Feature trimmer, in process: signature extraction with jax.export, signature files, the wire format and the
trimming decision, each against a brute-force reference."""

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pytest
from serving_helpers import demo_store

from jaxscale.serving import demo, wire
from jaxscale.serving import store as store_lib
from jaxscale.serving.export import (
    UndeclaredFeatureError,
    UnusedFeatureError,
    UnusedFeatureWarning,
    export_model,
    load_model,
)
from jaxscale.serving.routes import MISSING, OK, UNREADABLE, RouteTable
from jaxscale.serving.signature import FeatureError, FeatureSpec, Signature, SignatureError
from jaxscale.serving.trim import FanoutPlanner, plan_fanout, trim_batch

SPECS = (FeatureSpec("a", "float32", (4,)), FeatureSpec("b", "float32", (3,)), FeatureSpec("c", "int32", (5,)))


def reads_a_and_c(f):
    return {"score": jnp.tanh(f["a"].sum(-1) + f["c"].sum(-1).astype(jnp.float32))}


# ------------------------------------------------------------------------------------------- signature extraction


def test_export_finds_declared_but_unused_feature(tmp_path):
    with pytest.warns(UnusedFeatureWarning, match=r"ctr/7 declares 1 feature\(s\).*\['b'\]"):
        exported = export_model(reads_a_and_c, SPECS, model="ctr", version="7", store=tmp_path)
    sig = exported.signature
    assert sig.unused == ("b",) and sig.required == ("a", "c") and sig.feature_names == ("a", "b", "c")
    assert [o.to_json() for o in sig.outputs] == [{"name": "score", "dtype": "float32", "shape": ["batch"]}]
    on_disk = json.loads(store_lib.signature_path(tmp_path, "ctr", "7").read_text())
    assert on_disk["unused_features"] == ["b"]
    assert on_disk["features"][0] == {"name": "a", "dtype": "float32", "shape": ["batch", 4]}
    # The served artifact has a symbolic batch: any batch size runs, and the unused input cannot matter.
    loaded = load_model(tmp_path, "ctr", "7")
    assert loaded.signature == sig
    rng = np.random.default_rng(0)
    x = {"a": rng.standard_normal((9, 4)).astype(np.float32), "c": rng.integers(0, 3, (9, 5)).astype(np.int32)}
    ref = np.tanh(x["a"].astype(np.float64).sum(-1) + x["c"].sum(-1))
    for b in (np.zeros((9, 3), np.float32), rng.standard_normal((9, 3)).astype(np.float32)):
        out = np.asarray(loaded.call({**x, "b": b})["score"])
        np.testing.assert_allclose(out, ref, rtol=1e-5)


def test_on_unused_error_raises_and_writes_nothing(tmp_path):
    with pytest.raises(UnusedFeatureError, match=r"declares 1 feature.*\['b'\]"):
        export_model(reads_a_and_c, SPECS, model="ctr", version="1", store=tmp_path, on_unused="error")
    assert not store_lib.version_dir(tmp_path, "ctr", "1").exists()


def test_on_unused_ignore_records_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sig = export_model(reads_a_and_c, SPECS, model="m", version="1", on_unused="ignore").signature
    assert sig.unused == ("b",)
    with pytest.raises(ValueError, match="on_unused must be one of"):
        export_model(reads_a_and_c, SPECS, model="m", version="1", on_unused="loud")


@pytest.mark.parametrize("how", ["getitem", "get"])
def test_reading_an_undeclared_feature_is_a_clear_error(how):
    def fn(f):
        extra = f["secret"] if how == "getitem" else f.get("secret")
        return f["a"].sum(-1) + extra

    with pytest.raises(UndeclaredFeatureError, match=r"model m/1 reads feature 'secret'.*does not declare"):
        export_model(fn, SPECS, model="m", version="1")


@pytest.mark.parametrize("seed", [0, 1])
def test_unused_features_match_brute_force(seed):
    """Random declared specs and a random subset actually read: unused == declared - read."""
    rng = np.random.default_rng(seed)
    specs = []
    for i in range(int(rng.integers(4, 9))):
        dtype = str(rng.choice(["float32", "int32", "bool", "float16", "uint8"]))
        shape = tuple(int(d) for d in rng.integers(1, 4, int(rng.integers(0, 3))))
        specs.append(FeatureSpec(f"f{i}", dtype, shape))
    reads = {s.name for s in specs if rng.random() < 0.5} or {specs[0].name}

    def fn(f):
        return sum(f[n].astype(jnp.float32).reshape(f[n].shape[0], -1).sum(-1) for n in sorted(reads))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedFeatureWarning)
        sig = export_model(fn, specs, model="r", version=str(seed)).signature
    assert set(sig.unused) == {s.name for s in specs} - reads
    assert sig.required == tuple(s.name for s in specs if s.name in reads)


def test_demo_signatures_report_exactly_the_planted_unused_features():
    _, signatures = demo_store()
    by_key = {s.key: s for s in signatures}
    for m in demo.demo_models():
        sig = by_key[(m.model, m.version)]
        assert sig.unused == m.unused
        assert 20 <= len(sig.required) <= 60
    assert by_key[("ctr", "1")].unused and len(by_key[("ctr", "1")].unused) == 3
    assert sum(bool(s.unused) for s in signatures) == 1


def test_export_refuses_bad_models(tmp_path):
    with pytest.raises(SignatureError, match="outputs must be an array or a flat dict"):
        export_model(lambda f: {"x": {"y": f["a"]}}, SPECS, model="m", version="1")
    with pytest.raises(SignatureError, match="output 'output' has shape.*batch dimension first"):
        export_model(lambda f: f["a"].sum(), SPECS, model="m", version="1")
    with pytest.raises(SignatureError, match="'b' is declared twice"):
        export_model(reads_a_and_c, (*SPECS, FeatureSpec("b", "int32")), model="m", version="1")
    with pytest.raises(SignatureError, match="input 'n' is int32.*declares int64.*jax_enable_x64"):
        export_model(lambda f: f["n"] + 1, [FeatureSpec("n", "int64")], model="m", version="1")
    export_model(reads_a_and_c, SPECS, model="m", version="1", store=tmp_path, on_unused="ignore")
    with pytest.raises(FileExistsError, match="immutable"):
        export_model(reads_a_and_c, SPECS, model="m", version="1", store=tmp_path, on_unused="ignore")


def test_load_model_detects_a_tampered_artifact(tmp_path):
    export_model(reads_a_and_c, SPECS, model="m", version="1", store=tmp_path, on_unused="ignore")
    path = store_lib.artifact_path(tmp_path, "m", "1")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(SignatureError, match="sha256 does not match"):
        load_model(tmp_path, "m", "1")


# ------------------------------------------------------------------------------------------------ signature files


def _sig():
    return Signature("m", "1", SPECS, unused=("b",))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda o: o.pop("features"), r"missing field\(s\) \['features'\]"),
        (lambda o: o.update(format="other/1"), "field 'format' is 'other/1'"),
        (lambda o: o["features"][1].update(dtype="complex64"), r"features\[1\]: feature 'b': unsupported dtype"),
        (lambda o: o["features"][0].update(shape=[4]), r"features\[0\]: shape must be a list starting with 'batch'"),
        (lambda o: o["features"][0].update(shape=["batch", 0]), r"features\[0\].*must be positive integers"),
        (lambda o: o.update(unused_features=["zz"]), r"unused features \['zz'\] are not declared"),
        (lambda o: o.update(extra=1), r"unknown field\(s\) \['extra'\]"),
        (lambda o: o.update(model="../etc"), "invalid model name"),
    ],
)
def test_bad_signature_files_name_the_file_and_field(tmp_path, mutate, message):
    obj = _sig().to_json()
    mutate(obj)
    path = tmp_path / "signature.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(SignatureError, match=message) as info:
        Signature.load(path)
    assert str(path) in str(info.value)


def test_signature_file_round_trip_and_invalid_json(tmp_path):
    sig = _sig()
    assert Signature.load(sig.save(tmp_path / "s.json")) == sig
    (tmp_path / "bad.json").write_text('{"format": ')
    with pytest.raises(SignatureError, match="bad.json: not valid JSON"):
        Signature.load(tmp_path / "bad.json")


def test_check_names_the_offending_feature():
    sig = _sig()
    ok = {"a": ("float32", (4,)), "c": ("int32", (5,))}
    sig.check(ok)  # 'b' is unused: may be absent
    sig.check({**ok, "b": ("float32", (3,)), "other": ("float64", (9,))})  # extras are ignored
    cases = [
        ({"c": ok["c"]}, "a", "missing", r"m/1: required feature 'a' is missing"),
        (
            {**ok, "a": ("float64", (4,))},
            "a",
            "dtype",
            r"feature 'a' has dtype float64, the signature declares float32",
        ),
        ({**ok, "c": ("int32", (5, 1))}, "c", "shape", r"'c' has shape \['batch', 5, 1\].*\['batch', 5\]"),
        ({**ok, "b": ("int32", (3,))}, "b", "dtype", "feature 'b' has dtype int32"),
    ]
    for columns, feature, reason, message in cases:
        with pytest.raises(FeatureError, match=message) as info:
            sig.check(columns)
        assert (info.value.feature, info.value.reason, info.value.model) == (feature, reason, "m")


# ---------------------------------------------------------------------------------------------------- wire format

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint32", "uint64", "float16", "float32", "float64"]


def _random_features(rng, n):
    out = {}
    batch = int(rng.integers(1, 7))
    for i in range(n):
        dtype = np.dtype(str(rng.choice(DTYPES)))
        shape = (batch, *(int(d) for d in rng.integers(1, 4, int(rng.integers(0, 4)))))
        if dtype.kind == "f":
            v = rng.standard_normal(shape)
        elif dtype.kind == "b":
            v = rng.random(shape) < 0.5
        else:
            info = np.iinfo(dtype)
            v = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
        out[f"f{i}"] = np.asarray(v).astype(dtype)
    return out


@pytest.mark.parametrize("compression", [None, "zstd", "lz4"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wire_round_trip_is_bit_exact(seed, compression):
    rng = np.random.default_rng(seed)
    features = _random_features(rng, 12)
    batch = wire.decode(wire.encode(features, compression))
    assert batch.schema.names == list(features)
    assert wire.describe(batch) == {k: (v.dtype.name, v.shape[1:]) for k, v in features.items()}
    for name, v in features.items():
        got = wire.to_numpy(batch, name)
        assert got.dtype == v.dtype and got.shape == v.shape
        assert got.tobytes() == v.tobytes()


@pytest.mark.parametrize("shape", [(), (3,), (2, 4), (5, 1, 2)])
def test_columns_read_back_exactly_when_sliced_or_over_long(shape):
    """The fast path reads a list column's child array directly: a slice (offset) or a child longer than the
    list's values must still give exactly the selected rows."""
    rng = np.random.default_rng(len(shape))
    a = rng.standard_normal((10, *shape)).astype(np.float32)
    column = wire.to_record_batch({"x": a}).column(0)
    dtype, dims = wire.column_type("x", column.type)
    for start, stop in ((0, 10), (3, 7), (9, 10)):
        got = wire.column_to_numpy(column.slice(start, stop - start), "x", dtype, dims)
        assert got.shape == a[start:stop].shape and got.tobytes() == a[start:stop].tobytes()
    if shape:
        flat = np.concatenate([a.reshape(10, -1), np.ones((4, a[0].size), np.float32)]).reshape(-1)
        longer = pa.array(flat)  # 14 rows of values under a 10-row list array
        for size in reversed(shape[1:]):
            longer = pa.FixedSizeListArray.from_arrays(longer, size)
        longer = pa.FixedSizeListArray.from_arrays(longer, shape[0]).slice(0, 10)
        assert wire.column_to_numpy(longer, "x", dtype, dims).tobytes() == a.tobytes()


def test_wire_rejects_malformed_payloads():
    with pytest.raises(wire.PayloadError, match="not an Arrow IPC stream"):
        wire.decode(b"definitely not arrow")
    one = pa.record_batch([pa.array([1.0, 2.0], pa.float32())], names=["x"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, one.schema) as w:
        w.write_batch(one)
        w.write_batch(one)
    with pytest.raises(wire.PayloadError, match="exactly one record batch, got 2"):
        wire.decode(sink.getvalue().to_pybytes())
    dup = pa.record_batch([pa.array([1.0]), pa.array([2.0])], names=["x", "x"])
    with pytest.raises(wire.PayloadError, match=r"duplicate feature column\(s\) \['x'\]"):
        wire.decode(wire.encode(dup))
    nulls = pa.record_batch([pa.array([1.0, None], pa.float32())], names=["x"])
    with pytest.raises(FeatureError, match="feature 'x' has null values"):
        wire.to_numpy(wire.decode(wire.encode(nulls)), "x")
    strings = pa.record_batch([pa.array(["a"])], names=["s"])
    with pytest.raises(FeatureError, match="feature 's' has Arrow type string"):
        wire.describe(wire.decode(wire.encode(strings)))
    with pytest.raises(FeatureError, match="feature 'y' has batch size 3, other features have 2"):
        wire.to_record_batch({"x": np.zeros(2), "y": np.zeros(3)})


# ------------------------------------------------------------------------------------------------------- trimming


def _write_signatures(store, signatures):
    for sig in signatures:
        sig.save(store_lib.signature_path(store, sig.model, sig.version))


def test_trimming_matches_reference_and_fails_open(tmp_path):
    universe = demo.feature_universe()
    models = demo.demo_models(universe)
    sigs = [Signature(m.model, m.version, m.declared, unused=m.unused) for m in models]
    _write_signatures(tmp_path, sigs[:4])  # sigs[4] has no file: missing
    path = store_lib.signature_path(tmp_path, models[5].model, models[5].version)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")  # unreadable
    table = RouteTable(tmp_path, [s.key for s in sigs])
    routes = table.current()
    assert [routes.entry(*s.key).status for s in sigs] == [OK] * 4 + [MISSING, UNREADABLE]
    request = demo.make_request(universe, 5, np.random.default_rng(0))
    batch = wire.to_record_batch(request)
    plans = plan_fanout(wire.describe(batch), routes, [s.key for s in sigs])
    for m, plan in zip(models, plans):
        sent = trim_batch(batch, plan.send)
        if plan.fail_open:
            assert sent.schema.names == list(request)  # everything
            continue
        reference = [n for n in m.reads]  # the features the model function reads, in declared order
        assert sent.schema.names == reference
        for name in reference:
            assert wire.to_numpy(sent, name).tobytes() == request[name].tobytes()
    assert [p.fail_open for p in plans] == [None] * 4 + [MISSING, UNREADABLE]
    untrimmed = plan_fanout(wire.describe(batch), routes, [s.key for s in sigs], trim=False)
    assert all(p.send is None for p in untrimmed)


def test_plan_fanout_refuses_a_bad_request_naming_feature_and_model(tmp_path):
    universe = demo.feature_universe()
    m = demo.demo_models(universe)[1]
    _write_signatures(tmp_path, [Signature(m.model, m.version, m.declared, unused=m.unused)])
    routes = RouteTable(tmp_path, [(m.model, m.version)]).current()
    columns = {s.name: (s.dtype, s.shape) for s in universe}
    victim = m.reads[3]
    del columns[victim]
    with pytest.raises(FeatureError, match=f"model {m.model}/{m.version}: required feature '{victim}' is missing"):
        plan_fanout(columns, routes, [(m.model, m.version)])


def test_planner_reuses_a_plan_only_for_an_equal_schema_and_route_map(tmp_path):
    universe = demo.feature_universe()
    models = demo.demo_models(universe)
    _write_signatures(tmp_path, [Signature(m.model, m.version, m.declared, unused=m.unused) for m in models])
    keys = [(m.model, m.version) for m in models]
    table = RouteTable(tmp_path, keys)
    planner = FanoutPlanner()
    rng = np.random.default_rng(3)
    first = wire.to_record_batch(demo.make_request(universe, 4, rng))
    second = wire.to_record_batch(demo.make_request(universe, 9, rng))  # other values and batch, same schema
    plans = planner.plan(first, table.current(), keys)
    assert planner.plan(second, table.current(), keys) is plans and (planner.hits, planner.misses) == (1, 1)
    for m, plan in zip(models, plans):
        sent = trim_batch(second, plan)
        assert sent.schema.names == list(m.reads) and sent.num_rows == 9
        for name in m.reads:
            assert wire.to_numpy(sent, name).tobytes() == wire.to_numpy(second, name).tobytes()
    # Same names, one dtype changed: a different schema, checked again, refused.
    victim = models[0].reads[0]
    request = demo.make_request(universe, 4, rng)
    request[victim] = request[victim].astype(np.float64 if request[victim].dtype == np.float32 else np.int64)
    with pytest.raises(FeatureError, match=f"'{victim}' has dtype"):
        planner.plan(wire.to_record_batch(request), table.current(), keys)
    assert planner.misses == 2
    # A new route map generation never reuses plans of the old one.
    plans_again = planner.plan(first, table.reload(), keys)
    assert plans_again is not plans and plans_again == plans and planner.misses == 3
    untrimmed = planner.plan(first, table.current(), keys, trim=False)
    assert all(p.send is None for p in untrimmed) and planner.misses == 4
