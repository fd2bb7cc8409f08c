"""The HLO collective parser: literal HLO for each syntax, then real compiled steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale
from jaxscale.engine import collectives
from jaxscale.engine.comm_inspect import Collective, format_table, list_collectives, parse_hlo, summarize
from jaxscale.engine.mesh import LOCAL, NODE

SPEC = P((NODE, LOCAL))

# One instruction per syntax the parser must read (shapes are per device). Expected, on a 2x4 mesh
# (node = position // 4): kind, group size, groups, result bytes, bytes per device, cross-node.
HLO_MODULE = """\
HloModule jit_step, entry_computation_layout={(f32[64,16]{1,0})->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main.1 (p: f32[64,16]) -> f32[] {
  %p = f32[64,16]{1,0} parameter(0)
  %all-to-all = (u8[4,36]{1,0}, u8[4,36]{1,0}, u8[4,36]{1,0}, u8[4,36]{1,0}) all-to-all(%a0, %a1, %a2, %a3), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, metadata={op_name="jit(step)/all_to_all"}
  %all-reduce = f32[16]{0} all-reduce(%x), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %all-gather = bf16[32,8]{1,0} all-gather(%y), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}, use_global_device_ids=true
  %reduce-scatter = f32[2,8]{1,0} reduce-scatter(%z), channel_id=4, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %collective-permute = f32[4,8]{1,0} collective-permute(%w), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %all-gather-start = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%v), channel_id=6, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
  %all-gather-done = f32[16,8]{1,0} all-gather-done(%all-gather-start)
  %fusion = f32[4]{0} fusion(%all-to-all), kind=kLoop, calls=%fused
  %all-reduce.2 = f32[8]{0} all-reduce(%u), channel_id=7, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, use_global_device_ids=true, to_apply=%add
  ROOT %all-reduce.1 = f32[] all-reduce(%q), replica_groups={}, to_apply=%add
}
"""
EXPECTED = [
    ("all-to-all", 4, ((0, 1, 2, 3), (4, 5, 6, 7)), 576, 432.0, False),
    ("all-reduce", 2, ((0, 4), (1, 5), (2, 6), (3, 7)), 64, 64.0, True),
    ("all-gather", 4, ((0, 1, 2, 3), (4, 5, 6, 7)), 512, 384.0, False),
    ("reduce-scatter", 8, (tuple(range(8)),), 64, 448.0, True),
    ("collective-permute", 2, ((0, 1), (1, 2), (2, 3), (3, 0)), 128, 128.0, False),
    ("all-gather", 2, ((0, 4), (1, 5), (2, 6), (3, 7)), 512, 256.0, True),
    ("all-reduce", 4, ((0, 1, 2, 3), (4, 5, 6, 7)), 32, 48.0, False),
    ("all-reduce", 8, (tuple(range(8)),), 4, 7.0, True),
]


@pytest.fixture(scope="module")
def mesh_2x4():
    return jaxscale.make_mesh(2, 4)


def test_literal_hlo_all_syntaxes(mesh_2x4):
    found = list_collectives(HLO_MODULE, mesh=mesh_2x4)
    assert [c.name for c in found] == [
        "all-to-all",
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "collective-permute",
        "all-gather-start",
        "all-reduce.2",
        "all-reduce.1",
    ]
    for c, (kind, size, groups, result, per_device, cross) in zip(found, EXPECTED):
        assert (c.kind, c.group_size, c.groups) == (kind, size, groups), c.name
        assert (c.result_bytes, c.bytes_per_device, c.cross_node) == (result, per_device, cross), c.name
    assert found[0].dtypes == ("u8",) * 4 and found[0].shapes == ((4, 36),) * 4  # tuple all-to-all summed
    assert found[5].shapes == ((16, 8),)  # async start: only the gathered result counts


def test_summarize_and_table(mesh_2x4):
    found = parse_hlo(HLO_MODULE, mesh_2x4)
    summary = summarize(found)
    assert summary["intra_node"] == 432 + 384 + 128 + 48
    assert summary["cross_node"] == 64 + 448 + 256 + 7
    assert summary["total"] == summary["intra_node"] + summary["cross_node"]
    assert summary["count"] == 8
    assert summary["by_kind"]["all-reduce"] == {"intra_node": 48.0, "cross_node": 71.0, "count": 3}
    assert summary["by_kind"]["all-gather"] == {"intra_node": 384.0, "cross_node": 256.0, "count": 2}
    table = format_table(found)
    assert "4xu8[4, 36]" in table and "reduce-scatter" in table and "cross" in table
    assert "8 collectives" in table and "cross-node 775 B" in table


def test_lowered_style_names_index_comments_and_sub_axes(mesh_2x4):
    text = "\n".join(
        [
            # pre-optimisation HLO: names without '%'
            "  all_to_all.1 = u16[64,16]{1,0} all-to-all(bitcast_convert_type.2), channel_id=1, "
            "replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}",
            # long CPU tuples carry /*index=N*/ comments
            "  %all-to-all.3 = (u8[8,20]{1,0}, u8[8,20]{1,0}, u8[8,20]{1,0}, u8[8,20]{1,0}, u8[8,20]{1,0}, "
            "/*index=5*/u8[8,20]{1,0}, u8[8,20]{1,0}, u8[8,20]{1,0}) all-to-all(%s0, %s1), channel_id=2, "
            "replica_groups=[1,8]<=[8]",
            # a sub-axis: local:(2)2 pairs positions 0/2 and 1/3 inside each node
            "  %all-reduce.5 = f32[8]{0} all-reduce(%r), channel_id=3, "
            "replica_groups=mesh['node'=2,'local'=4] {'local':(1)2}, to_apply=%add",
            # explicit device_ids (a reversed mesh): groups over 'node' pair position 7 with 3, ...
            "  %all-reduce.6 = f32[8]{0} all-reduce(%r), channel_id=4, "
            "replica_groups=mesh['node'=2,'local'=4], device_ids=(7,6,5,4,3,2,1,0) {'node'}, to_apply=%add",
            "  %all-reduce-done = f32[8]{0} all-reduce-done(%all-reduce-start)",
        ]
    )
    a2a, tuple_a2a, sub_axis, explicit = parse_hlo(text, mesh_2x4)
    assert (a2a.name, a2a.dtypes, a2a.result_bytes, a2a.cross_node) == ("all_to_all.1", ("u16",), 2048, True)
    assert len(tuple_a2a.shapes) == 8 and tuple_a2a.result_bytes == 8 * 8 * 20
    assert tuple_a2a.bytes_per_device == 7 / 8 * 1280
    assert sub_axis.groups == ((0, 2), (1, 3), (4, 6), (5, 7)) and not sub_axis.cross_node
    assert explicit.groups == ((7, 3), (6, 2), (5, 1), (4, 0)) and explicit.cross_node


def test_rejects_unknown_syntax_and_out_of_mesh_positions(mesh_2x4):
    with pytest.raises(ValueError, match="replica_groups"):
        parse_hlo("  %all-reduce = f32[4]{0} all-reduce(%x), replica_groups=<<0,1>>", mesh_2x4)
    with pytest.raises(ValueError, match="position"):
        parse_hlo("  %all-reduce = f32[4]{0} all-reduce(%x), replica_groups={{0,9}}", mesh_2x4)
    with pytest.raises(ValueError, match="stage"):
        list_collectives("", mesh=mesh_2x4, stage="optimised")


# --- real compiled steps ----------------------------------------------------------------------------


def _a2a_step(mesh, axis, precision, fp8_format="e4m3"):
    return jax.jit(
        jax.shard_map(
            lambda b: collectives.all_to_all(b, axis, precision, fp8_format), mesh=mesh, in_specs=SPEC, out_specs=SPEC
        )
    )


def _sharded(mesh, rows, d, dtype=np.float32):
    return jax.device_put(np.ones((rows, d), dtype), NamedSharding(mesh, SPEC))


def test_quantized_all_to_all_moves_narrow_bytes(mesh_2x4):
    """d=64: fp8 sends (64 + 1) / (4 * 64) = 0.25 of the fp32 bytes, bf16 and fp16 0.5, in ONE collective."""
    x = _sharded(mesh_2x4, 8 * 64, 64)  # 64 rows of d=64 per device
    moved = {}
    for precision, stage in [("fp32", "compiled"), ("fp8", "compiled"), ("bf16", "compiled"), ("fp16", "lowered")]:
        found = list_collectives(_a2a_step(mesh_2x4, LOCAL, precision), x, mesh=mesh_2x4, stage=stage)
        assert [c.kind for c in found] == ["all-to-all"], f"{precision}: payload and scales must share one a2a"
        moved[precision] = found[0]
    assert set(moved["fp32"].dtypes) == {"f32"}
    assert set(moved["fp8"].dtypes) == {"u8"} and set(moved["bf16"].dtypes) == {"u16"}
    assert moved["fp16"].dtypes == ("u16",)
    fp32_bytes = moved["fp32"].bytes_per_device
    assert fp32_bytes == 3 / 4 * 64 * 64 * 4  # (G-1)/G of the local block
    assert moved["fp8"].bytes_per_device / fp32_bytes == pytest.approx((64 + 1) / (4 * 64))
    assert moved["fp8"].bytes_per_device <= 0.3 * fp32_bytes
    assert moved["bf16"].bytes_per_device == 0.5 * fp32_bytes
    assert moved["fp16"].bytes_per_device == 0.5 * fp32_bytes


def test_cross_node_classification(mesh):
    """On every mesh: LOCAL never leaves a node; NODE and (NODE, LOCAL) do whenever there are 2+ nodes."""
    nodes, local = mesh.devices.shape
    x = _sharded(mesh, mesh.size * mesh.size, 8)

    def body(b):
        return (
            collectives.all_to_all(b, LOCAL),
            collectives.all_to_all(b, NODE),
            collectives.all_to_all(b, (NODE, LOCAL)),
        )

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=(SPEC,) * 3))
    found = {c.group_size: c for c in list_collectives(step, x, mesh=mesh) if c.kind == "all-to-all"}
    expected = {local: False, nodes: nodes > 1, nodes * local: nodes > 1}
    # XLA drops the all-to-all over an axis of size 1
    assert {size: c.cross_node for size, c in found.items()} == {s: c for s, c in expected.items() if s > 1}
    if local > 1:
        assert found[local].groups == tuple(tuple(range(n * local, (n + 1) * local)) for n in range(nodes))
    s = summarize(list(found.values()))
    assert (s["cross_node"] > 0) == (nodes > 1) and (s["intra_node"] > 0) == (local > 1)


def test_accepts_function_compiled_lowered_and_text(mesh_2x4):
    x = _sharded(mesh_2x4, 8 * 8, 16)
    step = _a2a_step(mesh_2x4, NODE, "fp8")
    lowered = step.lower(x)
    compiled = lowered.compile()
    views = [
        list_collectives(step, x, mesh=mesh_2x4),
        list_collectives(compiled, mesh=mesh_2x4),
        list_collectives(lowered, mesh=mesh_2x4),
        list_collectives(compiled.as_text(), mesh=mesh_2x4),
    ]
    assert all(v == views[0] for v in views)
    (c,) = views[0]
    assert isinstance(c, Collective) and c.cross_node and c.group_size == 2 and set(c.dtypes) == {"u8"}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the f32 upcast of bf16 collectives is XLA:CPU's")
def test_lowered_stage_shows_intended_dtype(mesh_2x4):
    """A plain (not bitcast) bf16 psum: CPU moves f32, the lowered HLO says what a GPU would move."""
    x = _sharded(mesh_2x4, 8, 8, jnp.bfloat16)
    step = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, NODE), mesh=mesh_2x4, in_specs=SPEC, out_specs=SPEC))
    (compiled,) = list_collectives(step, x, mesh=mesh_2x4, stage="compiled")
    (lowered,) = list_collectives(step, x, mesh=mesh_2x4, stage="lowered")
    assert compiled.kind == lowered.kind == "all-reduce"
    assert compiled.dtypes == ("f32",) and lowered.dtypes == ("bf16",)
    assert lowered.bytes_per_device == compiled.bytes_per_device / 2
    assert compiled.cross_node and lowered.cross_node


def test_gspmd_collectives_are_found(mesh_2x4):
    """Collectives that GSPMD inserts (mesh-axes or iota replica groups) span the sharded axes."""
    x = jax.device_put(np.ones((16, 8), np.float32), NamedSharding(mesh_2x4, SPEC))
    total = jax.jit(lambda v: jnp.sum(v, axis=0), out_shardings=NamedSharding(mesh_2x4, P()))
    (reduce,) = list_collectives(total, x, mesh=mesh_2x4)
    assert reduce.kind == "all-reduce" and reduce.groups == (tuple(range(8)),) and reduce.cross_node
    assert reduce.bytes_per_device == 2 * 7 / 8 * 8 * 4


def test_quantized_all_to_all_grad_moves_both_precisions(mesh_2x4):
    x = _sharded(mesh_2x4, 8 * 8, 64)

    def loss(v):
        y = jax.shard_map(
            lambda b: collectives.quantized_all_to_all(b, (NODE, LOCAL), "fp8", "bf16"),
            mesh=mesh_2x4,
            in_specs=SPEC,
            out_specs=SPEC,
        )(v)
        return jnp.sum(y**2)

    found = [c for c in list_collectives(jax.grad(loss), x, mesh=mesh_2x4) if c.kind == "all-to-all"]
    assert sorted(set(c.dtypes) for c in found) == sorted([{"u8"}, {"u16"}])
    assert all(c.group_size == 8 and c.cross_node for c in found)
