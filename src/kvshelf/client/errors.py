"""The client's errors, and the check that turns an error reply into one.

Imports only the protocol: every other part of the client raises these.
"""

from __future__ import annotations

from kvshelf.protocol import Error, ErrorCode, Reply


class KVShelfError(Exception):
    """Base class of the client's errors."""


class ServerUnavailable(KVShelfError):
    """No reply within the timeout, or a recent failure within ``retry_interval_s``."""


class ServerTimeout(ServerUnavailable):
    """No reply within the timeout: the server may be alive but too slow (or stopped)."""


class ServerError(KVShelfError):
    """The server rejected the request; it changed nothing.

    Args:
        code: the server's error code.
        message: the server's reason.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def checked(reply: Reply, expected: type | None) -> Reply:
    """Return ``reply`` if it is of the ``expected`` type (None: any non-error reply).

    Raises:
        ServerError: an error reply, or a reply of another type.
    """
    if isinstance(reply, Error):
        raise ServerError(reply.code, reply.message)
    if expected is not None and not isinstance(reply, expected):
        raise ServerError(
            ErrorCode.MALFORMED, f"expected {expected.__name__}, got {type(reply).__name__}"
        )
    return reply
