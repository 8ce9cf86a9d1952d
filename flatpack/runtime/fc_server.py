"""The HTTP server a Function Compute custom container runs: FC 3.0 delivers each event
function invocation as ``POST /invoke`` to the container's port (9000 unless the function
says otherwise, ``FC_SERVER_PORT``), and the handler is the same one Lambda calls
(``flatpack.runtime.handler.handle``). A handler error answers 500 with Lambda's error shape,
which FC reports to the caller as an unhandled invocation error.
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from flatpack.runtime.handler import handle

PORT_ENV = "FC_SERVER_PORT"
DEFAULT_PORT = 9000


class _Handler(BaseHTTPRequestHandler):
    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.split("?")[0] != "/invoke":
            self._answer(404, {"errorMessage": f"no route {self.path}; FC invokes POST /invoke"})
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            result = handle(json.loads(body or b"{}"))
        except Exception as err:  # noqa: BLE001 - the error goes back to the caller
            self._answer(500, {"errorMessage": str(err), "errorType": type(err).__name__,
                               "stackTrace": traceback.format_exc().splitlines()})
            return
        self._answer(200, result)

    def _answer(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
        pass


def make_server(host: str = "0.0.0.0", port: int | None = None) -> ThreadingHTTPServer:  # noqa: S104 - in the container
    return ThreadingHTTPServer((host, DEFAULT_PORT if port is None else port), _Handler)


def main() -> None:
    make_server(port=int(os.environ.get(PORT_ENV, DEFAULT_PORT))).serve_forever()


if __name__ == "__main__":
    main()
