"""Feature trimmer benchmark: bytes per leaf request and over the fan-out, raw and compressed, trimmed vs
untrimmed, through real root/leaf HTTP servers on 127.0.0.1; and the root's trimming CPU time against the
request's serialization cost.

    python experiments/serving/bench_trimmer.py                 # writes results.json and RESULTS.md here
    python experiments/serving/bench_trimmer.py --requests 40   # quicker
    python experiments/serving/bench_trimmer.py --render-only   # re-render RESULTS.md from results.json

Workload (`jaxscale.serving.demo`): 200 shared features (dense floats: counters, ratios, flags, embeddings; id
lists of 5-100 ids; single ids), 3 models x 2 versions each reading 20-60 of them (ctr/1 also declares 3 it never
reads), requests of log-normal batch size (median 64 candidates, clipped to [1, 512]) carrying all 200 features.

Bytes: six roots (uncompressed / lz4 / zstd x trimmed / untrimmed) over the same six leaves; every request goes
through all six (order rotated); the root reports the body bytes it sent each leaf (response header, cross-checked
against its /metrics counters), and the outputs of trimmed and untrimmed roots must be bit-identical (the run
fails otherwise).

CPU: in process, per request, interleaved and repeated (median of repeats), process CPU time of
(a) trimming: reading dtypes/shapes from the Arrow schema, checking every leaf's signature, choosing and selecting
each leaf's columns (`plan_fanout` + `trim_batch`), and (b) serializing the whole request once to the wire format
(`wire.encode`), the least any root does per request. The target is (a) < 5% of (b).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from jaxscale.benchmarks.trimmer_report import COMPRESSIONS, kinds_of, machine, render

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

BUCKETS = (8, 16, 32, 64, 128, 256, 512)


def post(url: str, body: bytes, media: str):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": media}, method="POST")
    with urllib.request.urlopen(req, timeout=600) as r:
        return dict(r.headers), r.read()


# ------------------------------------------------------------------------------------------------------ running


def start_servers(store: Path, keys):
    from jaxscale.serving.leaf import Leaf, LeafConfig
    from jaxscale.serving.root import LeafAddress, Root, RootConfig

    leaves = {k: Leaf(LeafConfig(store, *k, batch_buckets=BUCKETS, warmup=True)).start() for k in keys}
    addresses = tuple(LeafAddress(m, v, leaf.url) for (m, v), leaf in leaves.items())
    roots = {}
    for comp in COMPRESSIONS:
        for trim in (True, False):
            cfg = RootConfig(
                store, addresses, trim=trim, compression=None if comp == "none" else comp, leaf_timeout_s=600
            )
            roots[(comp, trim)] = Root(cfg).start()
    return leaves, roots


def run_http(roots, requests, bodies, used) -> tuple[list[dict], dict]:
    """Every request through every root; per request and root: per-leaf body bytes and wall time. Checks that
    outputs are bit-identical across roots and that trimmed roots sent each leaf exactly its ``used`` features."""
    from jaxscale.serving import wire
    from jaxscale.serving.root import FANOUT_HEADER

    configs = list(roots)
    records, mismatches, feature_count_errors = [], 0, 0
    for i, body in enumerate(bodies):
        rec = {"batch": int(next(iter(requests[i].values())).shape[0]), "request_bytes": len(body), "roots": {}}
        outputs = {}
        for j in range(len(configs)):
            comp, trim = configs[(i + j) % len(configs)]
            t0 = time.perf_counter()
            headers, data = post(roots[(comp, trim)].url + "/predict", body, wire.MEDIA_TYPE)
            wall = time.perf_counter() - t0
            fanout = json.loads(headers[FANOUT_HEADER])
            rec["roots"][f"{comp}/{'trim' if trim else 'full'}"] = {
                "wall_s": round(wall, 6),
                "bytes": {k: v["bytes"] for k, v in fanout.items()},
            }
            expected = {k: len(used[k]) if trim else None for k in fanout}
            feature_count_errors += sum(v["features"] != expected[k] for k, v in fanout.items())
            outputs[(comp, trim)] = data
        reference = outputs[configs[0]]
        mismatches += sum(data != reference for data in outputs.values())  # same Arrow bytes = same bits
        records.append(rec)
        if (i + 1) % 20 == 0:
            print(f"  {i + 1}/{len(bodies)} requests", flush=True)
    counters = {
        f"{comp}/{'trim' if trim else 'full'}": root.metrics.snapshot()["leaf_request_bytes"]
        for (comp, trim), root in roots.items()
    }
    checks = {"output_mismatches": mismatches, "feature_count_errors": feature_count_errors}
    return records, {**checks, "root_byte_counters": counters}


def _cpu_ns(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.process_time_ns()
        fn()
        samples.append(time.process_time_ns() - t0)
    return float(statistics.median(samples))


def run_cpu(store: Path, keys, requests, repeats: int) -> list[dict]:
    """Per request, process CPU time (ns, median of repeats, interleaved) of: trimming with the root's planner
    warm (the steady state: this request's schema was seen before), trimming cold (schema read and every
    signature checked), and serializing (whole request from its arrays; re-encoding the built Arrow batch; the
    six trimmed payloads). The HTTP servers are idle meanwhile."""
    from jaxscale.serving import wire
    from jaxscale.serving.routes import RouteTable
    from jaxscale.serving.trim import FanoutPlanner, plan_fanout, trim_batch

    routes = RouteTable(store, keys).current()
    planner = FanoutPlanner()
    out = []
    for request in requests:
        batch = wire.to_record_batch(request)
        planner.plan(batch, routes, keys)  # warm: the root has seen this schema

        def trim_warm(batch=batch):
            return [trim_batch(batch, p) for p in planner.plan(batch, routes, keys)]

        def trim_cold(batch=batch):
            return [trim_batch(batch, p) for p in plan_fanout(wire.describe(batch), routes, keys)]

        subs = trim_warm()
        timers = {"trim_ns": trim_warm, "trim_cold_ns": trim_cold}
        for c in COMPRESSIONS:
            comp = None if c == "none" else c
            timers[f"serialize_arrays_ns/{c}"] = lambda comp=comp, r=request: wire.encode(wire.to_record_batch(r), comp)
            timers[f"serialize_ns/{c}"] = lambda comp=comp, b=batch: wire.encode(b, comp)
            timers[f"serialize_trimmed_fanout_ns/{c}"] = lambda comp=comp, s=subs: [wire.encode(x, comp) for x in s]
        samples = {k: [] for k in timers}
        for _ in range(repeats):  # interleaved, so load changes hit every measurement alike
            for k, fn in timers.items():
                samples[k].append(_cpu_ns(fn, 3 if k.startswith("trim") else 1))
        rec = {"batch": batch.num_rows}
        for k, v in samples.items():
            name, _, comp = k.partition("/")
            if comp:
                rec.setdefault(name, {})[comp] = statistics.median(v)
            else:
                rec[name] = statistics.median(v)
        out.append(rec)
    return out


def run(args) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxscale.serving import demo, wire
    from jaxscale.serving.signature import Signature
    from jaxscale.serving.store import signature_path

    result = {"command": "python experiments/serving/bench_trimmer.py " + " ".join(sys.argv[1:]), "machine": machine()}
    t_start = time.time()
    rng = np.random.default_rng(args.seed)
    universe = demo.feature_universe(seed=args.seed)
    sizes = demo.batch_sizes(args.requests, rng)
    requests = [demo.make_request(universe, int(b), rng) for b in sizes]
    bodies = [wire.encode(r) for r in requests]
    with tempfile.TemporaryDirectory(prefix="bench-trimmer-") as tmp:
        store = Path(tmp)
        print("exporting 6 model versions ...", flush=True)
        demo.export_demo(store, seed=args.seed)
        keys = list(demo.MODEL_SPECS)
        sigs = {f"{m}/{v}": Signature.load(signature_path(store, m, v)) for m, v in keys}
        result["models"] = {
            k: {"declared": len(s.features), "used": len(s.required), "unused": list(s.unused)} for k, s in sigs.items()
        }
        result["universe"] = {"features": len(universe), "kinds": kinds_of(universe)}
        print("starting 6 leaves (compiling batch buckets) and 6 roots ...", flush=True)
        leaves, roots = start_servers(store, keys)
        try:
            print(f"sending {len(bodies)} requests through every root ...", flush=True)
            used = {k: s.required for k, s in sigs.items()}
            result["http"], checks = run_http(roots, requests, bodies, used)
            result.update(checks)
        finally:
            for r in roots.values():
                r.stop()
            for leaf in leaves.values():
                leaf.stop()
        print("timing trimming vs serialization ...", flush=True)
        cpu_requests = requests[: args.cpu_requests]
        result["cpu"] = run_cpu(store, keys, cpu_requests, args.repeats)
    result["wall_s"] = time.time() - t_start
    result["loadavg_at_end"] = os.getloadavg()
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--cpu-requests", type=int, default=60, help="requests timed for trimming vs serialization")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=HERE / "results.json")
    p.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--render-only", action="store_true", help="re-render --out from --json")
    args = p.parse_args(argv)
    if args.render_only:
        result = json.loads(args.json.read_text())
    else:
        result = run(args)
        args.json.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    text = render(result)
    args.out.write_text(text)
    print(text)
    if result["output_mismatches"] or result["feature_count_errors"]:
        raise SystemExit(
            f"{result['output_mismatches']} outputs differ between trimmed and untrimmed roots; "
            f"{result['feature_count_errors']} leaf requests carried other features than their signature's"
        )


if __name__ == "__main__":
    main()
