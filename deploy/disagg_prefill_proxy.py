#!/usr/bin/env python3
"""A disaggregated prefill proxy for two vLLM OpenAI servers that share a kvshelf server.

Each completion request goes first to the prefill engine (vLLM started with
``"kv_role": "kv_producer"``) with ``max_tokens`` 1, which computes the prompt's KV and stores
it in kvshelf; then, unchanged, to the decode engine (``"kv_role": "kv_consumer"``), which
loads that KV from kvshelf instead of computing it, and whose answer (streamed or not) is the
client's. A failed prefill is logged and the request still goes to the decode engine, which
then computes the prompt itself: the answer is the same, only slower.

Standard library only::

    python3 disagg_prefill_proxy.py --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Serves ``POST /v1/completions`` and ``POST /v1/chat/completions``; any other ``GET`` or
``POST`` goes to the decode engine as it is (``GET /v1/models``, ``/health``, ...).

Input is checked before anything is sent on: the request target must be a path (origin form:
``/`` then not ``/``), and the URL made from it must still name the engine's host and port; a
body needs a ``Content-Length`` of at most :data:`MAX_BODY_BYTES` (no chunked bodies), and a
completion's body must be a JSON object. Anything else is answered 400 (413 for a body over
the maximum, 411 for a chunked one, 408 for one not received within :data:`CLIENT_TIMEOUT_S`)
with a message, and the connection is closed: nothing a client sends ends a connection
without an answer but a request whose head (request line and headers) does not come whole
within :data:`CLIENT_TIMEOUT_S` of the connection or of the previous answer, however the
bytes trickle in (one deadline over every receive of the head). At most
``--max-connections`` (:data:`MAX_CONNECTIONS`) connections are served at once, each on a
thread; one more is answered 503 and closed at once, unread. ``http.server`` itself turns a
target starting with ``//`` into a path on the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger("disagg_prefill_proxy")

PREFILLED_PATHS = ("/v1/completions", "/v1/chat/completions")
# Response headers not to copy: the proxy frames its own response.
HOP_HEADERS = {"connection", "transfer-encoding", "content-length", "keep-alive"}
CHUNK_BYTES = 64 * 1024
# The largest request body taken: a completion's prompt as text or token ids is well under a
# MiB even at 100k tokens; images in a chat request are what makes bodies large.
MAX_BODY_BYTES = 32 * 1024 * 1024
# The longest a client may take to send a request's head, and then its body (each one
# deadline, whatever the pace of the bytes): a client that sends half a request does not hold
# a thread.
CLIENT_TIMEOUT_S = 30.0
# Connections served at once (a thread and, while answering, an engine connection each: 512
# descriptors, under the usual `ulimit -n` of 1024); one more is answered 503.
MAX_CONNECTIONS = 256
# A refused connection's answer.
BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
    b"Content-Type: application/json\r\nContent-Length: 47\r\n\r\n"
    b'{"error": "the proxy is at its connection cap"}'
)


class BadRequest(Exception):
    """A request the proxy refuses: answered ``status`` with ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's request: the same prompt, one token, not streamed."""
    prefill = dict(body, max_tokens=1, stream=False)
    prefill.pop("stream_options", None)
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return prefill


def check_base_url(url: str) -> str:
    """``url`` as an engine's base URL (``http[s]://host[:port]``, no trailing ``/``).

    Raises:
        ValueError: not an http(s) URL with a host.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL with a host: {url!r}")
    return url.rstrip("/")


def upstream_url(base: str, target: str) -> str:
    """The engine's URL for the request target ``target``.

    Raises:
        BadRequest: ``target`` is not a path (origin form), or the URL made from it would name
            another host or port than ``base``.
    """
    if not target.startswith("/") or target.startswith("//"):
        raise BadRequest(
            400, f"the request target must be a path starting with one '/': {target[:80]!r}"
        )
    url = base + target
    if urlsplit(url).netloc != urlsplit(base).netloc:
        raise BadRequest(400, f"the request target {target[:80]!r} leaves the engine's host")
    return url


def content_length(value: str | None) -> int:
    """A request's body size from its ``Content-Length`` header (0 without one).

    Raises:
        BadRequest: not a decimal number (400), or over :data:`MAX_BODY_BYTES` (413).
    """
    if value is None:
        return 0
    digits = value.strip()
    # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
    if not (digits.isascii() and digits.isdigit()):
        raise BadRequest(400, f"Content-Length must be a non-negative integer, not {value[:40]!r}")
    size = int(digits)
    if size > MAX_BODY_BYTES:
        raise BadRequest(413, f"Content-Length {size} is over the proxy's {MAX_BODY_BYTES} bytes")
    return size


def completion_body(raw: bytes) -> dict[str, Any]:
    """A completion request's body: a JSON object.

    Raises:
        BadRequest: not JSON, or JSON but not an object.
    """
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise BadRequest(400, f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(400, f"the request body must be a JSON object, not {type(body).__name__}")
    return body


class DeadlineSocket:
    """The client's socket as its request reader sees it: while ``deadline`` is set (a
    ``time.monotonic()`` value), each receive waits only for the time left until it, and none
    starts after it (``TimeoutError``)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.deadline: float | None = None

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request's head took too long")
            self._sock.settimeout(left)
        return self._sock.recv_into(buffer, nbytes, flags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class Proxy(BaseHTTPRequestHandler):
    """Handles one client connection; ``server.prefill``/``server.decode`` are base URLs."""

    _reader: DeadlineSocket

    protocol_version = "HTTP/1.1"
    # The client's socket timeout (BaseHTTPRequestHandler applies it to the connection).
    timeout = CLIENT_TIMEOUT_S
    # The engines' (a decode streams its answer over minutes).
    timeout_s = 600.0

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain reader, replaced by one with the head's deadline
        self._reader = DeadlineSocket(self.connection)
        self.rfile = io.BufferedReader(socket.SocketIO(self._reader, "rb"))  # type: ignore[arg-type]

    def handle_one_request(self) -> None:
        # The head of the next request, from now: one deadline, not one per receive.
        self._reader.deadline = time.monotonic() + self.timeout
        super().handle_one_request()

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        # The head is in; the body has a deadline of its own (_body).
        self._reader.deadline = None
        self.connection.settimeout(self.timeout)
        return parsed

    def do_POST(self) -> None:
        self._handle("POST")

    def do_GET(self) -> None:
        self._handle("GET")

    def _handle(self, method: str) -> None:
        try:
            decode = upstream_url(self.server.decode, self.path)  # type: ignore[attr-defined]
            raw = None
            if method == "POST":
                raw = self._body()
                if self.path in PREFILLED_PATHS:
                    self._prefill(completion_body(raw))
        except BadRequest as exc:
            self._refuse(exc.status, str(exc))
            return
        except Exception:
            logger.exception("%s %s failed", method, self.path[:80])
            self._refuse(500, "the proxy failed; see its log")
            return
        try:
            self._forward(method, decode, raw)
        except OSError as exc:  # the client went away mid-answer (a cancelled stream)
            logger.info("%s %s: the client's connection failed: %s", method, self.path[:80], exc)
            self.close_connection = True

    def _body(self) -> bytes:
        if "Transfer-Encoding" in self.headers:
            raise BadRequest(411, "chunked request bodies are not supported: send Content-Length")
        size = content_length(self.headers.get("Content-Length"))
        # The socket timeout bounds each receive; this bounds the body (a client sending a
        # byte now and then would pass every receive's timeout).
        deadline = time.monotonic() + self.timeout
        raw = bytearray()
        try:
            while len(raw) < size and time.monotonic() < deadline:
                chunk = self.rfile.read1(min(size - len(raw), CHUNK_BYTES))
                if not chunk:
                    break
                raw += chunk
        except TimeoutError:
            pass
        if len(raw) < size:
            raise BadRequest(
                408,
                f"the body ended after {len(raw)} of {size} bytes, or took over {self.timeout} s",
            )
        return bytes(raw)

    def _prefill(self, body: dict[str, Any]) -> None:
        request = urllib.request.Request(
            upstream_url(self.server.prefill, self.path),  # type: ignore[attr-defined]
            data=json.dumps(prefill_body(body)).encode(),
            headers={"Content-Type": "application/json", **self._auth()},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except (urllib.error.URLError, OSError) as exc:
            logger.warning("prefill failed (%s): the decode engine computes the prompt", exc)

    def _forward(self, method: str, url: str, raw: bytes | None) -> None:
        headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
        request = urllib.request.Request(
            url,
            data=raw,
            headers={**headers, **self._auth()},
            method=method,
        )
        try:
            response = urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            response = exc
        except (urllib.error.URLError, OSError) as exc:
            self._reply(502, json.dumps({"error": f"decode engine: {exc}"}).encode())
            return
        with response:
            self.send_response(response.status)
            for name, value in response.headers.items():
                if name.lower() not in HOP_HEADERS:
                    self.send_header(name, value)
            # Relayed as it comes (a streamed answer's events as they are made), chunked.
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := response.read1(CHUNK_BYTES):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    def _auth(self) -> dict[str, str]:
        token = self.headers.get("Authorization")
        return {"Authorization": token} if token else {}

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with ``message`` and close: the rest of the request (a body not
        read) must not be taken for the next one."""
        self.close_connection = True
        with contextlib.suppress(OSError):  # a client that went away gets nothing
            self._reply(status, json.dumps({"error": message}).encode(), close=True)

    def _reply(self, status: int, body: bytes, close: bool = False) -> None:
        self.send_response(status)
        if close:
            self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug(format, *args)


class ProxyServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once; one more is answered
    503 on the accepting thread, without reading it, and closed.

    Args:
        address: (host, port) to listen on.
        prefill: the kv_producer engine's base URL.
        decode: the kv_consumer engine's base URL.
        handler: the request handler class.
        max_connections: connections served at once.
    """

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        prefill: str,
        decode: str,
        handler: type[BaseHTTPRequestHandler] = Proxy,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        super().__init__(address, handler)
        self.prefill = prefill
        self.decode = decode
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        """The 503, without blocking the accepting thread: the answer fits an empty send
        buffer; what the client sent already is read (else closing would reset the
        connection, and the answer with it), the rest never."""
        with contextlib.suppress(OSError):
            request.setblocking(False)
            request.send(BUSY_RESPONSE)
            request.recv(CHUNK_BYTES)
        self.shutdown_request(request)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", required=True, help="the kv_producer engine's base URL")
    parser.add_argument("--decode", required=True, help="the kv_consumer engine's base URL")
    parser.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="connections served at once; one more is answered 503 (default %(default)s)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        prefill, decode = check_base_url(args.prefill), check_base_url(args.decode)
    except ValueError as exc:
        parser.error(str(exc))
    server = ProxyServer(
        (args.host, args.port), prefill, decode, max_connections=args.max_connections
    )
    logger.info(
        "proxy on %s:%d: prefill %s, decode %s", args.host, args.port, args.prefill, args.decode
    )
    server.serve_forever()


if __name__ == "__main__":
    main()
