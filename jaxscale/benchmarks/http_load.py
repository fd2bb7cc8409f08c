"""Open-loop HTTP load for the serving benchmarks (`experiments/sequences/bench_serving.py`) and their tests.

Open loop: request i is due at ``start + i / rate`` and is sent then whatever happened to the ones before it;
its latency is measured from that due time, so queueing (a slow server, a busy connection pool) shows in the
percentiles instead of silently lowering the rate (no coordinated omission). The client is aiohttp's (asyncio,
keep-alive connections). Each rate runs ``rounds`` times, round-robin over the rates; a rate's record holds the
percentiles over all rounds, each round's, the worst round's p99 and the CPU time per request of the measured
server processes (from /proc) and of this client.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import numpy as np

P99_TARGET_MS = 10.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process (all its threads) has used, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


async def _open_loop(url: str, requests: list[tuple], rate: float, connections: int, pids: dict) -> dict:
    """One open-loop round; ``pids`` = {name: pid} of the server processes whose CPU time is measured."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=connections, force_close=False)
    timeout = aiohttp.ClientTimeout(total=30)
    latencies = np.full(len(requests), np.nan)
    statuses = np.zeros(len(requests), np.int32)
    sizes = np.zeros(len(requests), np.int64)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:

        async def one(i: int, due: float) -> None:
            method, path, body, headers = requests[i]
            try:
                async with session.request(method, path, data=body, headers=headers) as resp:
                    data = await resp.read()
                    statuses[i] = resp.status
                    sizes[i] = data.count(b'"ts":')
            except (TimeoutError, aiohttp.ClientError):
                statuses[i] = -1
            latencies[i] = time.perf_counter() - due

        # open every connection first (a warm pool, as a long-running client has)
        warm = [requests[i % len(requests)] for i in range(connections)]
        await asyncio.gather(*(_fire(session, r) for r in warm))
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        client0 = time.process_time()
        start = time.perf_counter() + 0.05
        tasks = []
        for i in range(len(requests)):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, due)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
        cpu["client"] = time.process_time() - client0
    return {
        "requests": len(requests),
        "elapsed_s": elapsed,
        "latency_ms": latencies * 1000,
        "statuses": statuses,
        "events": sizes,
        "cpu_ms_per_request": {name: round(sec * 1000 / len(requests), 3) for name, sec in cpu.items()},
    }


def _summary(rate: float, rounds: list[dict]) -> dict:
    """One rate's record: percentiles over all rounds' requests, and each round's own."""
    ms = np.concatenate([r["latency_ms"] for r in rounds])
    statuses = np.concatenate([r["statuses"] for r in rounds])
    sizes = np.concatenate([r["events"] for r in rounds])
    ok = statuses == 200
    per_round = [
        {
            "p50_ms": round(float(np.percentile(r["latency_ms"], 50)), 3),
            "p99_ms": round(float(np.percentile(r["latency_ms"], 99)), 3),
            "max_ms": round(float(r["latency_ms"].max()), 3),
            "errors": int((r["statuses"] != 200).sum()),
            "achieved_rps": round(r["requests"] / r["elapsed_s"], 1),
            "cpu_ms_per_request": r["cpu_ms_per_request"],
        }
        for r in rounds
    ]
    cpu_names = rounds[0]["cpu_ms_per_request"]
    return {
        "target_rps": rate,
        "requests": int(len(ms)),
        "achieved_rps": round(len(ms) / sum(r["elapsed_s"] for r in rounds), 1),
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "max_ms": round(float(ms.max()), 3),
        "worst_round_p99_ms": max(r["p99_ms"] for r in per_round),
        "errors": int((~ok).sum()),
        "status_counts": {str(s): int(c) for s, c in zip(*np.unique(statuses, return_counts=True))},
        "mean_events": round(float(sizes[ok].mean()), 1) if ok.any() else None,
        "cpu_ms_per_request": {
            name: round(float(np.median([r["cpu_ms_per_request"][name] for r in per_round])), 3) for name in cpu_names
        },  # the median round's, per process
        "rounds": per_round,
    }


async def _fire(session, request) -> None:
    method, path, body, headers = request
    async with session.request(method, path, data=body, headers=headers) as resp:
        await resp.read()


def load(
    url: str, requests: list[tuple], rates, seconds: float, connections: int, rounds: int = 1, pids: dict = None
) -> dict:
    """``rounds`` open-loop runs per rate (``rate * seconds`` requests each, cycling through ``requests``), the
    rounds going round-robin over the rates; ``pids`` = {name: pid} of server processes to measure CPU time of."""
    pids = pids or {}
    done = {rate: [] for rate in rates}
    for k in range(rounds):
        for rate in rates:
            n = int(rate * seconds)
            plan = [requests[(k * n + i) % len(requests)] for i in range(n)]
            r = asyncio.run(_open_loop(url, plan, float(rate), connections, pids))
            done[rate].append(r)
            ms = r["latency_ms"]
            print(
                f"  round {k + 1}/{rounds} {rate} req/s: p50 {np.percentile(ms, 50):.2f} ms, "
                f"p99 {np.percentile(ms, 99):.2f} ms, max {ms.max():.2f} ms, errors {(r['statuses'] != 200).sum()}, "
                f"CPU ms/request {r['cpu_ms_per_request']}, load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    runs = [_summary(float(rate), done[rate]) for rate in rates]
    passing = [r["target_rps"] for r in runs if r["p99_ms"] <= P99_TARGET_MS and r["errors"] == 0]
    every = [r["target_rps"] for r in runs if r["worst_round_p99_ms"] <= P99_TARGET_MS and r["errors"] == 0]
    return {
        "runs": runs,
        "rounds": rounds,
        "best_rate_p99_le_10ms": max(passing) if passing else None,
        "best_rate_every_round_p99_le_10ms": max(every) if every else None,
        "threads": {
            **{name: thread_count(pid) for name, pid in pids.items()},
            "client": threading.active_count(),
        },
    }
