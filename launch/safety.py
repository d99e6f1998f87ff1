"""Validation and quoting of every value that reaches a command line.

Host names, run ids and job names arrive in telemetry: a rank's ``hello`` says which host it
runs on and which job it belongs to. A rerun turns those strings into a command, so a rank
that reports the host ``a;rm -rf /`` must never get that run by a shell or read as an
option. Three layers keep it out:

1. Commands are argv lists run without a shell.
2. Every value is checked against a strict pattern for its field *before* it is
   substituted: no shell metacharacters, no whitespace, no newlines, no leading dash
   (which a program would read as an option).
3. Where a template must produce a shell string (the remote command of ``ssh``, the
   ``--wrap`` script of ``sbatch``), each token is ``shlex.quote``-d after validation.

The patterns are deliberately narrower than what the underlying programs accept (no spaces
in paths, no IPv6 literals as host names); a value outside them is refused with an error
that names the field and shows the value, and the user passes a cleaner one.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence

from rankscope.collector.schema import SCOPES

__all__ = [
    "FIELD_PATTERNS",
    "UnsafeValueError",
    "check_argv",
    "check_env",
    "check_hosts",
    "check_value",
    "shell_join",
]


class UnsafeValueError(ValueError):
    """A value that would reach a command line does not match its field's pattern."""

    def __init__(self, field: str, value: object, why: str) -> None:
        super().__init__(f"refusing {field}={value!r}: {why}")
        self.field = field
        self.value = value
        self.why = why


_NAME = r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}"
_PATH = r"[A-Za-z0-9_./+@:=,%][A-Za-z0-9_./+@:=,%-]{0,1023}"

FIELD_PATTERNS: dict[str, tuple[str, str]] = {
    # field: (regex the whole value must match, what it allows, for the error message)
    "host": (
        r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252})",
        "letters, digits, '.', '_' and '-', starting with a letter or digit",
    ),
    "name": (_NAME, "letters, digits and ._:@+=- , starting with a letter or digit"),
    "path": (_PATH, "letters, digits and _./+@:=,%- (no spaces), not starting with '-'"),
    "endpoint": (
        r"(?:tcp|ipc|inproc)://[A-Za-z0-9._/:*\[\]-]{1,255}",
        "a ZeroMQ endpoint such as tcp://host:5555",
    ),
    "arg": (
        r"[A-Za-z0-9_./+@:=,%-]{0,1024}",
        "letters, digits and _./+@:=,%- (no spaces, quotes or shell characters)",
    ),
    "list": (
        r"[A-Za-z0-9][A-Za-z0-9._,-]{0,8191}",
        "comma-separated names of letters, digits, '.', '_' and '-'",
    ),
    "env_name": (r"[A-Z_][A-Z0-9_]{0,127}", "an upper-case environment variable name"),
}
"""Patterns by field kind. ``arg`` is for a training script's own arguments: they may start
with ``-`` because they come after the script path, where no launcher reads options."""

_COMPILED = {kind: re.compile(pat) for kind, (pat, _) in FIELD_PATTERNS.items()}

_SHELL_CHARS = set(";&|`$<>()\\'\"!*?[]{}#~\t\n\r ")


def _why(value: str, kind: str) -> str:
    # Name the first offending feature so the error says what to fix, not just "invalid".
    if value == "":
        return "it is empty"
    if "\n" in value or "\r" in value:
        return "it contains a newline"
    if "\x00" in value:
        return "it contains a NUL byte"
    if value.startswith("-") and kind != "arg":
        return "it starts with '-', which a program would read as an option"
    if "$(" in value or "`" in value:
        return "it contains a command substitution"
    bad = sorted({c for c in value if c in _SHELL_CHARS or not c.isprintable()})
    if bad:
        return f"it contains {''.join(bad)!r}; allowed: {FIELD_PATTERNS[kind][1]}"
    return f"allowed: {FIELD_PATTERNS[kind][1]}"


def check_value(field: str, value: object, kind: str) -> str:
    """Check one value against the pattern of its kind.

    Args:
        field: the name shown in the error (``host``, ``job``, ``script``...).
        value: the value; ints are accepted and turned into text.
        kind: a key of `FIELD_PATTERNS`, or ``int`` (a non-negative integer), ``port``
            (1..65535) or ``scope`` (one of ``schema.SCOPES``).

    Returns:
        The value as text, ready to substitute.

    Raises:
        UnsafeValueError: naming the field and the value.
    """
    if kind in ("int", "port"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise UnsafeValueError(field, value, "expected an integer")
        text = str(value)
        if not re.fullmatch(r"[0-9]{1,9}", text):
            raise UnsafeValueError(field, value, "expected a non-negative integer")
        if kind == "port" and not 1 <= int(text) <= 65535:
            raise UnsafeValueError(field, value, "a port must be within 1..65535")
        return str(int(text))
    if kind == "scope":
        if value not in SCOPES:
            raise UnsafeValueError(field, value, f"expected one of {', '.join(SCOPES)}")
        return str(value)
    if kind not in _COMPILED:
        raise KeyError(f"unknown value kind {kind!r}")
    if not isinstance(value, str):
        raise UnsafeValueError(field, value, f"expected text, got {type(value).__name__}")
    if not _COMPILED[kind].fullmatch(value):
        raise UnsafeValueError(field, value, _why(value, kind))
    return value


def check_hosts(field: str, hosts: Iterable[str]) -> tuple[str, ...]:
    """Check a list of host names.

    Args:
        field: name shown in errors.
        hosts: host names.

    Returns:
        The names as a tuple, in order.

    Raises:
        UnsafeValueError: for the first bad name (or an empty list).
    """
    out = tuple(check_value(field, h, "host") for h in hosts)
    if not out:
        raise UnsafeValueError(field, "", "no host given")
    return out


def check_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """Last check of a rendered argv before it is run.

    Values were validated when they were substituted; this refuses what a template itself
    could still carry into a process: empty programs, NUL bytes and newlines in any token.

    Args:
        argv: the command.

    Returns:
        The argv as a tuple.

    Raises:
        UnsafeValueError: naming the token.
    """
    if not argv or not argv[0]:
        raise UnsafeValueError("argv", list(argv), "the command is empty")
    for i, tok in enumerate(argv):
        if not isinstance(tok, str):
            raise UnsafeValueError(f"argv[{i}]", tok, "expected text")
        if "\x00" in tok:
            raise UnsafeValueError(f"argv[{i}]", tok, "it contains a NUL byte")
    if argv[0].startswith("-"):
        raise UnsafeValueError("argv[0]", argv[0], "the program name starts with '-'")
    return tuple(argv)


def check_env(env: Mapping[str, str]) -> dict[str, str]:
    """Check environment variable names and refuse control characters in values.

    Args:
        env: variables to add to the launched process.

    Returns:
        A plain dict copy.

    Raises:
        UnsafeValueError: naming the variable.
    """
    out = {}
    for name, value in env.items():
        check_value("environment variable", name, "env_name")
        if not isinstance(value, str):
            raise UnsafeValueError(name, value, "expected text")
        if any(not c.isprintable() for c in value):
            raise UnsafeValueError(name, value, "it contains a control character or newline")
        out[name] = value
    return out


def shell_join(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """Render an argv (and environment) as one POSIX shell command line.

    Every token is quoted with ``shlex.quote``; the environment becomes a leading
    ``env NAME=value ...`` so it survives ``ssh`` and ``sbatch --wrap``, which do not pass the
    caller's environment.

    Args:
        argv: validated command tokens.
        env: validated variables (names checked again here).

    Returns:
        The command line.
    """
    parts: list[str] = []
    if env:
        parts.append("env")
        for name, value in check_env(env).items():
            parts.append(shlex.quote(f"{name}={value}"))
    parts.extend(shlex.quote(tok) for tok in check_argv(argv))
    return " ".join(parts)
