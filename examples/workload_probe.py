"""How the example talks to rankscope's explicit API, and a no-op stand-in without it.

rankscope's torch hooks already time the DataLoader (``input``), the instrumented model's
forward pass (``forward``), the optimizer step (``optimizer``) and every collective and DDP
gradient bucket. The explicit API adds what the hooks cannot know: step boundaries that
include the input wait, the ``backward`` and ``checkpoint`` phases, and the work of each
step — tokens, valid tokens, sequences and Σ seq² (``attn_cost``), which the diagnosis
correlates with compute time. The probe marks only those, so no phase is timed twice.
"""

from __future__ import annotations

import contextlib
from typing import Any


class Probe:
    """No instrumentation: every call does nothing (plain runs, and zero-code runs where
    ``rankscope run`` instruments the process from outside)."""

    def instrument(self, model: Any) -> Any:
        return model

    def phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def work(self, *, tokens: int, valid_tokens: int, samples: int, attn_cost: float) -> None:
        pass

    def begin_step(self, step: int) -> None:
        pass

    def end_step(self) -> None:
        pass

    def close(self) -> None:
        pass


class RankscopeProbe(Probe):
    """The explicit rankscope API: ``rankscope.start`` once, then phases and work per step.

    Started after the process group exists (the ranks agree on a run id through its store)
    and before the model is wrapped, so the collective hooks see every gradient bucket.
    """

    def __init__(self, job: str, config: dict[str, Any]) -> None:
        import rankscope

        self._rankscope = rankscope
        self.mon = rankscope.start(job=job, job_config=config)
        if self.mon.job_config != config:
            # Under `rankscope run` the monitor started with the process group, before
            # this code could pass its configuration; it goes out with the next hello.
            self.mon.update_job_config(config)

    def instrument(self, model: Any) -> Any:
        # DDP models are instrumented when wrapped; FSDP2 and plain models need the call
        # for their forward phase (a second call is a no-op).
        return self._rankscope.instrument(model)

    def phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        return self.mon.phase(name)

    def work(self, *, tokens: int, valid_tokens: int, samples: int, attn_cost: float) -> None:
        self.mon.work(
            tokens=tokens, valid_tokens=valid_tokens, samples=samples, attn_cost=attn_cost
        )

    def begin_step(self, step: int) -> None:
        self.mon.begin_step(step)

    def end_step(self) -> None:
        self.mon.end_step()

    def close(self) -> None:
        self._rankscope.close()


def make_probe(explicit: bool, job: str, config: dict[str, Any]) -> Probe:
    """The probe for this run: rankscope's explicit API when asked for, else a no-op.

    Args:
        explicit: ``--rankscope`` was given.
        job: job name to report.
        config: the job config for the manifest.

    Returns:
        A probe.
    """
    if not explicit:
        return Probe()
    try:
        return RankscopeProbe(job, config)
    except ImportError as exc:
        raise SystemExit(f"--rankscope needs the rankscope package importable: {exc}") from exc
