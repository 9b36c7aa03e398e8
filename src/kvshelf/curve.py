"""ZeroMQ CURVE keys: the folder ``kvshelf keygen`` writes, and loading it on either side.

A keys folder holds the server's key pair, one client key pair, and the allow-list: the public
keys of the clients the server accepts, one ``*.key`` file each, in ``clients/``::

    DIR/server.key          server public key
    DIR/server.key_secret   server key pair (the server reads it)
    DIR/client.key          client public key
    DIR/client.key_secret   client key pair (clients read it, with server.key)
    DIR/clients/client.key  the allow-list: a client whose public key is not here is refused

Every file is owner-only (0600, the folders 0700), and a secret file that other users can read
is refused when loaded. To admit another client, put its public ``.key`` file in ``clients/``
(the server reads the allow-list when it starts). A client machine needs ``server.key``,
``client.key`` and ``client.key_secret``.

The server side (:class:`ServerCurve`) and the client side (:class:`ClientCurve`) each set a
socket's CURVE options. Imports ZeroMQ only: no torch or vLLM.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

SERVER = "server"
CLIENT = "client"
ALLOWED_CLIENTS = "clients"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


class CurveKeyError(ValueError):
    """A keys folder that cannot be used; the message says which file and why."""


def keygen(directory: str | os.PathLike[str]) -> list[Path]:
    """Write a server and a client key pair and the allow-list into ``directory``.

    The folder is created (0700) if needed; an existing key file is never overwritten.

    Returns:
        The files written.

    Raises:
        CurveKeyError: a key file exists already, or the folder cannot be written.
    """
    folder = Path(directory)
    existing = [
        folder / name
        for name in (f"{SERVER}{SECRET_SUFFIX}", f"{CLIENT}{SECRET_SUFFIX}", ALLOWED_CLIENTS)
        if (folder / name).exists()
    ]
    if existing:
        raise CurveKeyError(f"{existing[0]} exists already; keygen never overwrites keys")
    # A umask, so that no key file is ever readable by others, not even for an instant.
    old_umask = os.umask(0o077)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        (folder / ALLOWED_CLIENTS).mkdir(mode=0o700)
        written = [Path(p) for p in zmq.auth.create_certificates(str(folder), SERVER)]
        written += [Path(p) for p in zmq.auth.create_certificates(str(folder), CLIENT)]
        allowed = folder / ALLOWED_CLIENTS / f"{CLIENT}{PUBLIC_SUFFIX}"
        allowed.write_bytes((folder / f"{CLIENT}{PUBLIC_SUFFIX}").read_bytes())
        written.append(allowed)
    except OSError as exc:
        raise CurveKeyError(f"cannot write keys into {folder}: {exc}") from None
    finally:
        os.umask(old_umask)
    for path in written:
        path.chmod(0o600)
    return written


def _load(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    """``(public, secret)`` of a key file; refuses a secret file others can read."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise CurveKeyError(
            f"cannot read {path}: {exc.strerror} (create the folder with kvshelf keygen DIR)"
        ) from None
    if secret and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CurveKeyError(
            f"{path} is readable by other users (mode {stat.S_IMODE(mode):04o}); chmod 600 it"
        )
    try:
        public, secret_key = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"{path} is not a ZeroMQ CURVE key file: {exc}") from None
    if secret and not secret_key:
        raise CurveKeyError(f"{path} holds no secret key")
    return public, secret_key


def _load_pair(folder: Path, name: str) -> tuple[bytes, bytes]:
    public, secret = _load(folder / f"{name}{SECRET_SUFFIX}", secret=True)
    assert secret is not None
    return public, secret


@dataclass(frozen=True)
class ServerCurve:
    """The server's key pair and the folder of accepted client public keys."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    allowed_clients: Path

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ServerCurve:
        """Read a keys folder's server side.

        Raises:
            CurveKeyError: a file is missing, unreadable, not a key, or too open.
        """
        folder = Path(directory)
        public, secret = _load_pair(folder, SERVER)
        allowed = folder / ALLOWED_CLIENTS
        if not allowed.is_dir():
            raise CurveKeyError(f"{allowed} is not a folder of allowed client keys")
        return cls(public, secret, allowed)

    def allowed_count(self) -> int:
        """How many client public keys the allow-list holds."""
        return len(list(self.allowed_clients.glob(f"*{PUBLIC_SUFFIX}")))

    def apply(self, socket: zmq.Socket) -> None:
        """Make ``socket`` a CURVE server (before it binds)."""
        socket.curve_secretkey = self.secret_key
        socket.curve_publickey = self.public_key
        socket.curve_server = True


@dataclass(frozen=True)
class ClientCurve:
    """A client's key pair and the server's public key."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    server_key: bytes

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ClientCurve:
        """Read a keys folder's client side.

        Raises:
            CurveKeyError: a file is missing, unreadable, not a key, or too open.
        """
        folder = Path(directory)
        server_public, _ = _load(folder / f"{SERVER}{PUBLIC_SUFFIX}", secret=False)
        return cls(*_load_pair(folder, CLIENT), server_public)

    def apply(self, socket: zmq.Socket) -> None:
        """Make ``socket`` a CURVE client of the server (before it connects)."""
        socket.curve_secretkey = self.secret_key
        socket.curve_publickey = self.public_key
        socket.curve_serverkey = self.server_key
