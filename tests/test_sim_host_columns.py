"""The simulator's tables carry every column of the wire schema, host columns included,
and emit them through the real encoder so a window built from them has them too."""

from __future__ import annotations

import numpy as np

from rankscope.collector import schema
from rankscope.sim import Cluster, load_scenario


def test_sim_tables_have_every_schema_column_and_plausible_host_values() -> None:
    cluster = Cluster(load_scenario("healthy", ranks=8))
    for k in range(2):
        t = cluster.step(k)
        for name in ("steps", "phases", "colls"):
            table = t.table(name)
            missing = set(schema.TABLES[name]) - set(table)
            assert not missing, f"{name} lacks {sorted(missing)}"
            for col, dt in schema.TABLES[name].items():
                assert np.asarray(table[col]).dtype.kind == dt.kind, (name, col)
        ph, st = t.phases, t.steps
        # Unknown is -1; what the host model fills is a CPU time no longer than the span.
        cpu = ph["cpu_ns"]
        assert (cpu >= -1).all()
        known = cpu >= 0
        assert (cpu[known] <= (ph["t1"] - ph["t0"])[known]).all()
        wall = st["t_end"] - st["t_start"]
        for col in ("cpu_ns", "gc_ns"):
            v = st[col]
            assert (v >= -1).all() and (v[v >= 0] <= wall[v >= 0]).all(), col
        # Through the real encoder and decoder, one rank's message keeps them.
        r = t.rank_tables(0, ("steps", "phases", "colls"))
        msg = schema.decode(
            schema.steps_message(
                {"job": "j", "run": "r", "rank": 0, "inc": 0, "batch": k},
                r["steps"],
                r["phases"],
                r["colls"],
            )
        )
        np.testing.assert_array_equal(msg.tables["phases"]["cpu_ns"], r["phases"]["cpu_ns"])
        np.testing.assert_array_equal(msg.tables["steps"]["cpu_ns"], r["steps"]["cpu_ns"])
