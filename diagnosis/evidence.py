"""Everything the verdict reads about one window, gathered once."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from rankscope.diagnosis.baseline import BaselineComparison
from rankscope.diagnosis.correlate import Correlations
from rankscope.diagnosis.coverage import Unreported
from rankscope.diagnosis.critical import CriticalPath
from rankscope.diagnosis.decomposition import Decomposition, DecompositionDelta
from rankscope.diagnosis.fabric import FabricView
from rankscope.diagnosis.localise import Localisation, local_ns, what_if_gain
from rankscope.diagnosis.numerator import NumeratorCheck
from rankscope.diagnosis.robust import nanmedian
from rankscope.diagnosis.trends import Trends
from rankscope.diagnosis.window import Window


@dataclass(frozen=True)
class Evidence:
    """Everything the verdict reads about one window."""

    window: Window
    decomp: Decomposition
    crit: CriticalPath
    corr: Correlations
    trends: Trends
    fabric: FabricView
    numerator: NumeratorCheck
    comparison: BaselineComparison
    loc: Localisation
    """Who sets the steps and what fixing them gains (no catalogue needed)."""
    delta: DecompositionDelta | None = None
    baseline: Window | None = None
    """The healthy run's window, when there is one (for rank-by-rank comparisons)."""
    unreported: Unreported | None = None
    """Ranks whose state the window cannot tell (`coverage.unreported`), as found before those
    that recorded no collective were left out of the analyses; None: not looked for."""

    @cached_property
    def step_ns(self) -> float:
        """The job's median step time."""
        return float(nanmedian(nanmedian(self.decomp.step_ns, axis=0)))

    @cached_property
    def local(self) -> np.ndarray:
        """Per rank and step, the rank's own time (`localise.local_ns`)."""
        return local_ns(self.decomp, self.window)

    def what_if(self, ranks: tuple[int, ...]) -> float:
        """Share of the step saved if these ranks behaved like the median rank."""
        return what_if_gain(self.local, ranks, self.step_ns)
