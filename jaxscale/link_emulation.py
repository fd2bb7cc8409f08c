"""The emulated cluster's links (experiments/scaling/emulate.sh): `tc` rates, the token bucket that reaches
them, and the seconds a rate-limited link adds to a step's collectives (pure Python, no JAX).

Nodes are network namespaces whose veth egress `tc tbf` limits to a rate; JAX's CPU transport (gloo)
sends, then receives, so without a measurement an exchange costs (sent + received) / rate: the
'exchange rule', factor GLOO_DIRECTIONS. A measured factor per collective kind and device group (the
gloo_duplex.py run) replaces it.
"""

from __future__ import annotations

from jaxscale import comm_model as cm
from jaxscale.cluster import ClusterSpec

KERNEL_HZ = 250  # tbf needs a bucket of at least rate / HZ bytes to reach its rate
GLOO_DIRECTIONS = 2  # gloo sends, then receives: an exchange costs (sent + received) / rate
KIND_NAMES = {"all-to-all": "all_to_all", "all-reduce": "all_reduce", "all-gather": "all_gather"}


def rate_bytes(rate: str) -> float:
    """tc rate string ('800kbit', '4mbit', '1gbit') -> bytes/s."""
    for unit, factor in (("kbit", 1e3 / 8), ("mbit", 1e6 / 8), ("gbit", 1e9 / 8)):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"rate must end in kbit, mbit or gbit, got {rate!r}")


def tbf_burst(rate: str) -> int:
    """The smallest token bucket that still reaches `rate` (bytes). A larger one lets each collective that
    starts after an idle gap send a bucketful unlimited, which hides part of its time."""
    return max(3000, int(rate_bytes(rate) / KERNEL_HZ))


def bytes_by_category(collectives: list[dict]) -> dict:
    """{category: (intra, inter)} bytes per device per step of a step's collectives (each a dict with
    'category', 'intra', 'inter' and 'per_step')."""
    out: dict[str, list[float]] = {}
    for c in collectives:
        acc = out.setdefault(c["category"], [0.0, 0.0])
        acc[0] += c["intra"] * c["per_step"]
        acc[1] += c["inter"] * c["per_step"]
    return {k: tuple(v) for k, v in out.items()}


def transport_key(collective: dict) -> str:
    """The gloo_duplex.py measurement that matches a step collective: kind @ device group."""
    kind = KIND_NAMES.get(collective["kind"], "exchange")
    return f"{kind}@{'node' if collective['group'] == 'node' else 'all'}"


def predicted_delta(collectives: list[dict], local: int, rate: str, factors: dict | None = None) -> float:
    """Seconds a link limited to `rate` per node adds to a step, from the compiled bytes.

    The alpha-beta model of `jaxscale.comm_model` on the emulated cluster: a node's NIC is its veth at
    `rate`, shared by its `local` devices; latency is already in the unlimited step. Each collective's
    cross-node bytes take `factor` x bytes / rate, the factor of its kind and device group as measured
    (`factors`, e.g. {'all_to_all@all': 1.6}); without a measurement, the exchange rule (factor 2).
    """
    total = 0.0
    for c in collectives:
        if c["inter"] == 0:
            continue
        factor = (factors or {}).get(transport_key(c)) or GLOO_DIRECTIONS
        cluster = ClusterSpec(
            2, local, inter_node_bandwidth=rate_bytes(rate) / factor, intra_node_latency=0.0, inter_node_latency=0.0
        )
        total += c["per_step"] * cm.seconds(cm.Traffic(inter_bytes=c["inter"]), cluster)
    return total
