"""``rankscope hub --prometheus``: a hub process serving metrics of what a job sends it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from rankscope.sim import load_scenario
from rankscope.sim import run as run_sim


def _scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_hub_serves_metrics_of_a_simulated_job(tmp_path) -> None:
    cmd = [sys.executable, "-m", "rankscope", "hub", "--bind", "tcp://127.0.0.1:0"]
    cmd += ["--prometheus", "127.0.0.1:0", "--status-every", "0"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ)
    )
    try:
        lines: list[str] = []
        url = endpoint = None
        deadline = time.monotonic() + 60
        while (url is None or endpoint is None) and time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
            if m := re.search(r"(http://\S+/metrics)", line):
                url = m.group(1)
            if m := re.search(r"rankscope hub on (tcp://\S+)", line):
                endpoint = m.group(1)
        assert url and endpoint, "".join(lines)
        empty = _scrape(url)
        assert "rankscope_rank_step_seconds" not in empty
        assert empty["rankscope_exporter_errors_total"][0].value == 0

        info = run_sim(load_scenario("network-rail", ranks=16, seed=2), endpoint, 6)
        got: dict[str, list] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = _scrape(url)
            last = got.get("rankscope_run_last_step", [])
            if last and last[0].value == 5:
                break
            time.sleep(0.2)
        steps = got["rankscope_rank_step_seconds"]
        assert {s.labels["run"] for s in steps} == {info.run}
        assert len(steps) == 16
        assert got["rankscope_group_busbw_bytes_per_second"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0
