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

Serves ``POST /v1/completions`` and ``POST /v1/chat/completions``; any other path and
method goes to the decode engine as it is (``GET /v1/models``, ``/health``, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("disagg_prefill_proxy")

PREFILLED_PATHS = ("/v1/completions", "/v1/chat/completions")
# Response headers not to copy: the proxy frames its own response.
HOP_HEADERS = {"connection", "transfer-encoding", "content-length", "keep-alive"}
CHUNK_BYTES = 64 * 1024


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's request: the same prompt, one token, not streamed."""
    prefill = dict(body, max_tokens=1, stream=False)
    prefill.pop("stream_options", None)
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return prefill


class Proxy(BaseHTTPRequestHandler):
    """Handles one client connection; ``server.prefill``/``server.decode`` are base URLs."""

    protocol_version = "HTTP/1.1"
    timeout_s = 600.0

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path in PREFILLED_PATHS:
            try:
                body = json.loads(raw)
            except json.JSONDecodeError:
                self._reply(400, b'{"error": "the request body is not JSON"}')
                return
            self._prefill(body)
        self._forward("POST", raw)

    def do_GET(self) -> None:
        self._forward("GET", None)

    def _prefill(self, body: dict[str, Any]) -> None:
        request = urllib.request.Request(
            self.server.prefill + self.path,  # type: ignore[attr-defined]
            data=json.dumps(prefill_body(body)).encode(),
            headers={"Content-Type": "application/json", **self._auth()},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except (urllib.error.URLError, OSError) as exc:
            logger.warning("prefill failed (%s): the decode engine computes the prompt", exc)

    def _forward(self, method: str, raw: bytes | None) -> None:
        headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
        request = urllib.request.Request(
            self.server.decode + self.path,  # type: ignore[attr-defined]
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

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug(format, *args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", required=True, help="the kv_producer engine's base URL")
    parser.add_argument("--decode", required=True, help="the kv_consumer engine's base URL")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    server = ThreadingHTTPServer((args.host, args.port), Proxy)
    server.prefill = args.prefill.rstrip("/")  # type: ignore[attr-defined]
    server.decode = args.decode.rstrip("/")  # type: ignore[attr-defined]
    logger.info("proxy on %s:%d: prefill %s, decode %s", args.host, args.port, args.prefill,
                args.decode)
    server.serve_forever()


if __name__ == "__main__":
    main()
