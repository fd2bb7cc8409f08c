"""The shipped example through the CLI: make_events, compile, backfill, stream, serve (each a subprocess)."""

import http.client
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from jaxscale.sequences.examples import SequenceBatches
from jaxscale.sequences.store import read_sequence

REPO = Path(__file__).resolve().parents[1]


def _run(*args, check=True):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, cwd=REPO)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_example_end_to_end(tmp_path):
    _run(
        "experiments/sequences/make_events.py",
        "--out",
        str(tmp_path / "data"),
        "--events",
        "20000",
        "--days",
        "3",
        "--rows-per-file",
        "4000",
    )
    _run(
        "-m",
        "jaxscale.sequences",
        "compile",
        "experiments/sequences/engagement.py",
        "--out",
        str(tmp_path / "defs.json"),
    )
    common = [
        "--defs",
        str(tmp_path / "defs.json"),
        "--events",
        str(tmp_path / "data" / "events"),
        "--items",
        str(tmp_path / "data" / "items.parquet"),
    ]
    r = _run("-m", "jaxscale.sequences", "backfill", *common, "--out", str(tmp_path / "store"))
    report = json.loads(r.stdout)
    assert report["totals"]["bad_rows"] > 0 and "bad rows skipped" in r.stderr  # make_events injects a few
    assert report["totals"]["filtered_event_type"] > 0 and len(report["partitions"]["engagement"]) >= 3
    r = _run("-m", "jaxscale.sequences", "stream", *common, "--out", str(tmp_path / "stream"), "--micro-batch", "1500")
    assert json.loads(r.stdout)["micro_batches"] == 14
    a, b = read_sequence(tmp_path / "store", "engagement"), read_sequence(tmp_path / "stream", "engagement")
    assert a.equals(b) and a.num_rows == report["totals"]["indexed"]["engagement"]
    cats = a.column("category").to_numpy()
    assert (cats == -1).any() and (cats >= 0).mean() > 0.9  # a few items are missing from the items table

    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxscale.sequences", "serve", "--store", str(tmp_path / "store"), "--port", "0"],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(re.search(r":(\d+) ", proc.stdout.readline()).group(1))
        user = int(a.column("user_id")[0].as_py())
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", f"/v1/users/{user}/sequences/engagement?limit=300")
        body = json.loads(conn.getresponse().read())
        assert 0 < len(body["events"]) <= 256
        assert set(body["events"][0]) == {"item_id", "ts", "event_type", "surface", "category"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    sb = SequenceBatches(
        tmp_path / "store",
        "engagement",
        tmp_path / "defs.json",
        global_batch_size=16,
        max_seq_len=32,
        num_actions=4,
        num_surfaces=4,
    )
    batch = sb.batch(0)
    assert batch["mask"].any() and set(np.unique(batch["actions"][batch["mask"]])) <= {0, 1, 2}

    r = _run(
        "-m",
        "jaxscale.sequences",
        "backfill",
        *common[:2],
        "--events",
        str(tmp_path / "nope"),
        "--out",
        str(tmp_path / "store"),
        check=False,
    )
    assert r.returncode == 2 and "does not exist" in r.stderr
