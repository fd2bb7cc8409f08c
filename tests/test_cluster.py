"""ClusterSpec: loading meshes/*.yaml, derived link figures, validation errors that name the field."""

import dataclasses

import pytest

from jaxscale.engine.cluster import ClusterSpec, known_clusters
from jaxscale.engine.mesh import Topology


def test_every_preset_loads_with_its_shape_and_sourced_links():
    names = known_clusters()
    assert {"1x8", "2x4", "4x2", "8x8", "64x8"} <= set(names)
    for name in names:
        spec = ClusterSpec.named(name)
        nodes, local = map(int, name.split("x"))
        assert (spec.nodes, spec.devices_per_node, spec.name) == (nodes, local, name)
        assert spec.intra_node_bandwidth == 450e9  # NVLink 4: 900 GB/s bidirectional per H100
        assert spec.inter_node_bandwidth == 400e9 / 8  # one 400 Gbit/s NIC per node
        assert spec.intra_node_latency == 3e-6 and spec.inter_node_latency == 10e-6
        assert spec.device_memory_bytes == 80e9 and spec.efficiency == 1.0


def test_nic_is_shared_by_the_node_and_efficiency_scales_both_links():
    spec = ClusterSpec(8, 8, inter_node_bandwidth=100e9 / 8, efficiency=0.5)
    assert spec.devices == 64
    assert spec.inter_bandwidth_per_device == pytest.approx(12.5e9 * 0.5 / 8)
    assert spec.intra_bandwidth_per_device == pytest.approx(450e9 * 0.5)


def test_topology_comes_from_mesh_topology():
    spec = ClusterSpec.named("2x4")
    for name in ("1d", "2d_ar", "2d_a2a"):
        assert spec.topology(name) == Topology(name, 2, 4)
    with pytest.raises(ValueError, match="topology"):
        spec.topology("3d")


def test_overrides_and_with_nodes():
    spec = ClusterSpec.named("8x8", inter_node_bandwidth=3200e9 / 8)
    assert spec.inter_node_bandwidth == 400e9 and spec.nodes == 8
    bigger = spec.with_nodes(64)
    assert bigger.nodes == 64 and bigger.inter_node_bandwidth == 400e9
    assert dataclasses.replace(bigger, nodes=8) == dataclasses.replace(spec, name=bigger.name)


def test_from_yaml_path_and_unit_conversion(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "nodes: 3\ndevices_per_node: 2\ndevice_memory_gb: 24\nintra_node_bandwidth_gbytes_per_s: 64\n"
        "inter_node_bandwidth_gbit_per_s: 100\nintra_node_latency_us: 2\ninter_node_latency_us: 25\n"
        "efficiency: 0.8\n"
    )
    spec = ClusterSpec.from_yaml(path)
    assert spec == ClusterSpec(3, 2, 24e9, 64e9, 12.5e9, 2e-6, 25e-6, 0.8, name="mine")
    assert ClusterSpec.from_yaml(str(path)) == spec


@pytest.mark.parametrize(
    "text,match",
    [
        ("nodes: 2\ndevices_per_node: 4\nnics: 2\n", "nics"),
        ("nodes: 0\ndevices_per_node: 4\n", "nodes"),
        ("nodes: 2\ndevices_per_node: 2.5\n", "devices_per_node"),
        ("nodes: 2\ndevices_per_node: 4\ninter_node_bandwidth_gbit_per_s: -1\n", "inter_node_bandwidth"),
        ("nodes: 2\ndevices_per_node: 4\ninter_node_latency_us: fast\n", "inter_node_latency_us"),
        ("nodes: 2\ndevices_per_node: 4\nefficiency: 1.5\n", "efficiency"),
        ("nodes: 2\n", "devices_per_node"),
        ("- 2\n- 4\n", "mapping"),
        ("nodes: [2\n", "YAML"),
    ],
)
def test_bad_yaml_names_the_field_and_the_file(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        ClusterSpec.from_yaml(path)
    assert "bad.yaml" in str(e.value)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(nodes=0, devices_per_node=8), "nodes"),
        (dict(nodes=1, devices_per_node=True), "devices_per_node"),
        (dict(nodes=1, devices_per_node=8, device_memory_bytes=-1), "device_memory_bytes"),
        (dict(nodes=1, devices_per_node=8, intra_node_bandwidth=0), "intra_node_bandwidth"),
        (dict(nodes=1, devices_per_node=8, inter_node_bandwidth=float("inf")), "inter_node_bandwidth"),
        (dict(nodes=1, devices_per_node=8, inter_node_latency=-1e-6), "inter_node_latency"),
        (dict(nodes=1, devices_per_node=8, efficiency=0), "efficiency"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ClusterSpec(**kwargs)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="2x4"):
        ClusterSpec.named("3x3")
    with pytest.raises(ValueError, match="does not exist"):
        ClusterSpec.from_yaml("/nonexistent/cluster.yaml")
