"""The hub's side of CURVE: its key pair, the ZAP handler, and when CURVE is required.

The policy (how `rankscope hub` and `rankscope watch` choose, `hub_security`):

- ``--insecure``: plain ZeroMQ whatever keys exist (a warning when bound beyond loopback).
- ``--keys DIR``: CURVE with the keys in DIR; missing keys are an error.
- otherwise, keys in the keys directory (``$RANKSCOPE_KEYS`` or
  ``~/.config/rankscope/keys``, `rankscope.collector.security`): CURVE on any address,
  loopback included, since collectors on the same host find the same keys and use them;
- no keys: plain on a loopback address; an address beyond loopback (``*``, ``0.0.0.0``,
  a host's address or name) is refused with `InsecureBindError`, which says what to do.

Clients are authorised by their public key: the ``*.key`` files of the keys directory's
``authorized_clients/`` folder, read when the hub starts (a key added or removed takes
effect at the next start). A client whose key is not there, or that speaks plain ZeroMQ,
fails its handshake and delivers nothing; the hub goes on serving the others.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq

from rankscope.collector.security import (
    AUTHORIZED,
    HUB_SECRET,
    PUBLIC_SUFFIX,
    KeyFileError,
    is_loopback,
    keys_dir,
    read_key_file,
)

log = logging.getLogger("rankscope.hub")

__all__ = [
    "HubSecurity",
    "InsecureBindError",
    "KeyFileError",
    "hub_security",
    "load_hub_security",
]


class InsecureBindError(ValueError):
    """A hub asked to listen beyond loopback with no keys and without ``--insecure``."""


@dataclass(frozen=True)
class HubSecurity:
    """CURVE settings of a hub's data and clock sockets.

    Attributes:
        public: the hub's public key (Z85).
        secret: the hub's secret key (Z85).
        authorized: folder of the authorised clients' public keys (``*.key``).
    """

    public: bytes
    secret: bytes
    authorized: Path

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server (call before ``bind``).

        Args:
            sock: the PULL data socket or the ROUTER clock socket.
        """
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def authorized_count(self) -> int:
        """Public key files in the authorised-clients folder (0 when it is missing)."""
        try:
            return sum(1 for p in self.authorized.iterdir() if p.name.endswith(PUBLIC_SUFFIX))
        except OSError:
            return 0

    def start_authenticator(self, ctx: zmq.Context) -> object:
        """Start the ZAP handler of ``ctx`` that accepts only the authorised clients.

        Args:
            ctx: the hub's context (ZAP covers every socket of that context).

        Returns:
            The running authenticator; call its ``stop()`` before terminating ``ctx``.
        """
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx, log=logging.getLogger("rankscope.hub.zap"))
        auth.start()
        auth.configure_curve(domain="*", location=str(self.authorized))
        self.warn_if_no_clients()
        return auth

    def warn_if_no_clients(self) -> None:
        """Log that every collector will be refused when no client key is authorised."""
        if self.authorized_count() == 0:
            log.warning(
                "hub: no authorised client keys in %s: every collector will be refused "
                "(rankscope keys writes one)",
                self.authorized,
            )


def load_hub_security(folder: Path) -> HubSecurity:
    """Read the hub's keys from a keys directory.

    Args:
        folder: the keys directory (holds ``hub.key_secret`` and ``authorized_clients/``).

    Returns:
        The hub's CURVE settings.

    Raises:
        KeyFileError: ``hub.key_secret`` is missing or holds no secret key.
    """
    public, secret = read_key_file(folder / HUB_SECRET)
    if secret is None:
        raise KeyFileError(f"key file {str(folder / HUB_SECRET)!r} holds no secret key")
    return HubSecurity(public, secret, folder / AUTHORIZED)


def hub_security(
    host: str,
    *,
    keys: str | os.PathLike[str] | None = None,
    insecure: bool = False,
    env: Mapping[str, str] | None = None,
) -> HubSecurity | None:
    """Choose how a hub bound at ``host`` secures its sockets (module docstring).

    Args:
        host: the bind host (``*``, ``127.0.0.1``, an address or a name); for ``ipc://``
            and ``inproc://``, pass ``localhost`` (they never leave the machine).
        keys: a keys directory named on the command line (CURVE is then required).
        insecure: plain ZeroMQ, whatever keys exist.
        env: the environment (``os.environ`` by default).

    Returns:
        The CURVE settings, or None for plain ZeroMQ.

    Raises:
        KeyFileError: ``keys`` holds no usable hub key pair, or both ``keys`` and
            ``insecure`` were given.
        InsecureBindError: no keys, ``host`` is beyond loopback and ``insecure`` is False.
    """
    if insecure:
        if keys is not None:
            raise KeyFileError("--keys and --insecure contradict each other: give one")
        if not is_loopback(host):
            log.warning(
                "hub: listening on %s without authentication or encryption (--insecure)", host
            )
        return None
    if keys is not None:
        return load_hub_security(Path(keys).expanduser())
    folder = keys_dir(env)
    if folder is not None and (folder / HUB_SECRET).exists():
        return load_hub_security(folder)
    if is_loopback(host):
        return None
    where = "RANKSCOPE_KEYS is off" if folder is None else f"no hub key in {folder}"
    raise InsecureBindError(
        f"refusing to listen on {host!r} beyond loopback without keys ({where}): run "
        "`rankscope keys` to make them (the hub then uses CURVE), bind tcp://127.0.0.1:PORT, "
        "or pass --insecure to accept unauthenticated plain traffic"
    )
