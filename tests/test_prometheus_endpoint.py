"""The Prometheus endpoint: exposition parsed by prometheus_client's own parser."""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_export_csv import LATE, MIB, toy_run

from rankscope.hub.prometheus import (
    PrometheusEndpoint,
    make_registry,
    parse_listen,
    store_source,
)


def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _by_rank(samples: list) -> dict[int, float]:
    return {int(s.labels["rank"]): s.value for s in samples}


def test_exposition_parses_and_carries_rank_and_group_metrics() -> None:
    window = toy_run()
    registry, _ = make_registry(lambda: [window])
    got = _samples(generate_latest(registry).decode())
    step = _by_rank(got["rankscope_rank_step_seconds"])
    assert step == pytest.approx({r: 0.009 for r in range(4)})
    assert _by_rank(got["rankscope_rank_last_step_seconds"]) == pytest.approx(
        {r: 0.009 for r in range(4)}
    )
    # Rank 2 is late at two of three steps: its median per-step lateness is 0.5 ms.
    late = _by_rank(got["rankscope_rank_lateness_seconds"])
    assert late == pytest.approx({0: 0.0, 1: 0.0, 2: 0.0005, 3: 0.0})
    wait = _by_rank(got["rankscope_rank_wait_seconds"])
    assert wait == pytest.approx({0: 0.0005, 1: 0.0005, 2: 0.0, 3: 0.0005})
    times_last = _by_rank(got["rankscope_rank_times_last"])
    assert times_last == {r: float(list(LATE.values()).count(r)) for r in range(4)}
    labels = got["rankscope_rank_step_seconds"][0].labels
    assert {labels["job"], labels["run"], labels["scope"]} == {"toy", "run-7", "full"}
    hosts = {int(s.labels["rank"]): s.labels["host"] for s in got["rankscope_rank_step_seconds"]}
    assert hosts == {0: "node0", 1: "node0", 2: "node1", 3: "node1"}

    (transfer,) = got["rankscope_group_transfer_seconds"]
    assert transfer.labels["group_name"] == "world, all" and transfer.labels["op"] == "all_reduce"
    assert transfer.value == pytest.approx(200e-6)
    (busbw,) = got["rankscope_group_busbw_bytes_per_second"]
    assert busbw.value == pytest.approx(MIB / 200e-6 * 1.5, rel=1e-3)
    (skew,) = got["rankscope_group_skew_seconds"]
    assert skew.value == pytest.approx(500e-6)
    assert got["rankscope_group_instances"][0].value == 3
    assert got["rankscope_run_last_step"][0].value == 7
    assert got["rankscope_run_world_size"][0].value == 4
    assert got["rankscope_window_steps"][0].value == 3
    assert got["rankscope_exporter_errors_total"][0].value == 0


def test_a_failing_source_is_counted_not_a_failed_scrape() -> None:
    def broken():
        raise RuntimeError("store closed")

    registry, collector = make_registry(broken)
    for _ in range(2):
        got = _samples(generate_latest(registry).decode())
    assert collector.errors == 2
    assert got["rankscope_exporter_errors_total"][0].value == 2
    assert "rankscope_rank_step_seconds" not in got


def test_http_endpoint_serves_metrics_on_a_free_port() -> None:
    window = toy_run()
    with PrometheusEndpoint(lambda: [window], port=0, addr="127.0.0.1") as ep:
        assert ep.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{ep.port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    got = _samples(text)
    assert len(got["rankscope_rank_step_seconds"]) == 4
    # Only rankscope metrics: the registry is private, without process or GC collectors.
    assert all(name.startswith("rankscope_") for name in got)


def test_store_source_reads_the_latest_window_of_every_run() -> None:
    window = toy_run()

    class FakeStore:
        def __init__(self) -> None:
            self.asked: list[tuple[str, int]] = []

        def runs(self):
            return [SimpleNamespace(run="run-7"), SimpleNamespace(run="gone")]

        def window(self, run, last):
            self.asked.append((run, last))
            return window if run == "run-7" else None

    store = FakeStore()
    assert list(store_source(store, last=50)()) == [window]
    assert store.asked == [("run-7", 50), ("gone", 50)]


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("9100", ("127.0.0.1", 9100)),
        (9100, ("127.0.0.1", 9100)),
        ("0.0.0.0:9100", ("0.0.0.0", 9100)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
    ],
)
def test_parse_listen(spec, want) -> None:
    assert parse_listen(spec) == want
    assert parse_listen("[::1]:9200") == ("::1", 9200)


@pytest.mark.parametrize("spec", ["http", "70000", "host:"])
def test_parse_listen_rejects_bad_specs(spec) -> None:
    with pytest.raises(ValueError, match="--prometheus"):
        parse_listen(spec)


def test_endpoint_over_a_live_hub_store(tmp_path) -> None:
    """The real Store (run summaries, settling) behind the endpoint, scraped over HTTP."""
    from rankscope.commands.demo import start_demo
    from rankscope.sim import load_scenario

    handles = start_demo(load_scenario("network-rail", ranks=16, seed=2), 6, pace="fast")
    try:
        handles.wait(timeout=60)
        assert handles.wait_ingested()
        source = store_source(handles.hub.store, last=6)
        with PrometheusEndpoint(source, port=0, addr="127.0.0.1") as ep:
            url = f"http://127.0.0.1:{ep.port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as resp:
                got = _samples(resp.read().decode())
    finally:
        handles.stop()
    steps = got["rankscope_rank_step_seconds"]
    assert len(steps) == 16 and all(s.labels["run"] == handles.run_id for s in steps)
    assert all(0 < s.value < 60 for s in steps)
    assert got["rankscope_run_last_step"][0].value == 5
    assert sum(s.value for s in got["rankscope_rank_times_last"]) == sum(
        s.value for s in got["rankscope_group_instances"]
    )
    assert all(s.value > 0 for s in got["rankscope_group_busbw_bytes_per_second"])
