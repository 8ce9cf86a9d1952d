"""Stores against real backends: a directory, a SeaweedFS S3 server, Redis when installed.

Timing assertions here are lower bounds on the throttle's own sleeping (or upper bounds on
computed waits), never benchmarks of the machine, so they hold on a loaded 2-core box.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from flatpack.errors import StoreError, StoreKeyError, StoreTimeout, WireError
from flatpack.runtime.s3server import free_ports
from flatpack.runtime.store import FileStore, RedisStore, S3Store, Store, retrying
from flatpack.runtime.store_url import open_store
from flatpack.runtime.throttle import Throttled, TokenBucket
from flatpack.stage import wire

REPO = Path(__file__).resolve().parents[2]
MB = 1_000_000


# --------------------------------------------------------------------------- backends


@pytest.fixture(scope="session")
def redis_server():
    """A throwaway redis-server on a free port, or a skip when Debian's redis-server is absent."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server to test RedisStore)")
    port = free_ports(1)[0]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(port)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _wait_for_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


@pytest.fixture(params=["file", "s3", "redis"])
def store(request, tmp_path) -> Store:
    if request.param == "file":
        return FileStore(tmp_path / "store")
    if request.param == "s3":
        return request.getfixturevalue("s3_store")
    port = request.getfixturevalue("redis_server")
    redis_store = RedisStore("127.0.0.1", port, 0, prefix=f"test-{uuid.uuid4().hex}/")
    request.addfinalizer(redis_store.close)
    return redis_store


# --------------------------------------------------------------------------- the interface


def test_put_get_overwrite_exists_delete(store):
    assert not store.exists("run/a")
    store.put("run/a", b"first")
    assert store.get("run/a") == b"first"
    store.put("run/a", b"")  # an empty object is a real object
    assert store.get("run/a") == b"" and store.exists("run/a")
    store.delete("run/a")
    store.delete("run/a")  # idempotent
    assert not store.exists("run/a")


def test_missing_key_raises_store_key_error_naming_it(store):
    with pytest.raises(StoreKeyError, match="run/missing") as info:
        store.get("run/missing")
    assert isinstance(info.value, KeyError) and isinstance(info.value, StoreError)


def test_list_is_sorted_and_scoped_to_the_prefix(store):
    keys = ["run-1/b/2", "run-1/a", "run-1/b/1", "run-10/x", "run-1x"]
    for key in keys:
        store.put(key, key.encode())
    assert store.list("run-1/") == ["run-1/a", "run-1/b/1", "run-1/b/2"]
    assert store.list("run-1/b/") == ["run-1/b/1", "run-1/b/2"]
    assert store.list("run-2/") == []
    assert store.delete_prefix("run-1/") == 3
    assert store.list("run-1/") == [] and store.list("run-10/") == ["run-10/x"]
    assert store.get("run-1x") == b"run-1x"


def test_delete_keys_removes_exactly_the_named_keys_absent_ones_included(store):
    for key in ["run-1/a/1", "run-1/a/2", "run-1/b/1", "run-2/a/1"]:
        store.put(key, b"x")
    store.delete_keys(["run-1/a/1", "run-1/b/1", "run-1/never-written", "run-2/a/1"])
    store.delete_keys([])
    assert store.list("run-1/") == ["run-1/a/2"] and store.list("run-2/") == []
    with pytest.raises(StoreError, match="key"):
        store.delete_keys(["run-1/a/2", "a//b"])
    assert store.list("run-1/") == ["run-1/a/2"]        # a bad key in the list: nothing deleted


@pytest.mark.parametrize("prefix", ["", "run", "run/a"])
def test_list_refuses_a_whole_store_or_unterminated_prefix(store, prefix):
    with pytest.raises(StoreError, match="prefix"):
        store.list(prefix)
    with pytest.raises(StoreError, match="prefix"):
        store.delete_prefix(prefix)


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "..", "a/./b", "a/"])
def test_bad_keys_are_rejected(store, key):
    with pytest.raises(StoreError, match="key"):
        store.put(key, b"x")


def test_wait_returns_a_key_that_appears_later(store):
    writer = threading.Timer(0.15, store.put, args=("run/late", b"here"))
    writer.start()
    try:
        assert store.wait("run/late", timeout_s=10) == b"here"
    finally:
        writer.join()


def test_wait_times_out_naming_the_key(store):
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="run/never") as info:
        store.wait("run/never", timeout_s=0.2)
    assert time.monotonic() - start >= 0.2
    assert isinstance(info.value, TimeoutError) and "0.2 s" in str(info.value)


def test_readers_never_see_a_torn_or_short_object(store):
    """A writer overwrites 4 MB objects (every byte = the version) under 3 busy readers."""
    size, versions = 4 * MB, 12
    store.put("run/hot", bytes([0]) * size)
    done = threading.Event()
    seen: list[list[int]] = [[] for _ in range(3)]
    bad: list[str] = []

    def read(i: int) -> None:
        while not done.is_set():
            data = store.get("run/hot")
            if len(data) != size or data.strip(data[:1]):
                bad.append(f"len={len(data)} first={data[:1]!r} last={data[-1:]!r}")
            seen[i].append(data[0])

    readers = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for t in readers:
        t.start()
    try:
        for version in range(1, versions + 1):
            store.put("run/hot", bytes([version]) * size)
    finally:
        done.set()
        for t in readers:
            t.join()
    assert not bad, bad[:5]
    assert all(seen), "every reader read at least once"
    assert store.get("run/hot") == bytes([versions]) * size


# --------------------------------------------------------------------------- S3 specifics


def test_s3_listing_paginates_past_1000_keys(s3_store):
    keys = [f"many/k{i:05d}" for i in range(1100)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: s3_store.put(k, b"."), keys))
    assert s3_store.list("many/") == keys
    assert s3_store.delete_prefix("many/") == 1100  # DeleteObjects in batches of 1000
    assert s3_store.list("many/") == []


def test_s3_wrong_credentials_name_the_cause(s3_server, s3_store):
    s3_store.put("run/k", b"x")
    wrong_key = S3Store(s3_server.bucket, s3_store.prefix, s3_server.endpoint_url, "us-east-1",
                        aws_access_key_id="NOTAKEY", aws_secret_access_key=s3_server.secret_key)
    with pytest.raises(StoreError, match="InvalidAccessKeyId.*AWS_ACCESS_KEY_ID") as info:
        wrong_key.get("run/k")
    assert not isinstance(info.value, StoreKeyError)
    with pytest.raises(StoreError, match="403"):
        wrong_key.exists("run/k")  # HEAD has no error body, but a 403 is not "absent"
    wrong_secret = S3Store(s3_server.bucket, s3_store.prefix, s3_server.endpoint_url, "us-east-1",
                           aws_access_key_id=s3_server.access_key, aws_secret_access_key="not-the-secret")
    with pytest.raises(StoreError, match="SignatureDoesNotMatch"):
        wrong_secret.put("run/k", b"y")
    assert s3_store.get("run/k") == b"x"


def test_s3_missing_bucket_says_so(s3_server):
    other = S3Store("no-such-bucket", "", s3_server.endpoint_url, "us-east-1",
                    aws_access_key_id=s3_server.access_key, aws_secret_access_key=s3_server.secret_key)
    with pytest.raises(StoreError, match="no-such-bucket.*does not exist"):
        other.list("run/")


def test_s3_missing_credentials_name_the_chain(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # do not wait on the instance-metadata probe
    with pytest.raises(StoreError, match=r"AWS_ACCESS_KEY_ID.*~/.aws/credentials.*role"):
        S3Store("bucket", endpoint_url="http://127.0.0.1:9")


def test_s3_unreachable_endpoint_gives_up_after_the_attempts():
    port = free_ports(1)[0]  # nothing listens there
    dead = S3Store("bucket", "", f"http://127.0.0.1:{port}", "us-east-1", aws_access_key_id="a",
                   aws_secret_access_key="b", attempts=2, connect_timeout_s=1)
    with pytest.raises(StoreError, match=r"S3 get .*run/k failed after 2 attempts.*EndpointConnectionError"):
        dead.get("run/k")


# --------------------------------------------------------------------------- urls


def test_urls_reopen_the_same_store(store, request, monkeypatch):
    if isinstance(store, S3Store):  # what a worker process gets: the url, and credentials in its env
        for name, value in request.getfixturevalue("s3_server").env().items():
            monkeypatch.setenv(name, value)
    store.put("run/u", b"shared")
    with open_store(store.url) as reopened:
        assert type(reopened) is type(store) and reopened.url == store.url
        assert reopened.get("run/u") == b"shared"


def test_urls_carry_no_secret(s3_server, s3_store):
    assert s3_server.secret_key not in s3_store.url and s3_server.access_key not in s3_store.url
    assert s3_server.secret_key not in s3_server.url("run/") and s3_server.secret_key not in repr(s3_store)
    assert s3_store.url.startswith(f"s3://{s3_server.bucket}/{s3_store.prefix}?endpoint_url=http%3A//127.0.0.1%3A")


def test_a_child_process_opens_the_url_with_env_credentials(s3_server, s3_store):
    s3_store.put("run/in", b"from parent")
    code = ("import sys; from flatpack.runtime.store_url import open_store; s = open_store(sys.argv[1]); "
            "s.put('run/out', s.get('run/in') + b' and child')")
    env = {**os.environ, **s3_server.env(), "PYTHONPATH": str(REPO)}
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        env.pop(name, None)
    subprocess.run([sys.executable, "-c", code, s3_store.url], env=env, cwd=REPO, check=True, timeout=60)
    assert s3_store.get("run/out") == b"from parent and child"


def test_open_store_errors_name_the_fix(tmp_path):
    with pytest.raises(StoreError, match="file, s3, redis, oss"):
        open_store("ftp://host/x")
    with pytest.raises(StoreError, match="credentials"):
        open_store("s3://AKIA:secret@bucket/p")
    with pytest.raises(StoreError, match="unknown parameter"):
        open_store(f"{tmp_path.as_uri()}?mode=x")
    throttled = open_store(tmp_path.as_uri(), upload_bytes_s=MB)
    assert isinstance(throttled, Throttled) and throttled.url == tmp_path.as_uri()


def test_oss_without_its_sdk_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "oss2", None)  # as if oss2 were not installed
    with pytest.raises(StoreError, match="pip install oss2"):
        open_store("oss://bucket/run/?endpoint=https%3A//oss-cn-hangzhou.aliyuncs.com")


def test_file_store_publishes_by_rename_and_hides_temp_files(tmp_path):
    files = FileStore(tmp_path)
    files.put("run/a", b"x" * 1000)
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["a"]
    # an object (weights, activations) is its owner's alone on a shared filesystem
    assert (tmp_path / "run" / "a").stat().st_mode & 0o777 == 0o600
    (tmp_path / "run" / ".fp-tmp-a.partial").write_bytes(b"half")  # a writer that died mid-put
    assert files.list("run/") == ["run/a"]
    with pytest.raises(StoreError, match="a file and a directory"):
        files.put("run/a/b", b"y")


# --------------------------------------------------------------------------- retries


def test_retrying_retries_transient_errors_then_succeeds():
    failures = [EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
                ReadTimeoutError(endpoint_url="http://127.0.0.1:1")]
    sleeps: list[float] = []

    def call() -> str:
        if failures:
            raise failures.pop(0)
        return "ok"

    assert retrying(call, what="S3 get k", attempts=5, base_s=0.05, cap_s=2.0, sleep=sleeps.append) == "ok"
    assert len(sleeps) == 2 and 0 <= sleeps[0] <= 0.05 and 0 <= sleeps[1] <= 0.1  # full jitter bounds


def test_retrying_gives_up_with_the_operation_attempts_and_last_error():
    calls = []

    def call():
        calls.append(1)
        raise ReadTimeoutError(endpoint_url="http://127.0.0.1:1")

    with pytest.raises(StoreError, match=r"S3 get s3://b/k failed after 4 attempts; last error: ReadTimeoutError"):
        retrying(call, what="S3 get s3://b/k", attempts=4, sleep=lambda s: None)
    assert len(calls) == 4


def test_retrying_translates_final_errors_at_once():
    calls = []

    def call():
        calls.append(1)
        raise ClientError({"Error": {"Code": "NoSuchKey", "Message": "gone"}}, "GetObject")

    with pytest.raises(StoreKeyError, match="k is gone"):
        retrying(call, what="S3 get k", sleep=lambda s: None, translate=lambda exc: StoreKeyError("k is gone"))
    assert len(calls) == 1
    slow = ClientError({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")
    with pytest.raises(StoreError, match="after 2 attempts.*SlowDown"):
        retrying(lambda: (_ for _ in ()).throw(slow), what="S3 put k", attempts=2, sleep=lambda s: None)


# --------------------------------------------------------------------------- throttling


def test_token_bucket_books_virtual_finish_times():
    now = [100.0]
    bucket = TokenBucket(1000.0, burst_bytes=10.0, clock=lambda: now[0])
    assert bucket.reserve(10) == 0.0  # the banked burst
    assert bucket.reserve(1000) == pytest.approx(1.0)  # queued behind the first
    assert bucket.reserve(500) == pytest.approx(1.5)
    now[0] += 60.0  # a long idle spell banks only the burst
    assert bucket.reserve(1000) == pytest.approx(0.99)
    with pytest.raises(StoreError, match="positive"):
        TokenBucket(0)


def test_throttled_put_takes_at_least_size_over_rate(tmp_path):
    throttled = Throttled(FileStore(tmp_path), upload_bytes_s=10 * MB)
    start = time.monotonic()
    throttled.put("run/big", b"x" * (2 * MB))
    assert time.monotonic() - start >= 0.19
    stats = throttled.stats()
    # 0.2 s for 2 MB less the 0.01 s burst an idle link banks
    assert stats["bytes_up"] == 2 * MB and stats["throttled_up_s"] >= 0.19 - 1e-6 and stats["bytes_down"] == 0


def test_concurrent_gets_share_the_download_rate(tmp_path):
    inner = FileStore(tmp_path)
    inner.put("run/a", b"a" * MB)
    inner.put("run/b", b"b" * MB)
    throttled = Throttled(inner, download_bytes_s=10 * MB)
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(throttled.get, ["run/a", "run/b"]))
    assert time.monotonic() - start >= 0.19
    assert [len(r) for r in results] == [MB, MB]
    # the second queued behind the first: 0.09 + 0.19 s less the real reads' time, where two
    # gets on separate links would sleep 0.09 s each (0.18 s) at most; the margin is the
    # reads' time, which a busy host stretches to milliseconds
    assert throttled.stats()["throttled_down_s"] >= 0.22


def test_upload_and_download_run_at_full_rate_each(tmp_path):
    inner = FileStore(tmp_path)
    inner.put("run/down", b"d" * MB)
    # a clock that stands still: the put and the get start at the same instant, as two
    # concurrent transfers would, and no real read time or scheduling delay enters the
    # figures (a wall clock made the get's wait 0.09 s less however long the read took)
    slept: list[float] = []
    throttled = Throttled(inner, upload_bytes_s=10 * MB, download_bytes_s=10 * MB,
                          clock=lambda: 0.0, sleep=slept.append)
    throttled.put("run/up", b"u" * MB)
    throttled.get("run/down")
    stats = throttled.stats()
    # each direction waited only for its own megabyte (0.1 s less the 0.01 s burst); one
    # shared link would have made the second wait for both megabytes (0.19 s)
    assert stats["throttled_up_s"] == pytest.approx(0.09)
    assert stats["throttled_down_s"] == pytest.approx(0.09)
    assert slept == [pytest.approx(0.09), pytest.approx(0.09)]


def test_throttled_wait_counts_the_download(tmp_path):
    throttled = Throttled(FileStore(tmp_path), download_bytes_s=100 * MB)
    threading.Timer(0.05, throttled.inner.put, args=("run/w", b"w" * 1000)).start()
    assert throttled.wait("run/w", timeout_s=10) == b"w" * 1000
    assert throttled.stats()["bytes_down"] == 1000


# --------------------------------------------------------------------------- wire


def test_wire_round_trips_dtypes_shapes_views_and_meta():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "f32": torch.randn(3, 5),
        "f16": torch.randn(2, 3).half(),
        "bf16": torch.randn(7).bfloat16(),
        "i64": torch.arange(-5, 5),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),  # non-contiguous
        "strided": base[:, ::2],
        "row1": base[1],  # these three share one storage
        "row2": base[2],
        "whole": base,
        "grad": torch.ones(2, requires_grad=True) * 2,
    }
    meta = {"iteration": 3, "names": ["a", "b"], "loss": 0.25}
    decoded, got_meta = wire.loads(wire.dumps(tensors, meta))
    assert got_meta == meta and set(decoded) == set(tensors)
    for name, tensor in tensors.items():
        assert decoded[name].dtype == tensor.dtype and decoded[name].shape == tensor.shape, name
        assert torch.equal(decoded[name], tensor.detach()), name
    assert wire.loads(wire.dumps({})) == ({}, {})


def test_wire_rejects_bad_input_and_bad_bytes():
    with pytest.raises(WireError, match="torch.Tensor"):
        wire.dumps({"x": [1, 2]})  # pyright: ignore[reportArgumentType] - the wrong type is the test
    with pytest.raises(WireError, match="JSON"):
        wire.dumps({}, {"t": torch.ones(1)})
    payload = wire.dumps({"x": torch.ones(100)})
    with pytest.raises(WireError, match="truncated"):
        wire.loads(payload[:-10])
    with pytest.raises(WireError):
        wire.loads(b"\x01")
    assert wire.loads_json(wire.dumps_json({"b": 1, "a": [1.5, None]})) == {"a": [1.5, None], "b": 1}
    with pytest.raises(WireError, match="JSON"):
        wire.loads_json(b"\xff")


def test_wire_payloads_travel_through_s3(s3_store):
    tensors = {"act": torch.randn(8, 16), "mask": torch.ones(8, dtype=torch.bool)}
    s3_store.put("run/act/i000000/s000000/m000000", wire.dumps(tensors, {"mb": 0}))
    decoded, meta = wire.loads(s3_store.get("run/act/i000000/s000000/m000000"))
    assert meta == {"mb": 0} and all(torch.equal(decoded[k], v) for k, v in tensors.items())


def test_throttled_transfers_overlap_the_link_with_the_real_transfer():
    """A transfer costs about max(n/rate, its real time), not their sum: a get is backdated
    to when it started, and a put sleeps n/rate less the server's measured time per byte."""
    now = [0.0]
    slept: list[float] = []

    class Slow(FileStore):
        def get(self, key: str) -> bytes:
            now[0] += 0.05            # the real transfer took 50 ms
            return super().get(key)

        def put(self, key: str, data: bytes) -> None:
            now[0] += 0.05
            super().put(key, data)

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    import tempfile
    with tempfile.TemporaryDirectory() as root:
        inner = Slow(root)
        throttled = Throttled(inner, upload_bytes_s=MB, download_bytes_s=MB, clock=lambda: now[0], sleep=sleep)
        inner.put("run/x", b"x" * (MB // 10))     # 0.1 s of link
        start = now[0]
        throttled.get("run/x")
        assert now[0] - start == pytest.approx(0.1 - 0.01)      # 50 ms real + 40 ms more, less the burst
        throttled.put("run/y", b"y" * (MB // 10))    # learns 0.5 µs per byte
        start = now[0]
        throttled.put("run/z", b"z" * (MB // 10))
        assert now[0] - start < 0.1 + 0.05 - 0.01, "the put's real time was added to n/rate, not overlapped"
