"""``rankscope keys``: make the CURVE keys that authenticate and encrypt the transport.

    rankscope keys                     # hub pair + the "client" pair, in the keys directory
    rankscope keys --client node7      # one more client pair (the hub pair is kept)
    rankscope keys --dir /shared/rankscope-keys

The keys directory is ``--dir``, else ``$RANKSCOPE_KEYS``, else ``~/.config/rankscope/keys``
(``$XDG_CONFIG_HOME/rankscope/keys``); its layout is in `rankscope.collector.security`. The
hub pair is made when the directory has none and kept otherwise; each client pair is made
and its public key authorised (copied into ``authorized_clients/``). Existing files are
never replaced without ``--force``; with it, the hub pair and the named client pairs are
made anew (every node then needs the new ``hub.key``). Files are 0600, folders 0700.

On each node, a collector needs ``hub.key`` and the client's ``.key_secret`` in its keys
directory (or a shared one named by ``RANKSCOPE_KEYS``); ``hub.key_secret`` stays on the
hub host. A hub restarted after ``--client`` reads the new authorised key.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from rankscope.collector.security import (
    AUTHORIZED,
    CLIENT_NAME,
    HUB_PUBLIC,
    HUB_SECRET,
    PUBLIC_SUFFIX,
    SECRET_SUFFIX,
    keys_dir,
    private_dir,
    write_key_pair,
)
from rankscope.errors import CommandError

if TYPE_CHECKING:
    from rankscope.hub.security import HubSecurity

HELP = "make the CURVE keys of the hub and its collectors (encrypted, authenticated transport)"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir",
        metavar="DIR",
        default=None,
        help="keys directory (default: $RANKSCOPE_KEYS, else ~/.config/rankscope/keys)",
    )
    p.add_argument(
        "--client",
        metavar="NAME",
        action="append",
        default=None,
        help=f"name of a client key pair to make; repeatable (default: {CLIENT_NAME}); a "
        "collector picks one with RANKSCOPE_CLIENT_KEY=DIR/NAME.key_secret",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace existing keys: the hub pair and the named client pairs",
    )


def _folder(arg: str | None) -> Path:
    if arg is not None:
        return Path(arg).expanduser()
    folder = keys_dir()
    if folder is None:
        raise CommandError("RANKSCOPE_KEYS turns keys off here; name a directory with --dir")
    return folder


def _client_names(names: list[str] | None) -> list[str]:
    names = names or [CLIENT_NAME]
    for name in names:
        if not _NAME.match(name) or name == "hub":
            raise CommandError(
                f"--client {name!r}: use 1-64 letters, digits, '.', '_' or '-', not 'hub'"
            )
    return list(dict.fromkeys(names))


def make_keys(folder: Path, clients: list[str], force: bool) -> list[str]:
    """Write the hub pair (unless kept) and the client pairs, and authorise the clients.

    Args:
        folder: the keys directory (created 0700 when missing).
        clients: client pair names.
        force: replace existing files.

    Returns:
        One line per file written, for the user.

    Raises:
        CommandError: a file to write exists and ``force`` is False, or the directory
            cannot be written.
    """
    hub_exists = (folder / HUB_SECRET).exists()
    if not force:
        taken = [folder / f"{n}{s}" for n in clients for s in (SECRET_SUFFIX, PUBLIC_SUFFIX)] + [
            folder / AUTHORIZED / f"{n}{PUBLIC_SUFFIX}" for n in clients
        ]
        found = [str(p) for p in taken if p.exists()]
        if found:
            raise CommandError(
                f"{found[0]} exists: pass --force to replace the keys (every node then needs "
                "the new ones), or --client NAME for another client pair"
            )
    lines = []
    try:
        private_dir(folder)
        authorized = private_dir(folder / AUTHORIZED)
        if force or not hub_exists:
            write_key_pair(folder, "hub")
            lines.append(f"hub key pair    {folder / HUB_SECRET}  (stays on the hub host)")
        else:
            lines.append(f"hub key pair    {folder / HUB_SECRET}  (kept)")
        lines.append(f"hub public key  {folder / HUB_PUBLIC}  (copy to every node)")
        for name in clients:
            public, secret = write_key_pair(folder, name)
            shutil.copyfile(public, authorized / public.name)
            (authorized / public.name).chmod(0o600)
            lines.append(f"client key pair {secret}  (copy to every node; authorised)")
    except OSError as exc:
        raise CommandError(f"cannot write keys in {folder}: {exc}") from None
    return lines


def run(args: argparse.Namespace) -> int:
    folder = _folder(args.dir)
    lines = make_keys(folder, _client_names(args.client), args.force)
    for line in lines:
        print(line)
    found = folder == keys_dir()
    where = "find them here" if found else f"find them with --keys {folder}"
    env = "" if found else f" (RANKSCOPE_KEYS={folder})"
    print(
        f"rankscope hub and rankscope watch {where} and use CURVE; a collector needs hub.key "
        f"and a client .key_secret in its keys directory{env}."
    )
    return 0


def add_transport_options(p: argparse.ArgumentParser) -> None:
    """``--keys DIR`` and ``--insecure``: how a hub that a command starts secures its sockets.

    Args:
        p: the command's parser.
    """
    p.add_argument(
        "--keys",
        metavar="DIR",
        default=None,
        help="use CURVE with the keys in DIR (default: CURVE when `rankscope keys` made keys "
        "in $RANKSCOPE_KEYS or ~/.config/rankscope/keys, else plain, on loopback only)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plain ZeroMQ, unauthenticated and unencrypted, even beyond loopback",
    )


def hub_security_of(args: argparse.Namespace, bind: str) -> HubSecurity | None:
    """The hub's CURVE settings for ``--keys`` / ``--insecure`` and the bind address.

    Args:
        args: parsed arguments (``keys``, ``insecure``).
        bind: the hub's data address.

    Returns:
        A `rankscope.hub.security.HubSecurity`, or None for plain ZeroMQ.

    Raises:
        CommandError: an unusable address or keys, or a bind beyond loopback without
            keys and without ``--insecure`` (the message says what to do).
    """
    from rankscope.hub.security import KeyFileError, hub_security
    from rankscope.hub.server import parse_bind

    try:
        transport, host, _ = parse_bind(bind)
        if transport != "tcp":
            # A socket file only its user can open: collectors speak plain ZeroMQ there.
            if args.keys:
                raise CommandError(
                    f"--keys applies to tcp addresses; {bind} is protected by its file's "
                    "permissions and speaks plain ZeroMQ"
                )
            return None
        return hub_security(host, keys=args.keys, insecure=args.insecure)
    except (ValueError, KeyFileError) as exc:
        raise CommandError(str(exc)) from None
