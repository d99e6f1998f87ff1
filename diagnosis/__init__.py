"""Diagnosis core: pure numpy analysis over a `Window` of the store.

The entry point is ``diagnose(window, baseline=None) -> Diagnosis`` (`engine`); the CLI,
the TUI and snapshots call it. It is loaded on first use, so importing
``rankscope.diagnosis.window`` (as the hub does) stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Diagnosis", "diagnose"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rankscope.diagnosis import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'rankscope.diagnosis' has no attribute {name!r}")
