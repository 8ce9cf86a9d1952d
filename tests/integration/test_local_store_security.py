"""The local S3 server (SeaweedFS) refuses unauthenticated access on every listener it opens:
only the S3 endpoint, with the server's keys, reads and writes (issue 17, item 4; the HTTP
ports' mutual TLS, issue 37). tests/security/test_store_as_another_user.py attacks a live
run's store as another uid.

Each test writes (or reads) the way a co-tenant would: a user of the same machine who reaches
every 127.0.0.1 port but has neither the S3 keys nor the server's JWT keys or certificate.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import stat
import subprocess
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from flatpack.runtime.s3server import LocalS3Server

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _http(method: str, url: str, data: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/octet-stream"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture
def key(s3_server: LocalS3Server):
    """A fresh object written through S3 with the keys (what the attacker tries to overwrite)."""
    name = f"sec-{uuid.uuid4().hex}/stage_000/code.py"
    with s3_server.store() as store:
        store.put(name, b"print('the real stage')")
        yield name
        store.delete(name)


def test_every_tcp_port_weed_opens_is_one_the_server_secures(s3_server):
    """The ports probed below are all weed listens on: a listener added by a later weed shows here."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=False).stdout
    if not out:
        pytest.skip("ss is not available to list weed's listeners")
    pid = s3_server._proc.pid
    listening = {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if f"pid={pid}," in line}
    assert listening, out
    assert listening <= set(s3_server.ports.values()), listening - set(s3_server.ports.values())
    assert all(line.split()[3].startswith("127.0.0.1:") for line in out.splitlines() if f"pid={pid}," in line)


def _https(server: LocalS3Server, method: str, url: str, data: bytes | None = None, *,
           certificate: bool) -> tuple[int, bytes]:
    """``url`` over TLS that trusts the server's CA, presenting the server's client certificate
    only when ``certificate`` (what weed's own components hold and a co-tenant does not)."""
    ca, cert, key_file = server.tls_credentials
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    if certificate:
        context.load_cert_chain(cert, key_file)
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/octet-stream"})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


_HTTP_LISTENERS = ("master.port", "volume.port", "filer.port", "admin.port")


@pytest.mark.parametrize("flag", _HTTP_LISTENERS)
def test_http_listeners_but_s3_require_the_servers_client_certificate(s3_server, flag):
    """Mutual TLS on every HTTP port but S3's: plain HTTP gets Go's 400 ("an HTTP request to an
    HTTPS server"), TLS without the client certificate fails the handshake, and the certificate
    gets in (so the port is right)."""
    port = s3_server.ports[flag]
    status, body = _http("GET", f"http://127.0.0.1:{port}/dir/assign")
    assert status == 400 and b"HTTPS" in body, (status, body)
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        _https(s3_server, "GET", f"https://127.0.0.1:{port}/dir/assign", certificate=False)
    status, _ = _https(s3_server, "GET", f"https://127.0.0.1:{port}/", certificate=True)
    assert status < 500


def test_master_administration_is_refused_without_the_certificate(s3_server, key):
    """The attack the JWT keys did not stop (issue 37): the master's HTTP API deleted the run's
    collection for anyone. Without the certificate it is unreachable and the object stays."""
    port = s3_server.ports["master.port"]
    for path in ("/col/delete?collection=flatpack", "/vol/grow?count=1", "/vol/vacuum", "/dir/assign"):
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _https(s3_server, "GET", f"https://127.0.0.1:{port}{path}", certificate=False)
    with s3_server.store() as store:
        assert store.get(key) == b"print('the real stage')"


def test_master_assign_then_volume_upload_is_refused_even_with_the_certificate(s3_server):
    """Behind the TLS layer the JWT still guards the volumes: a write with an assigned file id
    but without the master's token (which only the filer receives) is refused."""
    ports = s3_server.ports
    status, body = _https(s3_server, "GET", f"https://127.0.0.1:{ports['master.port']}/dir/assign", certificate=True)
    assert status == 200, body
    assigned = json.loads(body)
    status, body = _https(s3_server, "PUT", f"https://{assigned['url']}/{assigned['fid']}", b"evil", certificate=True)
    assert status == 401, body


def test_volume_and_filer_without_a_token_are_refused_even_with_the_certificate(s3_server, key):
    volume = s3_server.ports["volume.port"]
    assert _https(s3_server, "PUT", f"https://127.0.0.1:{volume}/1,01637037d6", b"evil", certificate=True)[0] == 401
    assert _https(s3_server, "GET", f"https://127.0.0.1:{volume}/1,01637037d6", certificate=True)[0] == 401
    url = f"https://127.0.0.1:{s3_server.ports['filer.port']}/buckets/{s3_server.bucket}/{key}"
    for method, body in (("PUT", b"evil"), ("POST", b"evil"), ("DELETE", None), ("GET", None)):
        assert _https(s3_server, method, url, body, certificate=True)[0] == 401, method
    with s3_server.store() as store:
        assert store.get(key) == b"print('the real stage')"


def test_s3_without_a_signature_is_refused_and_with_the_keys_works(s3_server, key):
    url = f"{s3_server.endpoint_url}/{s3_server.bucket}/{key}"
    assert _http("PUT", url, b"evil")[0] == 403
    assert _http("GET", url)[0] == 403
    with s3_server.store() as store:
        store.put(key, b"updated with the keys")
        assert store.get(key) == b"updated with the keys"


@pytest.mark.parametrize("flag", ["master.port.grpc", "volume.port.grpc", "filer.port.grpc", "s3.port.grpc",
                                  "admin.port.grpc"])
def test_grpc_ports_require_the_servers_client_certificate(s3_server, flag):
    """gRPC (the filer's CreateEntry, the master's Assign, which hands out write tokens, ...)
    is mutual TLS: plaintext HTTP/2 gets no answer, TLS without the certificate fails the
    handshake, and the server's own certificate gets in (so the port is the gRPC one)."""
    port = s3_server.ports[flag]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as plain:
        plain.sendall(_H2_PREFACE + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))    # preface + empty SETTINGS
        try:
            answer = plain.recv(64)
        except (TimeoutError, ConnectionResetError):
            answer = b""
    assert answer[3:4] != b"\x04", "a plaintext gRPC client got an HTTP/2 SETTINGS frame"

    ca, cert, key_file = s3_server.tls_credentials
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(ca)
    context.set_alpn_protocols(["h2"])
    with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
        with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5)) as tls:
            tls.sendall(_H2_PREFACE)
            if not tls.recv(64):                   # TLS 1.3 reports the missing certificate on first read
                raise ConnectionResetError("closed")
    context.load_cert_chain(cert, key_file)
    with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5)) as tls:
        assert tls.selected_alpn_protocol() == "h2"


def _unix_sockets(server: LocalS3Server) -> list[Path]:
    directory = server.directory
    assert directory is not None
    grpc = [Path(f"/tmp/seaweedfs-{flag.split('.')[0]}-grpc-{port}.sock")
            for flag, port in server.ports.items() if flag.endswith(".port.grpc")]
    return [path for path in [directory / "filer.sock", directory / "s3.sock", *grpc] if path.exists()]


def test_unix_sockets_secrets_and_directory_are_private_to_the_user(s3_server):
    directory = s3_server.directory
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    sockets = _unix_sockets(s3_server)
    assert any(path.parent == Path("/tmp") for path in sockets), sockets
    for path in sockets:
        info = path.lstat()
        assert stat.S_ISSOCK(info.st_mode) and info.st_uid == os.geteuid()
        assert stat.S_IMODE(info.st_mode) & 0o077 == 0, f"{path} is {oct(info.st_mode)}"
    for path in [*s3_server.tls_credentials, directory / "s3.json", directory / "weed.log"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((directory / "secrets").stat().st_mode) == 0o700


_PROBE = r"""
import json, socket, sys
results = {}
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        results[path] = "connected"
    except OSError as exc:
        results[path] = type(exc).__name__
    finally:
        s.close()
try:
    open(sys.argv[1].rsplit("/", 1)[0] + "/s3.json").read()
    results["s3.json"] = "read"
except OSError as exc:
    results["s3.json"] = type(exc).__name__
print(json.dumps(results))
"""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_can_connect_to_no_socket_and_read_no_file(s3_server):
    """As ``nobody`` (uid 65534): every unix socket and the identity file are out of reach."""
    sockets = [str(path) for path in _unix_sockets(s3_server)]
    # an interpreter ``nobody`` may run (this one may sit under root's 0700 home)
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)
                   and os.stat(p).st_mode & stat.S_IXOTH), None)
    if python is None:
        pytest.skip("no python3 that another user may run")
    done = subprocess.run([python, "-I", "-c", _PROBE, *sockets], capture_output=True, text=True,
                          user=65534, group=65534, extra_groups=[], timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results == {**{path: "PermissionError" for path in sockets}, "s3.json": "PermissionError"}


def test_a_restarted_server_on_the_same_directory_gets_new_secrets(tmp_path):
    data_dir = tmp_path / "store"
    data_dir.mkdir(mode=0o755)
    with LocalS3Server(data_dir=data_dir) as server:
        first = server.tls_credentials[2].read_bytes()
        with server.store() as store:
            store.put("run/a", b"kept")
        assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    assert not (data_dir / "secrets").exists() and not (data_dir / "s3.json").exists()
    with LocalS3Server(data_dir=data_dir) as server, server.store() as store:
        assert store.get("run/a") == b"kept"
        assert server.tls_credentials[2].read_bytes() != first
