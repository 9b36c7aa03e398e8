"""``deploy/disagg_prefill_proxy.py`` against hostile input (issue 33, D10), without vLLM: the
proxy runs on loopback in front of two tiny HTTP servers standing in for the engines, which
record what reaches them. A request target that is not a path, a bad or oversized
``Content-Length``, a body cut short or never sent, a completion body that is not a JSON
object: each gets an error answer with a message and reaches no engine; a well-formed request
still goes to both engines."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

PROXY_PATH = Path(__file__).resolve().parents[2] / "deploy" / "disagg_prefill_proxy.py"
# The proxy's client timeout in these tests (30 s in production).
CLIENT_TIMEOUT_S = 0.5
# The proxy's connection cap in these tests (256 in production).
MAX_CONNECTIONS = 4


def load_proxy() -> ModuleType:
    spec = importlib.util.spec_from_file_location("disagg_prefill_proxy", PROXY_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


proxy = load_proxy()


class Engine(BaseHTTPRequestHandler):
    """An engine stand-in: records each request (method, path, headers, body) and answers
    ``{"engine": name}``."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._record(b"")

    def do_POST(self) -> None:
        self._record(self.rfile.read(int(self.headers["Content-Length"])))

    def _record(self, body: bytes) -> None:
        self.server.seen.append((self.command, self.path, dict(self.headers), body))  # type: ignore[attr-defined]
        answer = json.dumps({"engine": self.server.name}).encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Setup:
    def __init__(self) -> None:
        self.servers: list[ThreadingHTTPServer] = []
        self.prefill = self._serve(Engine, "prefill")
        self.decode = self._serve(Engine, "decode")
        handler = type("TestProxy", (proxy.Proxy,), {"timeout": CLIENT_TIMEOUT_S})
        self.proxy = proxy.ProxyServer(
            ("127.0.0.1", 0),
            self.url(self.prefill),
            self.url(self.decode),
            handler,
            max_connections=MAX_CONNECTIONS,
        )
        threading.Thread(target=self.proxy.serve_forever, args=(0.02,), daemon=True).start()
        self.servers.append(self.proxy)
        self.port = self.proxy.server_address[1]

    @staticmethod
    def url(server: ThreadingHTTPServer) -> str:
        return f"http://127.0.0.1:{server.server_address[1]}"

    def _serve(self, handler: type[BaseHTTPRequestHandler], name: str) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        server.seen = []  # type: ignore[attr-defined]
        server.name = name  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
        self.servers.append(server)
        return server

    def send(self, raw: bytes, then_wait_s: float = 5.0) -> tuple[int | None, bytes, float]:
        """Send ``raw`` and read until the proxy closes: the status (None when it closed
        without an answer), the whole response and how long it took."""
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", self.port)) as sock:
            sock.settimeout(then_wait_s)
            sock.sendall(raw)
            response = b""
            try:
                while chunk := sock.recv(65536):
                    response += chunk
                    if b"\r\n\r\n" in response and _complete(response):
                        break
            except TimeoutError:
                pass
        took = time.monotonic() - started
        status = int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/") else None
        return status, response, took

    @property
    def reached(self) -> list[tuple[str, str, dict[str, str], bytes]]:
        return [*self.prefill.seen, *self.decode.seen]  # type: ignore[attr-defined]

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


def _complete(response: bytes) -> bool:
    """Whether ``response`` holds a whole answer (Content-Length or chunked)."""
    head, _, body = response.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return body.endswith(b"0\r\n\r\n")


@pytest.fixture
def setup() -> Iterator[Setup]:
    made = Setup()
    try:
        yield made
    finally:
        made.close()


def post(path: str, body: bytes, *headers: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: proxy", *headers]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def error_of(response: bytes) -> str:
    return json.loads(response.partition(b"\r\n\r\n")[2])["error"]


def test_a_well_formed_completion_reaches_both_engines(setup: Setup) -> None:
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 5}).encode()
    status, response, _ = setup.send(post("/v1/completions", body, "Authorization: Bearer t"))
    assert status == 200 and b'{"engine": "decode"}' in response
    (prefill,) = setup.prefill.seen  # type: ignore[attr-defined]
    (decode,) = setup.decode.seen  # type: ignore[attr-defined]
    assert json.loads(prefill[3])["max_tokens"] == 1 and decode[3] == body
    assert prefill[2]["Authorization"] == decode[2]["Authorization"] == "Bearer t"


@pytest.mark.parametrize(
    "target", ["3/internal/secret", ".evil.example/x", "http://evil.example/x", "*"]
)
def test_a_request_target_that_is_not_a_path_reaches_no_engine(setup: Setup, target: str) -> None:
    for raw in (f"GET {target} HTTP/1.1\r\nHost: p\r\n\r\n".encode(), post(target, b"{}")):
        status, response, _ = setup.send(raw)
        assert status == 400, response
        assert "request target" in error_of(response)
    assert setup.reached == []


def test_a_target_starting_with_two_slashes_stays_on_the_engine(setup: Setup) -> None:
    # http.server makes it a path (one slash) before the proxy sees it.
    status, _, _ = setup.send(b"GET //evil.example/x HTTP/1.1\r\nHost: p\r\n\r\n")
    assert status == 200
    assert [(m, p) for m, p, _, _ in setup.reached] == [("GET", "/evil.example/x")]


def test_the_upstream_url_is_a_path_on_the_engine_host() -> None:
    # A base URL without a port: a target glued to it must not make another host.
    assert proxy.upstream_url("http://decode", "/v1/models") == "http://decode/v1/models"
    for target in (".evil.example/x", "//evil.example/x", "@evil.example/x", ""):
        with pytest.raises(proxy.BadRequest, match="request target"):
            proxy.upstream_url("http://decode", target)
    with pytest.raises(ValueError):
        proxy.check_base_url("decode:8200")


@pytest.mark.parametrize(
    ("header", "status", "message"),
    [
        ("Content-Length: -1", 400, "non-negative integer"),
        ("Content-Length: abc", 400, "non-negative integer"),
        ("Content-Length: 1e3", 400, "non-negative integer"),
        (f"Content-Length: {proxy.MAX_BODY_BYTES + 1}", 413, "over the proxy's"),
        ("Transfer-Encoding: chunked", 411, "chunked"),
    ],
)
def test_a_bad_content_length_is_refused_with_a_message(
    setup: Setup, header: str, status: int, message: str
) -> None:
    got, response, took = setup.send(post("/v1/completions", b"{}", header))
    assert got == status, response
    assert message in error_of(response)
    assert took < CLIENT_TIMEOUT_S + 1.0  # answered, not left to time out
    assert setup.reached == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[1]", "must be a JSON object, not list"),
        (b'"text"', "must be a JSON object, not str"),
        (b"not json", "not JSON"),
        (b"\xff\xfe{}", "not JSON"),
    ],
)
def test_a_completion_body_that_is_not_a_json_object_is_a_400(
    setup: Setup, body: bytes, message: str
) -> None:
    for path in proxy.PREFILLED_PATHS:
        status, response, _ = setup.send(post(path, body))
        assert status == 400, response
        assert message in error_of(response)
    assert setup.reached == []


def test_a_body_cut_short_is_a_408_within_the_client_timeout(setup: Setup) -> None:
    raw = post("/v1/completions", b'{"prompt": "', "Content-Length: 100")
    status, response, took = setup.send(raw)
    assert status == 408, response
    assert "ended after 12 of 100 bytes" in error_of(response)
    assert took < CLIENT_TIMEOUT_S + 1.0
    assert setup.reached == []


def test_a_half_sent_request_head_does_not_hold_a_thread(setup: Setup) -> None:
    # The proxy's own handler has a client timeout (these tests shorten it).
    assert proxy.Proxy.timeout == proxy.CLIENT_TIMEOUT_S <= 60
    threads = threading.active_count()
    status, _, took = setup.send(b"POST /v1/completions HTTP/1.1\r\nHost: p\r\n")
    assert status is None  # no request to answer: the connection is closed
    assert took < CLIENT_TIMEOUT_S + 1.0
    time.sleep(0.2)
    assert threading.active_count() <= threads


# Issue 49 (adversarial review of 2026-12-07, defect 7).


def test_a_content_length_of_non_ascii_digits_is_a_400(setup: Setup) -> None:
    """``"²".isdigit()`` is true and ``int("²")`` fails: before, a 500 and a traceback."""
    raw = b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Length: \xb2\r\n\r\n{}"
    status, response, _ = setup.send(raw)
    assert status == 400, response
    assert "non-negative integer" in error_of(response)
    assert setup.reached == []


def test_a_head_trickling_in_is_closed_at_one_deadline_for_the_whole_head(setup: Setup) -> None:
    """A byte every fifth of the client timeout passes every receive's timeout: before, such a
    connection was never closed (the review's byte per 10 s against 30 s); now its head has
    one deadline."""
    with socket.create_connection(("127.0.0.1", setup.port)) as sock:
        sock.settimeout(CLIENT_TIMEOUT_S / 5)
        started = time.monotonic()
        closed_after = None
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nX-Slow: " + b"a" * 1000:
            try:
                sock.sendall(bytes([byte]))
                if sock.recv(1) == b"":
                    closed_after = time.monotonic() - started
                    break
            except TimeoutError:
                continue  # still open: next byte
            except OSError:  # reset: closed
                closed_after = time.monotonic() - started
                break
            if time.monotonic() - started > 10 * CLIENT_TIMEOUT_S:
                break
    assert closed_after is not None, "the trickling connection was never closed"
    assert closed_after < CLIENT_TIMEOUT_S + 0.5, closed_after
    assert setup.reached == []


def test_connections_past_the_cap_get_a_503_at_once(setup: Setup) -> None:
    """Before, every connection got a thread of its own, without limit (the review: 200 slow
    connections, 201 threads, and about 1,000 exhaust ``ulimit -n``)."""
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", setup.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)  # each has its thread, waiting for a head
        status, response, took = setup.send(b"GET /v1/models HTTP/1.1\r\nHost: p\r\n\r\n")
        assert status == 503, response
        assert "connection cap" in error_of(response)
        assert took < CLIENT_TIMEOUT_S / 2
        assert threading.active_count() <= threads + MAX_CONNECTIONS
    finally:
        for sock in idle:
            sock.close()
    # The idle ones gone, a request is served again.
    deadline = time.monotonic() + 5.0
    while (status := setup.send(b"GET /v1/models HTTP/1.1\r\nHost: p\r\n\r\n")[0]) == 503:
        assert time.monotonic() < deadline, "the cap's slots were not given back"
        time.sleep(0.05)
    assert status == 200
