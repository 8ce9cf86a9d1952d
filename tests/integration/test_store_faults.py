"""Stalled reads over a real socket: boto3 against a tiny S3 endpoint on 127.0.0.1 whose
responses go silent mid-body. A stall longer than the read timeout is cut and retried on a
fresh request; a short one (2 s, below the default read timeout) is waited out with no retry.
The tests count requests, never wall-clock time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flatpack.runtime.store import READ_TIMEOUT_S, S3Store

BODY = bytes(range(256)) * 64   # 16 KiB


class StallingS3:
    """Answers every GetObject with BODY; the first ``stalls`` responses send half the body,
    go silent for ``stall_s``, then send the rest (if the client is still there)."""

    def __init__(self, stalls: int, stall_s: float) -> None:
        self.stalls, self.stall_s = stalls, stall_s
        self.requests = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                with outer.lock:
                    outer.requests += 1
                    stall = outer.requests <= outer.stalls
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(BODY)))
                self.send_header("ETag", '"0123456789abcdef"')
                self.end_headers()
                half = len(BODY) // 2
                try:
                    self.wfile.write(BODY[:half])
                    self.wfile.flush()
                    if stall:
                        time.sleep(outer.stall_s)
                    self.wfile.write(BODY[half:])
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass   # the client cut the stalled response

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def stalling() -> Iterator[Callable[[int, float], StallingS3]]:
    servers: list[StallingS3] = []

    def start(stalls: int, stall_s: float) -> StallingS3:
        server = StallingS3(stalls, stall_s)
        server.thread.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.server.shutdown()
        server.server.server_close()


def _store(endpoint: str, read_timeout_s: float | None = None) -> S3Store:
    return S3Store("bucket", "run", endpoint, "us-east-1", aws_access_key_id="a", aws_secret_access_key="b",
                   read_timeout_s=read_timeout_s)


def test_a_body_that_stalls_past_the_read_timeout_is_cut_and_read_again(stalling):
    server = stalling(stalls=1, stall_s=4.0)
    with _store(server.endpoint, read_timeout_s=1.0) as store:
        assert store.get("k") == BODY
    assert server.requests == 2   # the stalled read was cut and retried on a fresh request


def test_a_short_stall_is_waited_out_without_a_retry(stalling):
    server = stalling(stalls=1, stall_s=2.0)
    with _store(server.endpoint) as store:   # the default read timeout
        assert isinstance(store, S3Store)
        assert store.read_timeout_s == READ_TIMEOUT_S > 2.0
        assert store.get("k") == BODY
    assert server.requests == 1
