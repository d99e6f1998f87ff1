"""CURVE keys: where they live, how they are written and read, and the client's half.

rankscope authenticates and encrypts its transport with ZeroMQ CURVE: the hub holds a key
pair, every collector holds a client key pair and the hub's public key, and the hub accepts
only clients whose public key is in its authorised-clients folder (checked through ZeroMQ's
ZAP handler, `rankscope.hub.security`). ``rankscope keys`` writes them all.

The keys directory (``$RANKSCOPE_KEYS``; by default ``$XDG_CONFIG_HOME/rankscope/keys``,
that is ``~/.config/rankscope/keys``)::

    hub.key                     the hub's public key: every node needs it
    hub.key_secret              the hub's key pair: stays on the hub host
    client.key_secret           the collectors' key pair: every node needs it
    client.key                  its public key
    authorized_clients/         public keys (*.key) of the clients the hub accepts

Files are mode 0600 and the folders 0700. The environment that launchers set:

- ``RANKSCOPE_KEYS``: the keys directory (a shared filesystem works); ``none`` turns keys
  off for this process: it speaks plain ZeroMQ.
- ``RANKSCOPE_CLIENT_KEY``: the client key pair file, when it is not
  ``<keys>/client.key_secret`` (pairs made with ``rankscope keys --client NAME``).

One rule on both sides, since a collector cannot ask the hub what it speaks: where keys
are found, CURVE is used, on loopback too. A collector with ``hub.key`` and a client key
pair uses CURVE; one without them speaks plain ZeroMQ, and a hub that requires CURVE then
refuses its handshake: nothing is delivered, the collector drops and counts as when the
hub is unreachable, and it logs one warning (`rankscope.collector.sender`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq

log = logging.getLogger("rankscope")

HUB_PUBLIC = "hub.key"
HUB_SECRET = "hub.key_secret"
CLIENT_NAME = "client"
AUTHORIZED = "authorized_clients"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
KEYS_ENV = "RANKSCOPE_KEYS"
CLIENT_KEY_ENV = "RANKSCOPE_CLIENT_KEY"
OFF = ("none", "off")
"""Values of ``RANKSCOPE_KEYS`` that turn keys off."""

_PUBLIC_BANNER = "#   ZeroMQ CURVE public key, made by `rankscope keys`\n"
_SECRET_BANNER = (
    "#   ZeroMQ CURVE key pair, made by `rankscope keys`\n"
    "#   The secret key: keep this file 0600 and give it to no one else.\n"
)


class KeyFileError(ValueError):
    """A key file or keys directory that cannot be used; the message names it."""


def default_keys_dir(env: Mapping[str, str] | None = None) -> Path:
    """The keys directory when ``RANKSCOPE_KEYS`` does not name one.

    Args:
        env: the environment (``os.environ`` by default).

    Returns:
        ``$XDG_CONFIG_HOME/rankscope/keys``, or ``~/.config/rankscope/keys``.
    """
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "rankscope" / "keys"


def keys_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """The keys directory this process uses.

    Args:
        env: the environment (``os.environ`` by default).

    Returns:
        ``$RANKSCOPE_KEYS`` or the default directory; None when ``RANKSCOPE_KEYS`` is
        ``none`` or ``off``.
    """
    env = os.environ if env is None else env
    raw = env.get(KEYS_ENV, "").strip()
    if raw.lower() in OFF:
        return None
    return Path(raw).expanduser() if raw else default_keys_dir(env)


def is_loopback(host: str) -> bool:
    """Whether a bind host reaches only this machine.

    Args:
        host: the host part of ``tcp://HOST:PORT`` (``*``, an address, a name).

    Returns:
        True for ``localhost``, ``127.x.y.z`` and ``::1``; False for everything else,
        wildcards and interface names included.
    """
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def read_key_file(path: Path) -> tuple[bytes, bytes | None]:
    """Read a key file written by ``rankscope keys`` (the ZeroMQ certificate format).

    Args:
        path: a ``.key`` (public) or ``.key_secret`` (pair) file.

    Returns:
        ``(public, secret)`` as Z85 bytes; ``secret`` is None in a public key file.

    Raises:
        KeyFileError: the file is missing, unreadable or holds no valid key.
    """
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"key file {str(path)!r}: {exc}") from None
    for key in (public, secret):
        if key is not None and len(key) != 40:
            raise KeyFileError(f"key file {str(path)!r}: not a 40-character Z85 CURVE key")
    return public, secret


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` as a new 0600 file, atomically (a reader sees the old
    file or the new one, never half of one)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def private_dir(path: Path) -> Path:
    """Create a directory (and its parents) and make it 0700.

    Args:
        path: the directory.

    Returns:
        The path.
    """
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_key_pair(folder: Path, name: str) -> tuple[Path, Path]:
    """Make a fresh CURVE key pair and write ``NAME.key`` and ``NAME.key_secret``.

    Existing files of that name are replaced: callers decide whether that is allowed.

    Args:
        folder: an existing directory.
        name: the pair's name.

    Returns:
        ``(public_file, secret_file)``, both mode 0600.
    """
    public, secret = zmq.curve_keypair()
    curve = f'curve\n    public-key = "{public.decode()}"\n'
    public_file = folder / f"{name}{PUBLIC_SUFFIX}"
    secret_file = folder / f"{name}{SECRET_SUFFIX}"
    _write_private(
        secret_file,
        f'{_SECRET_BANNER}\nmetadata\n{curve}    secret-key = "{secret.decode()}"\n',
    )
    _write_private(public_file, f"{_PUBLIC_BANNER}\nmetadata\n{curve}")
    return public_file, secret_file


@dataclass(frozen=True)
class ClientCurve:
    """What a collector's sockets need to speak CURVE to the hub.

    Attributes:
        public: this client's public key (Z85).
        secret: this client's secret key (Z85).
        server: the hub's public key (Z85).
        source: where the keys came from, for messages.
    """

    public: bytes
    secret: bytes
    server: bytes
    source: str = ""

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the hub (call before ``connect``).

        Args:
            sock: a PUSH or DEALER socket.
        """
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_serverkey = self.server


def load_client_curve(folder: Path, client_file: Path | None = None) -> ClientCurve:
    """Read the client's keys from a keys directory.

    Args:
        folder: the keys directory (holds ``hub.key``).
        client_file: the client key pair file (default ``folder/client.key_secret``).

    Returns:
        The client's CURVE settings.

    Raises:
        KeyFileError: a file is missing or holds no valid key.
    """
    client_file = client_file or folder / f"{CLIENT_NAME}{SECRET_SUFFIX}"
    server, _ = read_key_file(folder / HUB_PUBLIC)
    public, secret = read_key_file(client_file)
    if secret is None:
        raise KeyFileError(f"key file {str(client_file)!r} holds no secret key")
    return ClientCurve(public, secret, server, source=str(folder))


def client_curve_from_env(env: Mapping[str, str] | None = None) -> ClientCurve | None:
    """The client keys this process finds (``RANKSCOPE_KEYS``, ``RANKSCOPE_CLIENT_KEY``,
    the default directory), or None to speak plain ZeroMQ.

    Never raises, since it runs inside training processes: keys that were named or are
    partly there but cannot be used are reported in one warning, and the process speaks
    plain ZeroMQ (a hub that requires CURVE then refuses it, which the sender reports).

    Args:
        env: the environment (``os.environ`` by default).

    Returns:
        The client's CURVE settings, or None when no keys are found or keys are off.
    """
    env = os.environ if env is None else env
    try:
        return _find_client_curve(env)
    except Exception as exc:
        log.warning("rankscope: not using CURVE keys: %s", exc)
        return None


def _find_client_curve(env: Mapping[str, str]) -> ClientCurve | None:
    folder = keys_dir(env)
    if folder is None:
        return None
    raw_client = env.get(CLIENT_KEY_ENV, "").strip()
    client_file = Path(raw_client).expanduser() if raw_client else None
    named = bool(env.get(KEYS_ENV, "").strip()) or client_file is not None
    pair = client_file or folder / f"{CLIENT_NAME}{SECRET_SUFFIX}"
    if not named and not (folder / HUB_PUBLIC).exists() and not pair.exists():
        return None
    return load_client_curve(folder, client_file)
