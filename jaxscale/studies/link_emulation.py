"""The emulated cluster's links (experiments/scaling/emulate.sh): `tc` rates, the token bucket that reaches
them, and the seconds a rate-limited link adds to a step's collectives (pure Python, no JAX).

Nodes are network namespaces whose veth egress `tc tbf` limits to a rate; JAX's CPU transport (gloo)
sends, then receives, so without a measurement an exchange costs (sent + received) / rate: the
'exchange rule', factor GLOO_DIRECTIONS. A measured factor per collective kind and device group (the
gloo_duplex.py run) replaces it.
"""

from __future__ import annotations

import collections
import os
import selectors
import time

from jaxscale.engine import comm_model as cm
from jaxscale.engine.cluster import ClusterSpec

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

    The alpha-beta model of `jaxscale.engine.comm_model` on the emulated cluster: a node's NIC is its veth at
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


# ------------------------------------------------------------------------------------------ delay line
#
# These kernels have no netem (and no fq for earliest-departure-time pacing), so the emulated cluster adds
# its one-way delay in user space: every node's only route to the others is a TUN device, and one process
# (`experiments/scaling/delay_link.py`) reads each IPv4 packet a node sends, holds it `delay` seconds and
# writes it into the destination node's TUN device. The rate limit stays in the kernel (tc tbf on the TUN
# egress, before the delay, as a NIC serialises before the wire's propagation delay).

IPV4_DST = slice(16, 20)  # the destination address inside an IPv4 header


class DelayLine:
    """Packets held for a fixed delay, released in arrival order (a constant delay keeps FIFO order).

    `push(now, dst, packet)`; `due(now)` pops the packets whose time has come; `wait(now)` is the seconds
    until the next one (None when empty). Pure: the caller supplies the clock, so tests need no sleep.
    """

    def __init__(self, delay_s: float):
        if not delay_s >= 0:
            raise ValueError(f"DelayLine: delay must be >= 0 seconds, got {delay_s!r}")
        self.delay_s = float(delay_s)
        self._queue: collections.deque = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, now: float, dst, packet: bytes) -> None:
        self._queue.append((now + self.delay_s, dst, packet))

    def due(self, now: float) -> list:
        out = []
        while self._queue and self._queue[0][0] <= now:
            _, dst, packet = self._queue.popleft()
            out.append((dst, packet))
        return out

    def wait(self, now: float) -> float | None:
        return max(0.0, self._queue[0][0] - now) if self._queue else None


def run_delay_line(fds: dict[bytes, int], delay_s: float, stop=None, clock=time.monotonic) -> dict:
    """Forwards IPv4 packets between `fds` ({4-byte address: fd of the device that address lives behind})
    after `delay_s`, until `stop()` is true (checked at least every 50 ms). A packet to an address no fd
    serves, or not IPv4 (the kernel's IPv6 router solicitations), is counted in 'unroutable' and dropped;
    returns the counts."""
    line = DelayLine(delay_s)
    reader = {fd: addr for addr, fd in fds.items()}
    counts = {"packets": 0, "bytes": 0, "unroutable": 0}
    with selectors.DefaultSelector() as sel:
        for fd in reader:
            sel.register(fd, selectors.EVENT_READ)
        while stop is None or not stop():
            wait = line.wait(clock())
            for key, _ in sel.select(0.05 if wait is None else min(wait, 0.05)):
                packet = os.read(key.fd, 65536)
                dst = fds.get(bytes(packet[IPV4_DST])) if packet and packet[0] >> 4 == 4 else None
                if dst is None:
                    counts["unroutable"] += 1
                    continue
                line.push(clock(), dst, packet)
            for dst, packet in line.due(clock()):
                os.write(dst, packet)
                counts["packets"] += 1
                counts["bytes"] += len(packet)
    return counts


# ------------------------------------------------------------------------------------------ a-priori step


RING_STEPS = {"all_reduce": lambda g: 2 * (g - 1), "all_gather": lambda g: g - 1}


def _ring_steps(name: str, devices: int) -> int:
    """Sequential ring steps of an a2a_latency.py collective over `devices` (XLA:CPU runs a flat ring over
    the whole group, and one ring per operand of a tuple all-reduce)."""
    if name == "all_reduce_8_operands":
        return 8 * RING_STEPS["all_reduce"](devices)
    return RING_STEPS[name](devices)


def fit_latency(rows: list[dict]) -> dict:
    """The emulated link's message latencies, from a2a_latency.py lines at delay 0 and at one delay D > 0.

    The delay's share of a collective is its median at D minus its median at 0 (the transport's own CPU
    time cancels). Grouped all-to-all (one device per node, p inter-node peers): a least-squares line
    L(p) = alpha (1 + (p - 1) c) gives alpha, one message's latency, and c, the extra-message cost of
    `ClusterSpec.a2a_extra_message_cost` (clipped to [0, 1]; 1 = additive, 0 = one latency whatever p).
    Ring collectives (all-reduce, all-gather, a tuple all-reduce, any devices per node): the share per
    sequential ring step; `ring_step_s` is their median. Refuses data that cannot give these."""
    runs: dict[tuple, dict] = {}
    for r in rows:
        if r.get("run") == "a2a_latency":
            runs[(float(r["delay_ms"]), int(r["nodes"]), int(r["local"]))] = r
    delays = sorted({d for d, _, _ in runs if d > 0})
    if not any(d == 0 for d, _, _ in runs) or len(delays) != 1:
        found = sorted({d for d, _, _ in runs})
        raise ValueError(f"fit_latency: needs runs at delay 0 and at one delay > 0, got delays {found}")
    delay = delays[0]
    pairs = sorted((n, m) for d, n, m in runs if d == delay and (0.0, n, m) in runs)
    points, ring = [], []
    for n, m in pairs:
        hi, lo = runs[(delay, n, m)], runs[(0.0, n, m)]
        share = {k[: -len("_median_s")]: hi[k] - lo[k] for k in hi if k.endswith("_median_s") and k in lo}
        if m == 1 and "all_to_all" in share:
            points.append({"nodes": n, "inter_node_peers": n - 1, "all_to_all_s": share["all_to_all"],
                           "permute_s": share.get("permute", float("nan"))})  # fmt: skip
        for name in ("all_reduce", "all_gather", "all_reduce_8_operands"):
            if name in share:
                steps = _ring_steps(name, n * m)
                ring.append({"nodes": n, "local": m, "collective": name, "steps": steps, "share_s": share[name],
                             "per_step_s": share[name] / steps})  # fmt: skip
    if len(points) < 2:
        raise ValueError(f"fit_latency: needs >= 2 node counts with one device per node at both delays, got {pairs}")
    x = [q["inter_node_peers"] - 1 for q in points]
    y = [q["all_to_all_s"] for q in points]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)
    alpha = my - slope * mx
    if alpha <= 0:
        raise ValueError(f"fit_latency: the fitted one-message latency is {alpha:.3g} s; the delay did not show")
    cost = min(1.0, max(0.0, slope / alpha))
    per_step = sorted(q["per_step_s"] for q in ring)
    return {
        "delay_ms": delay,
        "alpha_s": alpha,
        "slope_s_per_peer": slope,
        "a2a_extra_message_cost": cost,
        "points": points,
        "additive_prediction_s": [alpha * (1 + xi) for xi in x],
        "fitted_prediction_s": [alpha * (1 + xi * cost) for xi in x],
        "ring": ring,
        "ring_step_s": per_step[len(per_step) // 2] if per_step else alpha,
    }


def _group_members(group: str, nodes: int, local: int) -> tuple[int, int]:
    """(intra-node peers, nodes spanned) of a recorded collective's device group."""
    if group == "local":
        return local - 1, 1
    if group == "node":
        return 0, nodes
    return local - 1, nodes


def emulated_comm(c: dict, nodes: int, local: int, factors: dict | None, phase: str) -> cm.Comm:
    """One recorded collective of bench_step.py as a `comm_model.Comm` on the emulated cluster, with the
    messages the emulated transport sends (measured by a2a_latency.py): an all-to-all posts one message
    per peer at once; XLA:CPU runs an all-reduce as a flat ring of 2(G-1) steps over its G devices and an
    all-gather as G-1, one ring after another for each operand of a tuple, every step waiting for the
    slowest (cross-node) hop. Cross-node bytes are the compiled ones times the transport factor measured
    for the kind and group (gloo_duplex.py)."""
    intra_peers, k = _group_members(c["group"], nodes, local)
    m = intra_peers + 1
    g = m * k
    factor = (factors or {}).get(transport_key(c)) or GLOO_DIRECTIONS
    if c["kind"] == "all-to-all":
        msgs, concurrent = (intra_peers, (k - 1) * m), True
    else:
        steps = c.get("operands", 1) * (g - 1 if c["kind"] == "all-gather" else 2 * (g - 1))
        msgs, concurrent = ((0, steps) if c["inter"] else (steps, 0)), False
    traffic = cm.Traffic(
        intra_bytes=c["intra"],
        inter_bytes=c["inter"] * factor,
        intra_messages=msgs[0] if c["intra"] else 0,
        inter_messages=msgs[1] if c["inter"] else 0,
        concurrent=concurrent,
    )
    return cm.Comm(c["category"], c["kind"], phase, traffic, payload_bytes=c["intra"] + c["inter"])


def step_phases(collectives: list[dict]) -> list[str]:
    """The `comm_model` phase of each recorded collective, in program order: the dense gradients 'dense';
    the replica sync and every embedding exchange after the dense gradients 'backward'; the rest
    (ids, rows, the negative pool, scalars) 'forward'."""
    dense_at = next((i for i, c in enumerate(collectives) if c["category"] == "dense_grad"), len(collectives))
    out = []
    for i, c in enumerate(collectives):
        if c["category"] == "dense_grad":
            out.append("dense")
        elif c["category"] == "replica_sync" or (c["category"].startswith("emb_") and i > dense_at):
            out.append("backward")
        else:
            out.append("forward")
    return out


def emulated_cluster(
    nodes: int, local: int, rate: str | None, latency_s: float, extra_message_cost: float = 1.0
) -> ClusterSpec:
    """The emulated cluster as a `ClusterSpec`: a node's NIC at `rate` (None: unlimited), `latency_s` per
    cross-node message; inside a node the devices share one process's memory (no cost)."""
    return ClusterSpec(
        nodes,
        local,
        intra_node_bandwidth=1e15,
        inter_node_bandwidth=rate_bytes(rate) if rate else 1e15,
        intra_node_latency=0.0,
        inter_node_latency=latency_s,
        a2a_extra_message_cost=extra_message_cost,
    )


def predicted_step(collectives: list[dict], cluster: ClusterSpec, compute_s: float, factors: dict | None) -> float:
    """Mean seconds of an emulated step by `comm_model.step_time` (latency, overlap of the dense all-reduce
    with the backward pass, link sharing included). A periodic collective (per_step 1/k) runs on one step in
    k: the mean is the step without it plus 1/k of what it adds."""
    nodes, local = cluster.nodes, cluster.devices_per_node
    phases = step_phases(collectives)
    every = [emulated_comm(c, nodes, local, factors, p) for c, p in zip(collectives, phases) if c["per_step"] >= 1]
    base = cm.step_time(every, cluster, compute_s).total
    mean = base
    for c, p in zip(collectives, phases):
        if c["per_step"] < 1:
            with_it = cm.step_time([*every, emulated_comm(c, nodes, local, factors, p)], cluster, compute_s).total
            mean += (with_it - base) * c["per_step"]
    return mean


def compute_for(collectives: list[dict], cluster: ClusterSpec, step_s: float, factors: dict | None) -> float:
    """The compute per step with which `predicted_step` on `cluster` equals a measured `step_s` (bisection:
    the predicted step grows with compute). 0 when the communication alone already takes longer."""
    if predicted_step(collectives, cluster, 0.0, factors) >= step_s:
        return 0.0
    lo, hi = 0.0, step_s
    for _ in range(60):
        mid = (lo + hi) / 2
        if predicted_step(collectives, cluster, mid, factors) < step_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
