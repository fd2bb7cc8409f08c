"""Stream retention, broker login and TLS (issue 35 item 9), against real redis-servers.

Retention: the consumer trims its stream (XTRIM MINID) by `--retain-ms` / `--retain-entries`, never an
entry some group has not had delivered and acknowledged; every remaining id is checked against a brute
force over the groups' states. Login: a `requirepass` server and an ACL user, the password from a file or
the environment, never in a URL (one with a password is refused without echoing it) or a report. TLS: a
`rediss://` server with certificates made by `trustme`, verified against the CA file.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import redis
from redis_helpers import redis_port, redis_server  # noqa: F401  (the fixture)
from test_sequences_broker import DEFS, assert_same_events, run_cli, stream_args
from test_sequences_helpers import random_log

from jaxscale.sequences.broker import PASSWORD_ENV, BrokerError, Producer, RedisAuth, RedisSource, StreamConsumer
from jaxscale.sequences.runtime import backfill


def _log(tmp_path, seed: int = 7, rows: int = 160):
    raw, items = random_log(seed, tmp_path, files=2, rows=rows, days=2, bad=False)
    backfill(DEFS, tmp_path / "events", tmp_path / "b", sources={"items": items})
    return items


def _ids(client, key: str) -> list[bytes]:
    return [i for i, _ in client.xrange(key)]


def _t(entry_id: bytes) -> tuple[int, int]:
    ms, seq = entry_id.split(b"-")
    return int(ms), int(seq)


def _needed(client, key: str, ids: list[bytes]) -> set[bytes]:
    """Brute force: the ids some group still needs (pending in it, or not yet delivered to it)."""
    need = set()
    for g in client.xinfo_groups(key):
        last = _t(g["last-delivered-id"])
        pending = {r["message_id"] for r in client.xpending_range(key, g["name"], "-", "+", 10**6)}
        need |= {i for i in ids if _t(i) > last} | pending
    return need


# ------------------------------------------------------------------------------------------- retention


def test_retention_never_trims_what_a_group_has_not_acknowledged(tmp_path, redis_port):  # noqa: F811
    items = _log(tmp_path)
    url = f"redis://127.0.0.1:{redis_port}/ev"
    client = redis.Redis(port=redis_port)
    Producer(url, batch=10).publish_files(tmp_path / "events")
    ids = _ids(client, "ev")
    assert len(ids) >= 12
    # A second group: 6 entries delivered, the first 2 acknowledged, 4 delivered and not acknowledged.
    client.xgroup_create("ev", "other", id="0")
    got = client.xreadgroup("other", "o1", {"ev": ">"}, count=6)[0][1]
    client.xack("ev", "other", *[i for i, _ in got[:2]])
    consumer = StreamConsumer(
        DEFS, url, "g", tmp_path / "s", sources={"items": items}, micro_batch=25, retain_ms=0, trim_every_ms=0
    )
    checked = []
    real_ack = consumer._ack

    def ack_after_trim(done):  # trim while this batch is delivered to "g" and not acknowledged
        consumer.trim()
        left = set(_ids(client, "ev"))
        assert set(done) <= left, "an entry delivered and not acknowledged was trimmed"
        checked.append(len(done))
        real_ack(done)

    consumer._ack = ack_after_trim
    report = consumer.run(until_idle=0.3)
    assert sum(checked) == len(ids)
    assert_same_events(tmp_path / "s", tmp_path / "b")  # nothing lost
    left = _ids(client, "ev")
    assert set(left) == _needed(client, "ev", ids) == {i for i in ids if _t(i) >= _t(got[2][0])}
    assert report.extra["trimmed"] == len(ids) - len(left) == 2
    # The other group acknowledges its 4 and reads 3 more without acknowledging them: trimmed up to those.
    client.xack("ev", "other", *[i for i, _ in got[2:]])
    more = client.xreadgroup("other", "o1", {"ev": ">"}, count=3)[0][1]
    assert consumer.trim() == 4
    assert _ids(client, "ev") == [i for i in ids if _t(i) >= _t(more[0][0])]
    assert set(_ids(client, "ev")) == _needed(client, "ev", ids)
    assert consumer.metrics.snapshot()["entries_trimmed"] == 6


def test_retention_keeps_what_it_says(tmp_path, redis_port):  # noqa: F811
    items = _log(tmp_path, seed=8, rows=120)
    client = redis.Redis(port=redis_port)
    for key, kw, want in [
        ("a", {}, None),  # no retention: nothing trimmed (the default)
        ("b", {"retain_ms": 3_600_000}, None),  # everything was received within the hour
        ("c", {"retain_entries": 5}, 5),
        ("d", {"retain_ms": 0, "retain_entries": 3}, 3),  # both: what either keeps
        ("e", {"retain_ms": 0}, 0),
    ]:
        url = f"redis://127.0.0.1:{redis_port}/{key}"
        Producer(url, batch=10).publish_files(tmp_path / "events")
        ids = _ids(client, key)
        c = StreamConsumer(DEFS, url, "g", tmp_path / f"s{key}", sources={"items": items}, micro_batch=40, **kw)
        report = c.run(until_idle=0.2)
        assert _ids(client, key) == (ids if want is None else ids[len(ids) - want :]), key
        assert report.extra["trimmed"] == (0 if want is None else len(ids) - want)
    with pytest.raises(ValueError, match="--retain-ms must be a non-negative integer"):
        StreamConsumer(DEFS, f"redis://127.0.0.1:{redis_port}/a", "g", tmp_path / "x", micro_batch=1, retain_ms=-1)


def test_cli_retention(tmp_path, redis_port):  # noqa: F811
    items = _log(tmp_path, seed=9, rows=100)
    url = f"redis://127.0.0.1:{redis_port}/ev"
    Producer(url, batch=10).publish_files(tmp_path / "events")
    r = run_cli(["stream", *stream_args(url, tmp_path, items, "--until-idle", "0.3", "--retain-entries", "2")])
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["retain_entries"] == 2 and report["trimmed"] > 0
    assert redis.Redis(port=redis_port).xlen("ev") == 2
    assert_same_events(tmp_path / "s", tmp_path / "b")


# ------------------------------------------------------------------------------------------- login


PASSWORD = "s3cret-pw-7f2c"
ALICE_PASSWORD = "alice-pw-91d0"


@pytest.fixture
def auth_port(tmp_path_factory):
    """A redis-server with a default-user password and an ACL user `alice` (her own password)."""
    acl = ["--requirepass", PASSWORD, "--user", "alice", "on", f">{ALICE_PASSWORD}", "~*", "&*", "+@all"]
    with redis_server(tmp_path_factory.mktemp("redis-auth"), *acl, client_kw={"password": PASSWORD}) as port:
        yield port


def test_url_with_credentials_is_refused_without_echoing_them():
    for url in (f"redis://:{PASSWORD}@127.0.0.1:6379/ev", f"rediss://alice:{PASSWORD}@127.0.0.1:6379/ev"):
        with pytest.raises(BrokerError, match="carries credentials") as e:
            RedisSource.parse(url)
        assert PASSWORD not in str(e.value)
    with pytest.raises(BrokerError, match="--redis-ca-file is for rediss://"):
        RedisSource.parse("redis://127.0.0.1:6379/ev", RedisAuth(ca_file=__file__))


def test_password_from_a_file_or_the_environment(tmp_path, auth_port, monkeypatch, capsys):
    items = _log(tmp_path, seed=10, rows=80)
    url = f"redis://127.0.0.1:{auth_port}/ev"
    with pytest.raises(BrokerError, match="refused the login as the default user without a password"):
        Producer(url)
    with pytest.raises(BrokerError, match="refused the login") as e:
        Producer(url, auth=RedisAuth(password="wrong-one"))
    assert "wrong-one" not in str(e.value)
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    auth = RedisAuth.load(password_file=str(tmp_path / "pw"))
    assert auth.password == PASSWORD and PASSWORD not in repr(auth)
    assert RedisAuth.load(env={PASSWORD_ENV: PASSWORD}).password == PASSWORD
    with pytest.raises(BrokerError, match="is empty"):
        (tmp_path / "empty").write_text("\n")
        RedisAuth.load(password_file=str(tmp_path / "empty"))
    Producer(url, batch=10, auth=auth).publish_files(tmp_path / "events")
    # The CLI: the password in the environment, the report and the output never hold it.
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    rc, out, err = _cli(["stream", *stream_args(url, tmp_path, items, "--until-idle", "0.3")], capsys)
    assert rc == 0, err
    assert PASSWORD not in out + err
    assert all(PASSWORD not in p.read_text() for p in (tmp_path / "s").rglob("*.json"))
    assert_same_events(tmp_path / "s", tmp_path / "b")
    monkeypatch.delenv(PASSWORD_ENV)
    rc, out, err = _cli(["stream", *stream_args(url, tmp_path, items, "--until-idle", "0.1")], capsys)
    assert rc == 2 and "refused the login as the default user without a password" in err


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    """The CLI in this process (a subprocess costs seconds of start-up); (status, stdout, stderr)."""
    from jaxscale.sequences.cli import main

    capsys.readouterr()
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_acl_user(tmp_path, auth_port, capsys):
    items = _log(tmp_path, seed=11, rows=80)
    url = f"redis://127.0.0.1:{auth_port}/ev"
    (tmp_path / "alice").write_text(ALICE_PASSWORD)
    alice = RedisAuth.load(username="alice", password_file=str(tmp_path / "alice"))
    with pytest.raises(BrokerError, match="as user 'alice'"):
        Producer(url, auth=RedisAuth("alice", PASSWORD))
    Producer(url, batch=10, auth=alice).publish_files(tmp_path / "events")
    pw = ["--redis-user", "alice", "--redis-password-file", str(tmp_path / "alice")]
    rc, out, err = _cli(["stream", *stream_args(url, tmp_path, items, "--until-idle", "0.3", *pw)], capsys)
    assert rc == 0, err
    assert_same_events(tmp_path / "s", tmp_path / "b")
    client = redis.Redis(port=auth_port, username="alice", password=ALICE_PASSWORD)
    assert client.acl_whoami() in ("alice", b"alice")


# ------------------------------------------------------------------------------------------- TLS


def _tls_supported() -> str | None:
    """None when the installed redis-server was built with TLS, else why the TLS test cannot run."""
    binary = shutil.which("redis-server")
    if binary is None:
        return "redis-server is not on PATH"
    out = subprocess.run([binary, "--port", "0", "--tls-port", "1", "--tls-cert-file", "/nonexistent"],
                         capture_output=True, text=True, timeout=10)  # fmt: skip
    text = out.stdout + out.stderr
    if "not supported" in text.lower() or "Bad directive" in text:
        return f"the installed redis-server was built without TLS: {text.strip()[-200:]}"
    return None


@pytest.mark.skipif(_tls_supported() is not None, reason=str(_tls_supported()))
def test_rediss_with_a_ca_file(tmp_path, tmp_path_factory, capsys):
    trustme = pytest.importorskip("trustme", reason="trustme is needed to make the test's certificates")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    tls = ["--tls-cert-file", str(tmp_path / "server.pem"), "--tls-key-file", str(tmp_path / "server.key")]
    tls += ["--tls-ca-cert-file", str(tmp_path / "ca.pem"), "--tls-auth-clients", "no"]
    ping = {"ssl": True, "ssl_ca_certs": str(tmp_path / "ca.pem")}
    items = _log(tmp_path, seed=12, rows=80)
    with redis_server(tmp_path_factory.mktemp("redis-tls"), *tls, client_kw=ping, tls=True) as port:
        url = f"rediss://127.0.0.1:{port}/ev"
        with pytest.raises(BrokerError, match="over TLS"):
            Producer(url)  # the system's CAs do not know the test CA: verification fails
        with pytest.raises(BrokerError, match="cannot reach the broker"):
            Producer(f"redis://127.0.0.1:{port}/ev")  # plain text to a TLS port
        auth = RedisAuth.load(ca_file=str(tmp_path / "ca.pem"))
        Producer(url, batch=10, auth=auth).publish_files(tmp_path / "events")
        ca = ["--redis-ca-file", str(tmp_path / "ca.pem")]
        rc, out, err = _cli(["stream", *stream_args(url, tmp_path, items, "--until-idle", "0.3", *ca)], capsys)
        assert rc == 0, err
        assert json.loads(out)["events"].startswith("rediss://127.0.0.1")
        assert_same_events(tmp_path / "s", tmp_path / "b")
