"""A real redis-server for the broker tests: started on a free port in a temporary directory, stopped after.

Never skipped: without `redis-server` on PATH the tests fail and say so (.ci/run installs Debian's).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import free_port


@contextlib.contextmanager
def redis_server(folder: Path, *extra: str, client_kw: dict | None = None, tls: bool = False):
    """Yields the port of a fresh redis-server (no persistence) running in `folder`; `extra`: more
    redis-server arguments (e.g. --requirepass), `client_kw`: how the start-up ping logs in; `tls`: the
    port is a TLS port (`extra` names the certificates) and the plain port is off."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not on PATH: the broker tests need a real one (apt-get install redis-server)")
    import redis

    port = free_port()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    log = open(folder / "redis.log", "w")
    ports = ["--port", "0", "--tls-port", str(port)] if tls else ["--port", str(port)]
    proc = subprocess.Popen(
        [binary, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder), *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        client = redis.Redis(port=port, **(client_kw or {}))
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server did not start on port {port}: {(folder / 'redis.log').read_text()}")
                time.sleep(0.02)
        client.close()
        yield port
    finally:
        proc.kill()
        proc.wait()
        log.close()


@pytest.fixture
def redis_port(tmp_path_factory):
    """The port of a redis-server started for this test."""
    with redis_server(tmp_path_factory.mktemp("redis")) as port:
        yield port
