"""Drawing a scenario value from its seed: scalars stay, ``[lo, hi]`` ranges and choices are
drawn, each field from its own random stream (keyed by the field's name), so adding a range
to one field never changes what another field draws."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np


class ScenarioError(ValueError):
    """A scenario file or override is wrong; the message names the file and the key."""


def field_rng(seed: int, key: str) -> np.random.Generator:
    """The random stream of one field (``section.key``) under one seed."""
    return np.random.default_rng([seed & 0xFFFFFFFF, zlib.crc32(key.encode())])


def draw(where: str, value: Any, default: Any, seed: int) -> Any:
    """Resolve a value written as a scalar, a ``[lo, hi]`` range, a list of text choices, or
    ``{choice = [...]}``.

    Args:
        where: ``section.key``, for the error message and the random stream.
        value: what the file says.
        default: the field's default, which fixes the expected type.
        seed: the scenario seed.

    Returns:
        The concrete value, of the default's type.

    Raises:
        ScenarioError: a wrong type, an empty list, a malformed or inverted range.
    """
    rng = field_rng(seed, where)
    kind = type(default)
    if isinstance(value, dict):
        if set(value) != {"choice"} or not isinstance(value["choice"], list) or not value["choice"]:
            raise ScenarioError(f"{where}: a table value must be {{choice = [...]}}, got {value!r}")
        pick = value["choice"][int(rng.integers(len(value["choice"])))]
        return draw(where, pick, default, seed)
    if isinstance(value, list):
        if not value:
            raise ScenarioError(f"{where}: empty list")
        if all(isinstance(v, str) for v in value):
            if kind is not str:
                raise ScenarioError(f"{where}: expected a {kind.__name__}, got choices {value}")
            return value[int(rng.integers(len(value)))]
        if len(value) != 2 or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value
        ):
            raise ScenarioError(f"{where}: a range is [lo, hi] of two numbers, got {value!r}")
        lo, hi = value
        if lo > hi:
            raise ScenarioError(f"{where}: range [{lo}, {hi}] has lo > hi")
        if kind is int:
            if not (float(lo).is_integer() and float(hi).is_integer()):
                raise ScenarioError(f"{where}: integer range needs whole numbers, got {value}")
            return int(rng.integers(int(lo), int(hi) + 1))
        return float(rng.uniform(lo, hi))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != isinstance(default, bool):
        raise ScenarioError(f"{where}: expected {kind.__name__}, got {value!r}")
    return value


def pick_target(where: str, value: Any, n: int, seed: int, avoid: int = -1) -> int:
    """Resolve a fault target: an index, or ``"random"`` drawn from ``range(n)``.

    Args:
        where: ``fault.key``, for the error message and the random stream.
        value: an int or ``"random"``.
        n: number of candidates.
        seed: the scenario seed.
        avoid: an index a random pick must not take (-1: none).

    Returns:
        The index.

    Raises:
        ScenarioError: an index out of range or another value.
    """
    if value == "random":
        rng = field_rng(seed, where)
        pick = int(rng.integers(n - (1 if 0 <= avoid < n else 0)))
        return pick + 1 if 0 <= avoid <= pick else pick
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < n:
            raise ScenarioError(f"{where} = {value} is outside 0..{n - 1}")
        return value
    raise ScenarioError(f'{where} must be an index or "random", got {value!r}')
