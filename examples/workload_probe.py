"""How the example talks to rankscope's explicit API, and a no-op stand-in without it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class Probe:
    """No instrumentation: every call does nothing (plain runs and zero-code runs, where
    ``rankscope run`` instruments the process from outside)."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def work(self, *, tokens: int, valid_tokens: int, samples: int, attn_cost: float) -> None:
        pass

    def step_end(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_probe(explicit: bool, job: str, config: dict[str, Any]) -> Probe:
    """The probe for this run: rankscope's explicit API when asked for, else a no-op."""
    if not explicit:
        return Probe()
    raise SystemExit("--rankscope needs the rankscope collector (rankscope.start)")
