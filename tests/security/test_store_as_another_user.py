"""Another user of the machine attacks a live run's store (issue 37's high-severity hole).

While `flatpack run` trains, ``nobody`` (uid 65534) — who reaches every 127.0.0.1 port but holds
neither the S3 keys nor the store's certificate — sends every request of the attack (the
master's ``/col/delete``, ``/submit``, ``/vol/grow``, ``/dir/assign``, ``/vol/vacuum``, the
volume's ``/status``, filer and S3 reads, writes and deletes, ...) to every TCP port the run's
``weed`` listens on, over plain HTTP and over TLS without a client certificate. No request may
get a 2xx but weed's two S3 liveness probes (empty bodies); the run is then stopped, resumed,
and must end with the weights of a run nobody touched.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.helpers import assert_same_weights, flatpack_process, stop_with_sigterm, wait_for_output

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                 reason="needs root to act as another user")]

# (method, path) sent to every port; bodies are the attacker's bytes
ATTACK = [
    ("GET", "/col/delete?collection=flatpack"), ("POST", "/col/delete?collection=flatpack"),
    ("POST", "/submit"), ("GET", "/vol/grow?count=1"), ("POST", "/vol/grow?count=1"),
    ("GET", "/dir/assign"), ("POST", "/dir/assign"), ("GET", "/vol/vacuum"), ("GET", "/dir/status"),
    ("GET", "/dir/lookup?volumeId=1"), ("GET", "/cluster/status"), ("GET", "/vol/status"),
    ("GET", "/status"), ("GET", "/healthz"), ("GET", "/stats/disk"), ("GET", "/metrics"), ("GET", "/"),
    ("GET", "/ui/index.html"), ("PUT", "/1,01637037d6"), ("GET", "/1,01637037d6"), ("DELETE", "/1,01637037d6"),
    ("GET", "/buckets/flatpack/"), ("PUT", "/buckets/flatpack/evil"), ("DELETE", "/buckets/flatpack/?recursive=true"),
    ("GET", "/flatpack?list-type=2"), ("PUT", "/flatpack/evil"), ("DELETE", "/flatpack"),
    ("GET", "/api/s3/buckets"), ("POST", "/api/users"),
]
# weed's S3 gateway answers these liveness probes to anyone, with an empty body (docs/security.md)
LIVENESS = {("GET", "/status"), ("GET", "/healthz")}

_PROBE = r"""
import http.client, json, os, ssl, sys
ports, attack = json.loads(sys.argv[1]), json.loads(sys.argv[2])
context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
context.check_hostname = False
context.verify_mode = ssl.CERT_NONE
results = []
for port in ports:
    for scheme in ("http", "https"):
        for method, path in attack:
            if scheme == "http":
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
            else:
                connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=3, context=context)
            try:
                body = b"evil" if method in ("PUT", "POST") else None
                connection.request(method, path, body=body)
                response = connection.getresponse()
                results.append([port, scheme, method, path, response.status, response.read(200).decode("latin-1")])
            except Exception as exc:
                results.append([port, scheme, method, path, type(exc).__name__, ""])
            finally:
                connection.close()
print(json.dumps({"uid": os.getuid(), "results": results}))
"""


def _weed_serving(store_dir: Path) -> int | None:
    """The pid of the weed process whose working directory is ``store_dir`` (the run's store)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() == "weed" and (entry / "cwd").resolve() == store_dir.resolve():
                return int(entry.name)
        except OSError:
            continue
    return None


def _listening_ports(pid: int) -> list[int]:
    """Every TCP port ``pid`` listens on, from /proc (its socket inodes in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:        # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _python_for_nobody() -> str:
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK) and os.stat(candidate).st_mode & stat.S_IXOTH:
            return candidate
    pytest.skip("no python3 that another user may run")


def _attack_as_nobody(ports: list[int]) -> list[list]:
    done = subprocess.run([_python_for_nobody(), "-I", "-c", _PROBE, json.dumps(ports), json.dumps(ATTACK)],
                          capture_output=True, text=True, user=65534, group=65534, extra_groups=[], timeout=240,
                          cwd="/")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["uid"] == 65534
    return answer["results"]


def test_another_user_gets_nothing_from_a_live_runs_store_and_the_run_resumes_to_the_same_weights(tmp_path):
    from flatpack.cli import main

    arguments = ["run", "mlp", "--batch", "16", "--micro-batches", "2", "--iterations", "60", "--stages", "2",
                 "--checkpoint-every", "10", "--solver", "balanced", "--no-verify"]
    assert main([*arguments, "--out", str(tmp_path / "untouched")]) == 0
    attacked = tmp_path / "attacked"
    log_path = tmp_path / "attacked.log"
    weed: list[int] = []

    def find_weed() -> None:
        if not weed and (pid := _weed_serving(attacked / "store")) is not None:
            weed.append(pid)

    with flatpack_process([*arguments, "--out", str(attacked)], log_path) as runner:
        wait_for_output(runner, log_path, "iter 2/60", also=find_weed)
        find_weed()
        assert weed, "no weed process serves the run's store"
        ports = _listening_ports(weed[0])
        assert len(ports) >= 9, ports       # master, volume, filer, s3, admin: HTTP and gRPC
        results = _attack_as_nobody(ports)
        assert runner.poll() is None, "the run ended before the attack did; it cannot show the store held"
        stop_with_sigterm(runner)

    answered = [r for r in results if isinstance(r[4], int) and 200 <= r[4] < 300]
    allowed = [r for r in answered if (r[2], r[3]) in LIVENESS and r[1] == "http" and r[5] == ""]
    assert answered == allowed, [r for r in answered if r not in allowed]
    assert len(allowed) <= 2                                   # the S3 port's two probes, nothing else
    # every port was really asked: each refused over plain HTTP and over TLS without a certificate
    assert {r[0] for r in results} == set(ports) and len(results) == len(ports) * 2 * len(ATTACK)

    assert main(["resume", str(attacked)]) == 0
    assert_same_weights(tmp_path / "untouched" / "trained.safetensors", attacked / "trained.safetensors")
