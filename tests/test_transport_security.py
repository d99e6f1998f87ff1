"""CURVE on the hub's sockets, `rankscope keys`, and the loopback-by-default rules.

Everything listens on loopback except the refusal test, which binds every interface only
to be told no (and the ``--insecure`` one, which binds and stops at once): no traffic
leaves the host. Deliveries are waited for with generous timeouts, never timed.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_hub_job import header, identity
from waiting import wait_for

from rankscope.cli import main
from rankscope.collector import runtime, schema
from rankscope.collector.clock import ClockSync, clock_endpoint
from rankscope.collector.security import (
    AUTHORIZED,
    ClientCurve,
    client_curve_from_env,
    default_keys_dir,
    is_loopback,
    load_client_curve,
    private_dir,
    write_key_pair,
)
from rankscope.collector.sender import Sender
from rankscope.commands.keys import make_keys
from rankscope.hub.security import (
    HubSecurity,
    InsecureBindError,
    KeyFileError,
    hub_security,
    load_hub_security,
)
from rankscope.hub.server import Hub

WAIT_S = 30.0


def hello(run: str) -> bytes:
    return schema.hello_message(header(run, 0), identity(0, 1))


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """A keys directory as `rankscope keys` leaves it: hub pair, one authorised client."""
    folder = tmp_path / "keys"
    make_keys(folder, ["client"], force=False)
    return folder


@pytest.fixture
def curve_hub(keys: Path) -> Iterator[Hub]:
    with Hub("tcp://127.0.0.1:0", security=load_hub_security(keys)) as hub:
        yield hub


def refused(sender: Sender) -> bool:
    sender.read_events()
    return sender.handshake_failures > 0


def test_curve_hub_takes_an_authorised_clients_messages_and_answers_its_clock(
    keys: Path, curve_hub: Hub
) -> None:
    curve = load_client_curve(keys)
    clock_ep = clock_endpoint(curve_hub.endpoint)
    with Sender(curve_hub.endpoint, curve=curve) as sender:
        clock = ClockSync(clock_ep, curve=curve)
        try:
            assert sender.send(hello("good"))

            def synced() -> bool:
                clock.tick()
                return clock.synced

            assert wait_for(synced)
            assert wait_for(lambda: "good" in curve_hub.store.run_ids())
        finally:
            clock.close()
    assert curve_hub.transport_stats["clock_pings"] >= 1
    assert sender.handshake_failures == 0


def test_a_collector_started_with_keys_in_the_environment_speaks_curve(
    keys: Path, curve_hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANKSCOPE_KEYS", str(keys))
    monkeypatch.setenv("RANKSCOPE_HUB", curve_hub.endpoint)
    monkeypatch.setenv("RANKSCOPE_RUN", "env-keys")
    mon = runtime.start(job="j", sample_interval_s=0, instrument_torch=False)
    try:
        with mon.step():
            pass
        assert wait_for(lambda: "env-keys" in curve_hub.store.run_ids())
        assert wait_for(lambda: mon.pump.clock.synced)
    finally:
        runtime.close()


def test_demo_sent_to_a_curve_hub_uses_the_client_keys(
    keys: Path, curve_hub: Hub, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from rankscope.cli import main

    monkeypatch.setenv("RANKSCOPE_KEYS", str(keys))
    argv = ["demo", "--hub", curve_hub.endpoint, "--ranks", "8", "--steps", "3"]
    assert main([*argv, "--baseline-steps", "0", "--scenario", "healthy", "--json"]) == 0
    capsys.readouterr()
    assert wait_for(lambda: any(curve_hub.store.run_ids()))


def test_a_collector_without_keys_trains_on_when_the_hub_requires_curve(
    curve_hub: Hub, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rankscope")
    monkeypatch.setenv("RANKSCOPE_KEYS", "none")
    monkeypatch.setenv("RANKSCOPE_HUB", curve_hub.endpoint)
    monkeypatch.setenv("RANKSCOPE_RUN", "no-keys")
    mon = runtime.start(job="j", sample_interval_s=0, instrument_torch=False)
    try:

        def warned() -> bool:
            with mon.step(), mon.collective("all_reduce", group=0, nbytes=64):
                pass
            return "refused the connection handshake" in caplog.text

        assert wait_for(warned)
        for _ in range(1000):
            with mon.step(), mon.collective("all_reduce", group=0, nbytes=64):
                pass
    finally:
        runtime.close()
    assert caplog.text.count("refused the connection handshake") == 1
    assert mon.pump.sender is not None and mon.pump.sender.handshake_failures >= 1
    assert "no-keys" not in curve_hub.store.run_ids()


def test_an_unknown_client_key_delivers_nothing_and_the_hub_serves_the_others(
    keys: Path, curve_hub: Hub, tmp_path: Path
) -> None:
    stranger_dir = private_dir(tmp_path / "stranger")
    _, pair = write_key_pair(stranger_dir, "stranger")
    good = load_client_curve(keys)
    stranger = load_client_curve(keys, pair)
    assert stranger.public != good.public
    with Sender(curve_hub.endpoint, curve=stranger, watch=True) as bad:
        bad.send(hello("stranger"))
        assert wait_for(lambda: refused(bad))
        with Sender(curve_hub.endpoint, curve=good) as sender:
            assert sender.send(hello("good"))
            assert wait_for(lambda: "good" in curve_hub.store.run_ids())
        bad.send(hello("stranger"))
    assert "stranger" not in curve_hub.store.run_ids()


def test_a_client_holding_another_hub_key_is_refused(
    keys: Path, curve_hub: Hub, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    make_keys(other, ["client"], force=False)
    good = load_client_curve(keys)
    wrong_hub = ClientCurve(good.public, good.secret, load_client_curve(other).server)
    with Sender(curve_hub.endpoint, curve=wrong_hub, watch=True) as bad:
        bad.send(hello("wrong-hub"))
        assert wait_for(lambda: refused(bad))
    assert "wrong-hub" not in curve_hub.store.run_ids()


def test_a_plain_client_delivers_nothing_never_blocks_and_warns_once(
    curve_hub: Hub, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rankscope")
    with Sender(curve_hub.endpoint, hwm=4, watch=True) as plain:
        plain.send(hello("plain"))
        assert wait_for(lambda: refused(plain))
        # Refused, it takes and drops whatever it is given, without waiting.
        for _ in range(50):
            plain.send(hello("plain"))
            plain.read_events()
        assert plain.dropped > 0
    assert wait_for(lambda: curve_hub.transport_stats["refused"] >= 1)
    assert "refused a connection at the security handshake" in caplog.text
    warnings = [r for r in caplog.records if "refused the connection handshake" in r.message]
    assert len(warnings) == 1
    assert "rankscope keys" in warnings[0].message
    assert "plain" not in curve_hub.store.run_ids()
    with Sender(curve_hub.endpoint, watch=True) as again:  # the hub serves the next one
        again.send(hello("plain"))
        assert wait_for(lambda: refused(again))


def test_hub_beyond_loopback_without_keys_refuses_and_says_how(tmp_path: Path) -> None:
    empty = {"RANKSCOPE_KEYS": str(tmp_path / "none-here")}
    for host in ("*", "0.0.0.0", "10.1.2.3", "node7", "::"):
        with pytest.raises(InsecureBindError, match=r"rankscope keys.*--insecure"):
            hub_security(host, env=empty)
    assert hub_security("*", insecure=True, env=empty) is None
    for host in ("127.0.0.1", "127.3.0.1", "localhost", "::1", "[::1]"):
        assert hub_security(host, env=empty) is None


def test_hub_command_refuses_a_wildcard_bind_without_keys_and_insecure_allows_it(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "RANKSCOPE_KEYS": str(tmp_path / "none-here")}
    cmd = [sys.executable, "-m", "rankscope", "hub", "--status-every", "0"]
    out = subprocess.run(
        [*cmd, "--bind", "tcp://*:0"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rankscope: error: refusing to listen")
    assert "rankscope keys" in lines[0] and "--insecure" in lines[0]
    proc = subprocess.Popen(
        [*cmd, "--bind", "tcp://0.0.0.0:0", "--insecure"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        while first and not first.startswith("rankscope hub on"):
            first = proc.stdout.readline()
        assert "plain" in first, first
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_hub_command_with_keys_speaks_curve_to_an_authorised_collector(keys: Path) -> None:
    from test_hub_command import HubProcess

    hub = HubProcess("--bind", "tcp://127.0.0.1:0", "--keys", str(keys), "--status-every", "0.1")
    try:
        hub.wait_line(r"rankscope hub on .*CURVE")
        with Sender(hub.endpoint, watch=True) as plain:
            plain.send(hello("plain"))
            assert wait_for(lambda: refused(plain))
        hub.wait_line(r"refused [1-9]", timeout=WAIT_S)
        with Sender(hub.endpoint, curve=load_client_curve(keys)) as sender:
            assert sender.send(hello("curve"))
            hub.wait_line(r"runs 1 \| ranks 1/1", timeout=WAIT_S)
    finally:
        hub.proc.terminate()
        hub.proc.wait(timeout=60)


def test_keys_found_make_every_hub_use_curve(keys: Path) -> None:
    env = {"RANKSCOPE_KEYS": str(keys)}
    for host in ("*", "127.0.0.1"):
        sec = hub_security(host, env=env)
        assert isinstance(sec, HubSecurity) and sec.authorized == keys / AUTHORIZED
    assert hub_security("*", keys=keys, env={"RANKSCOPE_KEYS": "none"}) is not None
    assert hub_security("*", insecure=True, env=env) is None
    with pytest.raises(KeyFileError):
        hub_security("*", keys=keys, insecure=True, env=env)
    with pytest.raises(KeyFileError, match=r"hub\.key_secret"):
        hub_security("127.0.0.1", keys=keys / "missing", env=env)


def test_an_ipc_hub_speaks_plain_and_refuses_keys(keys: Path, monkeypatch) -> None:
    """An ipc socket is a file only its user can open: a hub there speaks plain ZeroMQ
    even where keys are found (the collectors speak plain to ipc too), and says so when
    keys are asked for."""
    import argparse

    from rankscope.commands.keys import hub_security_of
    from rankscope.errors import CommandError

    monkeypatch.setenv("RANKSCOPE_KEYS", str(keys))
    plain = argparse.Namespace(keys=None, insecure=False)
    assert hub_security_of(plain, "ipc:///tmp/hub") is None
    assert hub_security_of(plain, "tcp://127.0.0.1:5555") is not None
    with pytest.raises(CommandError, match="file's permissions"):
        hub_security_of(argparse.Namespace(keys=str(keys), insecure=False), "ipc:///tmp/hub")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_command_writes_private_files_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "k"
    assert main(["keys", "--dir", str(folder)]) == 0
    names = {"hub.key", "hub.key_secret", "client.key", "client.key_secret"}
    assert names <= {p.name for p in folder.iterdir()}
    assert (folder / AUTHORIZED / "client.key").is_file()
    assert _mode(folder) == 0o700 and _mode(folder / AUTHORIZED) == 0o700
    for p in [*folder.glob("*.key*"), *(folder / AUTHORIZED).iterdir()]:
        assert _mode(p) == 0o600, p
    hub_secret = (folder / "hub.key_secret").read_bytes()
    capsys.readouterr()

    assert main(["keys", "--dir", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--force" in err[0]
    assert (folder / "hub.key_secret").read_bytes() == hub_secret

    assert main(["keys", "--dir", str(folder), "--client", "node7"]) == 0
    assert (folder / "hub.key_secret").read_bytes() == hub_secret
    assert (folder / AUTHORIZED / "node7.key").is_file()

    assert main(["keys", "--dir", str(folder), "--force"]) == 0
    assert (folder / "hub.key_secret").read_bytes() != hub_secret
    assert main(["keys", "--dir", str(folder), "--client", "../x"]) == 2


def test_client_keys_come_from_the_environment_or_not_at_all(
    keys: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rankscope")
    home = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    assert default_keys_dir(home) == tmp_path / "cfg" / "rankscope" / "keys"
    assert client_curve_from_env(home) is None
    assert not caplog.records
    found = client_curve_from_env({**home, "RANKSCOPE_KEYS": str(keys)})
    assert found == load_client_curve(keys)
    assert client_curve_from_env({**home, "RANKSCOPE_KEYS": "none"}) is None
    _, node7 = write_key_pair(keys, "node7")
    picked = client_curve_from_env(
        {"RANKSCOPE_KEYS": str(keys), "RANKSCOPE_CLIENT_KEY": str(node7)}
    )
    assert picked is not None and picked.public != found.public
    half = private_dir(tmp_path / "half")
    (half / "hub.key").write_bytes((keys / "hub.key").read_bytes())
    assert client_curve_from_env({"RANKSCOPE_KEYS": str(half)}) is None
    assert "not using CURVE keys" in caplog.text


def test_run_command_hands_its_keys_directory_to_every_rank(keys: Path, tmp_path: Path) -> None:
    from rankscope.cli import build_parser
    from rankscope.commands.run import build_env
    from rankscope.errors import CommandError

    args = build_parser("run").parse_args(["run", "--keys", str(keys), "--", "python", "t.py"])
    env = build_env(args, {}, str(tmp_path))
    assert env["RANKSCOPE_KEYS"] == str(keys)
    args = build_parser("run").parse_args(["run", "--keys", str(tmp_path), "--", "python"])
    with pytest.raises(CommandError, match="rankscope keys"):
        build_env(args, {}, str(tmp_path))


def test_defaults_listen_on_loopback() -> None:
    from rankscope.cli import build_parser
    from rankscope.hub.prometheus import PrometheusEndpoint, parse_listen
    from rankscope.tui.settings import Settings

    hub_args = build_parser("hub").parse_args(["hub"])
    watch_args = build_parser("watch").parse_args(["watch"])
    assert hub_args.bind == "tcp://127.0.0.1:5555" and watch_args.bind is None
    assert Settings().hub.bind == "tcp://127.0.0.1:5555"
    assert parse_listen("9100") == ("127.0.0.1", 9100)
    assert PrometheusEndpoint(lambda: [], 0).addr == "127.0.0.1"
    assert runtime.DEFAULT_HUB == "tcp://127.0.0.1:5555"
    assert Hub().host == "127.0.0.1"
    for default in (hub_args.bind, Settings().hub.bind, runtime.DEFAULT_HUB):
        assert is_loopback(default.split("//")[1].rpartition(":")[0])
