"""Transient versus fatal store errors, retries under a budget in time, stalled reads, and
store fault injection (issue 16, finding 5). Everything runs against fake clients and a
simulated clock: no test sleeps for real or reads the wall clock."""

from __future__ import annotations

import http.client
import json

import pytest
import urllib3.exceptions
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    IncompleteReadError,
    NoCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from flatpack.errors import StoreError, StoreKeyError, StoreTimeout
from flatpack.runtime import chaos
from flatpack.runtime.chaos import FaultyStore, InjectedStall, InjectedStoreError
from flatpack.runtime.function import Role
from flatpack.runtime.optim import OptimizerSpec
from flatpack.runtime.spec import DATA_SOURCE, RunSpec, StageSpec
from flatpack.runtime.store import (DEFAULT_RETRY_S, READ_TIMEOUT_S, RETRY_CAP_S, RETRY_ENV, FileStore, S3Store,
                                    StoreUnavailable, default_retry_s, is_transient, is_transient_failure, retrying)
from flatpack.runtime.store_url import open_store
from flatpack.runtime.worker import run_role


class SimClock:
    """Simulated time: sleep() advances now."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


def client_error(code: str, status: int, op: str = "GetObject") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, op)


# --------------------------------------------------------------------------- classification

TRANSIENT = [
    client_error("SlowDown", 503),
    client_error("ServiceUnavailable", 503),
    client_error("TooManyRequests", 429),
    client_error("", 429),
    client_error("RequestLimitExceeded", 400),
    client_error("ThrottlingException", 400),
    client_error("ThrottledByPolicy", 400),            # any Throttl* code
    client_error("QpsLimitExceeded", 503),             # OSS's throttling
    client_error("InternalError", 500),
    client_error("BadGateway", 502),
    client_error("", 504),
    client_error("RequestTimeout", 400),               # S3: the socket idled during an upload
    EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),   # refused, unreachable
    ConnectionClosedError(endpoint_url="http://127.0.0.1:1"),     # reset
    ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"),
    ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),          # a stalled response or body
    ResponseStreamingError(error="connection broken mid-body"),
    IncompleteReadError(actual_bytes=3, expected_bytes=10),
    urllib3.exceptions.ProtocolError("Connection aborted"),
    http.client.IncompleteRead(b"abc", 7),
    ConnectionResetError(104, "reset by peer"),
    ConnectionRefusedError(111, "refused"),
    TimeoutError("timed out"),
    InjectedStoreError("injected"),
    InjectedStall("injected stall"),
]

FATAL = [
    client_error("AccessDenied", 403),
    client_error("403", 403, "HeadObject"),
    client_error("NoSuchBucket", 404),
    client_error("NoSuchKey", 404),
    client_error("InvalidAccessKeyId", 403),
    client_error("SignatureDoesNotMatch", 403),
    client_error("ExpiredToken", 400),
    client_error("InvalidArgument", 400),
    client_error("BadRequest", 400),
    client_error("PreconditionFailed", 412),
    client_error("NotImplemented", 501),               # a retry cannot make the server implement it
    NoCredentialsError(),
    ValueError("a bug"),
    KeyError("k"),
    StoreError("translated"),
    StoreKeyError("no object"),
    StoreTimeout("never appeared"),
    StoreUnavailable("budget spent"),                  # final for retrying(): budgets do not nest
]


def _id(exc: BaseException) -> str:
    response = exc.response if isinstance(exc, ClientError) else {}
    return f"{type(exc).__name__}-{response['Error']['Code'] if response else ''}"


@pytest.mark.parametrize("exc", TRANSIENT, ids=_id)
def test_transient_errors_are_retried(exc):
    assert is_transient(exc)


@pytest.mark.parametrize("exc", FATAL, ids=_id)
def test_fatal_errors_are_not_retried(exc):
    assert not is_transient(exc)


def test_a_worker_failure_is_transient_only_when_its_cause_is():
    spent = StoreUnavailable("S3 get failed after 40 attempts", attempts=40, elapsed_s=120.0, budget_s=120.0)
    assert is_transient_failure(spent)
    try:
        try:
            raise spent
        except StoreUnavailable as inner:
            raise RuntimeError("loading the checkpoint failed") from inner
    except RuntimeError as wrapped:
        assert is_transient_failure(wrapped)
    assert is_transient_failure(client_error("SlowDown", 503))
    # the user's model code failing, even while a transient error was being handled, is fatal
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError:
            raise ValueError("mat1 and mat2 shapes cannot be multiplied")  # noqa: B904 - the chain is the case
    except ValueError as code_error:
        assert not is_transient_failure(code_error)
    assert not is_transient_failure(StoreError("S3 denied get"))
    assert not is_transient_failure(StoreTimeout("never appeared"))


# --------------------------------------------------------------------------- budget in time


def always(exc: BaseException):
    calls = []

    def call():
        calls.append(1)
        raise exc

    return call, calls


def test_the_default_budget_is_a_minute_or_more(monkeypatch):
    monkeypatch.delenv(RETRY_ENV, raising=False)
    assert DEFAULT_RETRY_S >= 60 and default_retry_s() == DEFAULT_RETRY_S
    assert 2 <= RETRY_CAP_S <= 5


def test_retries_go_on_for_the_time_budget_not_a_few_attempts(monkeypatch):
    monkeypatch.delenv(RETRY_ENV, raising=False)
    sim = SimClock()
    call, calls = always(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    with pytest.raises(StoreUnavailable) as info:
        retrying(call, what="S3 get s3://b/run/k", sleep=sim.sleep, clock=sim.clock)
    error = info.value
    assert sim.now - 1000.0 >= DEFAULT_RETRY_S          # it retried for the whole budget (simulated)
    assert sum(sim.sleeps) <= DEFAULT_RETRY_S + 1e-9     # and no longer
    assert max(sim.sleeps) <= RETRY_CAP_S
    assert len(calls) > 10 and error.attempts == len(calls)
    assert error.budget_s == DEFAULT_RETRY_S and error.elapsed_s >= DEFAULT_RETRY_S
    message = str(error)
    assert "S3 get s3://b/run/k" in message and f"after {len(calls)} attempts" in message
    assert "transient" in message and "retried for 120.0 s" in message and "EndpointConnectionError" in message
    assert RETRY_ENV in message and "retry_s" in message   # how to raise the budget


def test_a_fault_shorter_than_the_budget_is_ridden_out():
    sim = SimClock()
    start = sim.now

    def call() -> str:
        if sim.now - start < 90.0:          # the server throttles for a minute and a half
            raise client_error("SlowDown", 503, "PutObject")
        return "stored"

    assert retrying(call, what="S3 put k", sleep=sim.sleep, clock=sim.clock, budget_s=120.0) == "stored"


def test_the_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "7.5")
    assert default_retry_s() == 7.5
    sim = SimClock()
    call, _ = always(ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    with pytest.raises(StoreUnavailable, match="retried for 7.5 s"):
        retrying(call, what="S3 get k", sleep=sim.sleep, clock=sim.clock)
    monkeypatch.setenv(RETRY_ENV, "soon")
    with pytest.raises(StoreError, match=f"{RETRY_ENV}='soon' is not a number of seconds"):
        default_retry_s()
    # negative, unbounded (1e308 s is a hang, not a budget), infinite or NaN: refused with the bounds
    for hostile in ("-1", "1e308", "86401", "inf", "nan"):
        monkeypatch.setenv(RETRY_ENV, hostile)
        with pytest.raises(StoreError, match="from 0 .* to 86400 \\(a day\\)"):
            default_retry_s()
    monkeypatch.setenv(RETRY_ENV, "86400")
    assert default_retry_s() == 86400.0


def test_backoff_is_exponential_capped_and_fully_jittered():
    sim = SimClock()
    call, _ = always(client_error("SlowDown", 503))
    bounds: list[float] = []

    def highest(low: float, high: float) -> float:
        bounds.append(high)
        return high

    with pytest.raises(StoreUnavailable):
        retrying(call, what="S3 put k", budget_s=30.0, sleep=sim.sleep, clock=sim.clock, jitter=highest)
    assert bounds[:8] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, RETRY_CAP_S])
    assert set(bounds[7:]) == {RETRY_CAP_S}
    assert sim.sleeps[-1] <= RETRY_CAP_S and sim.now - 1000.0 == pytest.approx(30.0)   # the last sleep is cut
    sim2 = SimClock()
    low: list[float] = []

    def slow_call():
        sim2.now += 0.25   # each attempt takes a while
        call()

    with pytest.raises(StoreUnavailable):
        retrying(slow_call, what="S3 put k", budget_s=1.0, sleep=sim2.sleep, clock=sim2.clock,
                 jitter=lambda a, b: low.append(a) or a)
    assert low and set(low) == {0.0}   # full jitter: anywhere from 0


def test_fatal_errors_fail_at_once_without_sleeping():
    sim = SimClock()
    call, calls = always(client_error("AccessDenied", 403))
    with pytest.raises(StoreError, match="denied"):
        retrying(call, what="S3 get k", sleep=sim.sleep, clock=sim.clock,
                 translate=lambda exc: StoreError("S3 denied get of k"))
    assert len(calls) == 1 and sim.sleeps == []


def test_an_attempt_cap_still_bounds_the_retries():
    sim = SimClock()
    call, calls = always(ConnectionResetError("reset"))
    with pytest.raises(StoreUnavailable, match="after 3 attempts.*3-attempt limit"):
        retrying(call, what="get k", attempts=3, sleep=sim.sleep, clock=sim.clock)
    assert len(calls) == 3


# --------------------------------------------------------------------------- S3Store, fake client


class Body:
    def __init__(self, data: bytes, stall: BaseException | None = None) -> None:
        self.data, self.stall = data, stall

    def read(self) -> bytes:
        if self.stall is not None:
            raise self.stall
        return self.data


class FakeS3:
    """A boto3 S3 client stand-in that replays scripted outcomes per operation."""

    def __init__(self, **script: list) -> None:
        self.script = script
        self.calls: list[str] = []

    def _next(self, op: str):
        self.calls.append(op)
        outcome = self.script[op].pop(0) if len(self.script[op]) > 1 else self.script[op][0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def get_object(self, **kw):
        return self._next("get_object")

    def put_object(self, **kw):
        return self._next("put_object")

    def head_object(self, **kw):
        return self._next("head_object")

    def close(self) -> None:
        pass


@pytest.fixture
def sim() -> SimClock:
    """The simulated clock the ``s3`` fixture's store sleeps on."""
    return SimClock()


@pytest.fixture
def s3(monkeypatch, sim):
    monkeypatch.delenv(RETRY_ENV, raising=False)
    store = S3Store("bucket", "run-prefix", "http://127.0.0.1:9", "us-east-1", aws_access_key_id="a",
                    aws_secret_access_key="b")
    store._sleep, store._clock = sim.sleep, sim.clock
    return store


def test_s3_reads_a_stalled_body_again(s3, sim):
    s3._client = FakeS3(get_object=[client_error("SlowDown", 503),
                                    {"Body": Body(b"", stall=ReadTimeoutError(endpoint_url="http://127.0.0.1:9"))},
                                    {"Body": Body(b"", stall=ResponseStreamingError(error="reset mid-body"))},
                                    {"Body": Body(b"payload")}])
    assert s3.get("k") == b"payload"
    assert s3._client.calls == ["get_object"] * 4 and len(sim.sleeps) == 3


def test_s3_read_timeout_cuts_a_stall_but_waits_out_a_short_one(s3):
    # botocore's read_timeout is the longest silence between bytes: a 2 s stall passes, a
    # 60 s straggler is cut and retried
    assert s3._client.meta.config.read_timeout == s3.read_timeout_s == READ_TIMEOUT_S
    assert 2.0 < READ_TIMEOUT_S < 60.0
    other = S3Store("bucket", "", "http://127.0.0.1:9", aws_access_key_id="a", aws_secret_access_key="b",
                    read_timeout_s=3)
    assert other._client.meta.config.read_timeout == 3 and "read_timeout_s=3" in other.url


def test_s3_fatal_errors_are_raised_at_once_and_named(s3, sim):
    s3._client = FakeS3(get_object=[client_error("AccessDenied", 403)])
    with pytest.raises(StoreError, match="S3 denied get.*ListBucket"):
        s3.get("k")
    s3._client = FakeS3(put_object=[client_error("NoSuchBucket", 404, "PutObject")])
    with pytest.raises(StoreError, match="does not exist"):
        s3.put("k", b"x")
    s3._client = FakeS3(put_object=[client_error("InvalidArgument", 400, "PutObject")])
    with pytest.raises(StoreError, match="InvalidArgument") as info:
        s3.put("k", b"x")
    assert not isinstance(info.value, StoreUnavailable) and sim.sleeps == []


def test_s3_unreachable_for_the_whole_budget_says_so(s3):
    s3._client = FakeS3(put_object=[EndpointConnectionError(endpoint_url="http://127.0.0.1:9")])
    with pytest.raises(StoreUnavailable, match=r"S3 put s3://bucket/run-prefix/k failed after \d+ attempts.*"
                                               r"transient.*retried for 120\.0 s"):
        s3.put("k", b"x")


def test_wait_polls_an_absent_key_through_transient_errors(s3):
    s3._client = FakeS3(get_object=[client_error("NoSuchKey", 404), client_error("SlowDown", 503),
                                    client_error("NoSuchKey", 404), ConnectionClosedError(endpoint_url="x"),
                                    {"Body": Body(b"ready")}])
    assert s3.wait("k", timeout_s=60) == b"ready"
    assert len(s3._client.calls) == 5


def test_wait_raises_a_fatal_error_at_once_and_times_out_on_an_absent_key(s3):
    s3._client = FakeS3(get_object=[client_error("AccessDenied", 403)])
    with pytest.raises(StoreError, match="denied") as info:
        s3.wait("k", timeout_s=60)
    assert not isinstance(info.value, StoreTimeout) and s3._client.calls == ["get_object"]
    s3._client = FakeS3(get_object=[client_error("NoSuchKey", 404)])
    with pytest.raises(StoreTimeout, match="did not appear"):
        s3.wait("k", timeout_s=5)


def test_the_budget_is_a_store_option_and_travels_in_its_url(monkeypatch):
    monkeypatch.delenv(RETRY_ENV, raising=False)
    store = S3Store("bucket", "p", "http://127.0.0.1:9", aws_access_key_id="a", aws_secret_access_key="b",
                    retry_s=300)
    assert store.retry_s == 300 and "retry_s=300" in store.url
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    reopened = open_store(store.url)
    assert isinstance(reopened, S3Store) and reopened.retry_s == 300 and reopened.url == store.url
    explicit = open_store(store.url, retry_s=5)
    assert isinstance(explicit, S3Store) and explicit.retry_s == 5            # an explicit option wins
    plain = S3Store("bucket", "p", "http://127.0.0.1:9", aws_access_key_id="a", aws_secret_access_key="b")
    assert "retry_s" not in plain.url and plain.retry_s == DEFAULT_RETRY_S
    monkeypatch.setenv(RETRY_ENV, "42")
    from_env = open_store(plain.url)
    assert isinstance(from_env, S3Store) and from_env.retry_s == 42          # a worker's env sets it too
    with pytest.raises(StoreError, match="retry_s='never' is not a number"):
        open_store("s3://bucket/p?retry_s=never")


# --------------------------------------------------------------------------- fault injection


def faulty(tmp_path, **options) -> tuple[FaultyStore, SimClock]:
    sim = SimClock()
    return FaultyStore(FileStore(tmp_path), sleep=sim.sleep, clock=sim.clock, **options), sim


def test_injected_errors_are_recovered_by_the_retry_path(tmp_path):
    store, sim = faulty(tmp_path, error_rate=0.3, seed=3)
    for i in range(50):
        store.put(f"run/k{i}", b"v%d" % i)
    assert [store.get(f"run/k{i}") for i in range(50)] == [b"v%d" % i for i in range(50)]
    assert store.list("run/") == sorted(f"run/k{i}" for i in range(50))
    stats = store.stats()
    assert 10 < stats["errors"] < stats["calls"] and sim.sleeps    # retried with backoff


def test_injected_errors_raise_a_transient_error_inside_the_retried_call(tmp_path):
    store, sim = faulty(tmp_path, error_rate=1.0, retry_s=30.0)
    with pytest.raises(StoreUnavailable, match="InjectedStoreError") as info:
        store.put("run/k", b"x")
    assert info.value.attempts > 5 and is_transient_failure(info.value)
    assert sim.now - 1000.0 >= 30.0


def test_injected_faults_are_reproducible_from_the_seed(tmp_path):
    def trial(seed: int) -> dict:
        store, _ = faulty(tmp_path / str(seed), error_rate=0.2, stall_rate=0.2, stall_s=2.0, seed=seed)
        for i in range(40):
            store.put(f"run/k{i}", b"x")
            store.get(f"run/k{i}")
        return store.stats()

    assert trial(11) == trial(11)
    assert trial(11) != trial(12)


def test_stalls_sleep_inside_the_call_and_a_read_timeout_cuts_them(tmp_path):
    store, sim = faulty(tmp_path, stall_rate=1.0, stall_s=2.0)
    store.put("run/k", b"x")
    assert store.get("run/k") == b"x" and sim.sleeps == [2.0, 2.0] and store.stats()["stalls"] == 2
    cut, sim = faulty(tmp_path, stall_rate=0.5, stall_s=60.0, read_timeout_s=1.0, seed=5)
    for i in range(20):
        cut.put(f"run/c{i}", b"y")
    assert [cut.get(f"run/c{i}") for i in range(20)] == [b"y"] * 20
    assert 60.0 not in sim.sleeps and 1.0 in sim.sleeps          # stalls cut at the read timeout, then retried


def test_missing_keys_are_not_faults(tmp_path):
    store, _ = faulty(tmp_path, error_rate=0.5, seed=1)
    with pytest.raises(StoreKeyError):
        store.get("run/absent")
    assert store.exists("run/absent") is False


def test_faults_come_from_plain_data(tmp_path):
    base = FileStore(tmp_path)
    assert chaos.wrap(base, None) is base and chaos.wrap(base, {}) is base
    wrapped = chaos.wrap(base, {"error_rate": 0.1, "stall_rate": 0.05, "stall_s": 2.0, "seed": 7})
    assert isinstance(wrapped, FaultyStore) and wrapped.url == base.url and wrapped.stall_s == 2.0
    with pytest.raises(StoreError, match="unknown store fault option.*'errors'"):
        chaos.wrap(base, {"errors": 0.1})
    with pytest.raises(StoreError, match="probability"):
        chaos.wrap(base, {"error_rate": 1.5})
    role = Role("run/spec/g000000", 1, 0, 0, 6)
    a = chaos.for_role(base, {"error_rate": 0.1, "seed": 7}, role)
    b = chaos.for_role(base, {"error_rate": 0.1, "seed": 7}, Role("run/spec/g000000", 0, 0, 0, 6))
    again = chaos.for_role(base, {"error_rate": 0.1, "seed": 7}, role)
    assert isinstance(a, FaultyStore) and isinstance(b, FaultyStore) and isinstance(again, FaultyStore)
    assert a.seed != b.seed and a.seed == again.seed
    opened = open_store(base.url, faults={"error_rate": 0.1, "seed": 2})
    assert isinstance(opened, FaultyStore)


def _spec(**extra) -> RunSpec:
    stage = StageSpec(0, 1, None, None, None, ("x",), ("y",), {"x": DATA_SOURCE}, ())
    return RunSpec("run", (stage,), 2, 8, OptimizerSpec("sgd", lr=0.1), "mse", "y", **extra)


def test_run_spec_carries_store_faults_through_json():
    faults = {"error_rate": 0.1, "stall_rate": 0.05, "stall_s": 2.0, "seed": 7}
    spec = _spec(store_faults=faults)
    assert RunSpec.loads(spec.dumps()) == spec and RunSpec.loads(spec.dumps()).store_faults == faults
    assert RunSpec.loads(_spec().dumps()).store_faults is None


# --------------------------------------------------------------------------- worker status


class UnreachableSpec(FileStore):
    """A store whose reads fail as an unreachable S3 does once the budget is spent."""

    def get(self, key: str) -> bytes:
        raise StoreUnavailable(f"S3 get {key} failed after 41 attempts; ... transient ...", what=f"S3 get {key}",
                               attempts=41, elapsed_s=120.2, budget_s=120.0)


def _status(store: FileStore) -> dict:
    keys = [k for k in store.list("run/") if "/status/" in k]
    assert len(keys) == 1, keys
    return json.loads(FileStore.get(store, keys[0]))


def test_a_worker_that_outlasts_its_budget_reports_transient(tmp_path):
    store = UnreachableSpec(tmp_path)
    code = run_role(Role("run/spec/g000000", 0, 0, 0, 2), store, 0.0)
    status = _status(store)
    assert code != 0 and status["status"] == "transient"
    assert status["attempts"] == 41 and status["retried_s"] == 120.2 and status["budget_s"] == 120.0
    assert "StoreUnavailable" in status["error"] and "Traceback" in status["traceback"]
    assert status["role"]["stage"] == 0


def test_a_code_error_stays_an_error(tmp_path):
    store = FileStore(tmp_path)
    store.put("run/spec/g000000", b"{not json")
    code = run_role(Role("run/spec/g000000", 0, 0, 0, 2), store, 0.0)
    status = _status(store)
    assert code == 1 and status["status"] == "error" and "JSONDecodeError" in status["traceback"]
