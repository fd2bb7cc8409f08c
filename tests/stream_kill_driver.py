"""Runs `python -m jaxscale.sequences stream ...` and SIGKILLs itself at a chosen point (broker kill tests).

    python tests/stream_kill_driver.py POINT BATCH [FILE] -- STREAM ARGS...

POINT is where the process dies, in micro-batch BATCH (1-based) of this run:
  transform  inside the batch's processing, as its events are transformed (nothing of it written)
  write      before the FILE-th partition file of the batch is written (FILE >= 2: some files are in the store)
  ack        after the batch's commit, before its entries are acknowledged
"""

from __future__ import annotations

import os
import signal
import sys


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, batch: int, file: int) -> None:
    from jaxscale.sequences import broker, engine, incremental

    state = {"batch": 0, "file": 0}
    process, add_file, ack = broker.StreamConsumer.process, incremental.add_partition_file, broker.StreamConsumer._ack
    transform = engine.Engine.transform

    def counting_process(self, entries):
        state["batch"] += 1
        state["file"] = 0
        return process(self, entries)

    def counting_transform(self, *args, **kwargs):
        if point == "transform" and state["batch"] == batch:
            die()
        return transform(self, *args, **kwargs)

    def counting_add_file(*args, **kwargs):
        state["file"] += 1
        if point == "write" and state["batch"] == batch and state["file"] == file:
            die()
        return add_file(*args, **kwargs)

    def counting_ack(self, ids):
        if point == "ack" and state["batch"] == batch:
            die()
        return ack(self, ids)

    broker.StreamConsumer.process = counting_process
    engine.Engine.transform = counting_transform
    incremental.add_partition_file = counting_add_file
    broker.StreamConsumer._ack = counting_ack


def main() -> int:
    sep = sys.argv.index("--")
    point, batch, *rest = sys.argv[1:sep]
    if point not in ("transform", "write", "ack"):
        raise SystemExit(f"unknown kill point {point!r}")
    install(point, int(batch), int(rest[0]) if rest else 0)
    from jaxscale.sequences.cli import main as cli_main

    rc = cli_main(["stream", *sys.argv[sep + 1 :]])
    print(f"driver: the consumer finished without reaching kill point {point} (rc {rc})", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
