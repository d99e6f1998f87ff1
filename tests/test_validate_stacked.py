"""The one-stack check of a short collective table (`hub.validate._colls_plausible`) is a
shortcut of the column-by-column checks (`_check_colls`): it may send a table it is not
sure of to them, but must never pass one they refuse, and must take the tables collectors
send every step (host-timed, or device-timed with every time known) by itself."""

from __future__ import annotations

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.hub.validate import Reject, _check_colls, _colls_plausible, values_plausible

LO, HI, SPAN = 1_000_000, 10**15, 10**12


def _table(rng: np.random.Generator, n: int, device: bool) -> dict[str, np.ndarray]:
    enter = rng.integers(LO, LO + 10**9, n)
    exit_ = enter + rng.integers(0, 10**7, n)
    if device:
        start = enter + rng.integers(0, 10**6, n)
        end = start + rng.integers(0, 10**6, n)
    else:
        start = end = np.full(n, schema.NO_TIME)
    return {
        "t_enter": enter,
        "t_exit": exit_,
        "t_start": start,
        "t_end": end,
        "nbytes": rng.integers(-1, 10**9, n),
        "seq": rng.integers(-1, 10**6, n),
        "step": rng.integers(-1, 10**4, n),
        "group": rng.integers(0, 64, n),
        "op": rng.integers(-1, len(schema.OPS), n),
    }


def _refused(co: dict[str, np.ndarray]) -> bool:
    try:
        _check_colls(co, LO, HI, SPAN)
    except Reject:
        return True
    return False


@pytest.mark.parametrize("device", [False, True])
def test_the_tables_collectors_send_pass_in_one_stack(device: bool) -> None:
    rng = np.random.default_rng(1)
    for n in (1, 7, 200, 512):
        co = _table(rng, n, device)
        assert _colls_plausible(co, LO, HI, SPAN), (n, device)
        assert not _refused(co)


def _spoil(rng: np.random.Generator, co: dict[str, np.ndarray]) -> None:
    """One value of one column made odd: out of the window, unknown, negative, reversed."""
    n = co["t_enter"].shape[0]
    i = int(rng.integers(n))
    col = str(rng.choice(list(co)))
    co[col] = co[col].copy()
    co[col][i] = rng.choice(
        [
            schema.NO_TIME,
            -2,
            0,
            LO - 1,
            HI + 1,
            2**40,
            co["t_enter"][i] - 1,
            co["t_start"][i] - 1,
            len(schema.OPS),
            schema.INT32_MAX + 1,
        ]
    )


def test_the_stack_never_passes_what_the_columns_refuse() -> None:
    rng = np.random.default_rng(7)
    refused = shortcut = 0
    for _ in range(3000):
        co = _table(rng, int(rng.integers(1, 64)), bool(rng.integers(2)))
        for _ in range(int(rng.integers(1, 3))):
            _spoil(rng, co)
        if _colls_plausible(co, LO, HI, SPAN):
            shortcut += 1
            assert not _refused(co), {k: v.tolist() for k, v in co.items()}
        else:
            refused += _refused(co)
    # Both sides were exercised: spoiled tables refused, harmless changes taken at once.
    assert refused > 500 and shortcut > 100, (refused, shortcut)


def test_a_device_end_before_its_start_is_refused() -> None:
    co = _table(np.random.default_rng(3), 16, True)
    co["t_end"] = co["t_end"].copy()
    co["t_end"][5] = co["t_start"][5] - 1
    assert not _colls_plausible(co, LO, HI, SPAN)
    with pytest.raises(Reject, match="device end is before its device start"):
        _check_colls(co, LO, HI, SPAN)


def test_a_batch_of_device_timed_steps_passes_the_batch_check() -> None:
    # GPU collectors' rows carry device times; the batch check took only host-timed rows,
    # so every GPU job's messages were checked one by one.
    import time

    from rankscope.hub.validate import Limits
    from rankscope.sim import load_scenario
    from rankscope.sim.emit import iter_messages

    sc = load_scenario("healthy", ranks=16, seed=2)
    msgs = [schema.decode(m) for m in iter_messages(sc, 2, t0_ns=time.time_ns())]
    steps = [m for m in msgs if m.kind == "steps"]
    assert all((m.tables["colls"]["t_start"] >= 0).all() for m in steps)  # device-timed
    assert values_plausible(steps, Limits())
    # One device end before its start: the batch is sent to the precise checks.
    co = steps[3].tables["colls"]
    spoiled = dict(co, t_end=co["t_end"].copy())
    spoiled["t_end"][0] = spoiled["t_start"][0] - 1
    steps[3] = schema.Message(steps[3].kind, steps[3].header, {**steps[3].tables, "colls": spoiled})
    assert not values_plausible(steps, Limits())
