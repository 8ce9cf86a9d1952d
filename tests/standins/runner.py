"""One invocation of a function's handler in a fresh subprocess, the way Lambda or FC runs it.

:func:`run_invocation` starts :mod:`~tests.standins.bootstrap` in the
function's code directory with the caller's environment, the function's variables and the
platform's reserved variables; the event goes in on stdin, stdout and stderr become the
function's log, and the result comes back on a pipe of its own. The process is a fresh
interpreter, or, for an image whose base loads modules first (``FunctionCode.preload``:
torch, where the image installs it), forked from a process that has imported them
(:mod:`~tests.standins.zygote`), which saves each invocation of a flatpack image ~2 s of
CPU and changes nothing the handler sees but what is already imported. The runner enforces what
the platform enforces:

* the timeout: init (the handler's import) runs outside it for up to 10 s, as on Lambda;
  then the process group is killed and the error is "Task timed out after N seconds";
* an exit without a result (``os._exit``, a signal, ``sys.exit``): ``Runtime.ExitError``
  with the exit status in the message;
* the memory size, after the fact: a peak RSS above ``memory_mb`` fails the invocation
  with ``Runtime.OutOfMemory`` (the platform would have killed it on the way; here it ran
  to the end, so its side effects happened);
* whatever the handler left running is killed once the result is in (a real sandbox
  freezes it).

The error payloads have each platform's shape (``FunctionCode.platform``): Lambda's
``{"errorMessage", "errorType", "requestId", "stackTrace"}``, FC's without ``requestId``
and FC's own messages for timeouts and exits.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Mapping

from tests.standins import bootstrap, zygote
from tests.standins.bootstrap import (FAILURE, FC, HEADER, INIT_LIMIT_S, LAMBDA, MEMORY, READY, SUCCESS,
                                      peak_rss_kib)

PLATFORMS = (LAMBDA, FC)
DEFAULT_REGIONS = {LAMBDA: "us-east-1", FC: "cn-hangzhou"}
TEST_ACCOUNT_ID = "123456789012"  # moto's default account; obviously not a real one

# InvocationResult.error_type values besides None
UNHANDLED = "Unhandled"              # the handler (or its import) raised; the payload names the exception
EXIT_ERROR = "Runtime.ExitError"     # the process ended without a result
OUT_OF_MEMORY = "Runtime.OutOfMemory"
TIMED_OUT = "Sandbox.Timedout"

LOG_TAIL_BYTES = 4096   # what Lambda returns for LogType=Tail
EXIT_GRACE_S = 1.0      # after the result, for the bootstrap's own exit before its group is killed
ZYGOTE_ENV = "STANDIN_ZYGOTE"   # "0": every invocation a fresh interpreter
ZYGOTE_START_S = 120.0  # a zygote's imports (torch): seconds on a quiet host, a minute on a loaded one
ZYGOTE_REPLY_S = 30.0   # one fork and its answer; a killed invocation's exit status
_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class FunctionCode:
    """What the stand-in needs to run a function: its code directory (an image's build
    context: the handler module at its root) and its configuration."""

    directory: Path
    handler: str = "handler.handler"
    environment: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 3.0        # Lambda's and FC's default
    memory_mb: int = 128
    name: str = "function"
    platform: str = LAMBDA        # LAMBDA or FC: reserved variables, event type, error shapes
    region: str = ""              # "" picks the platform's DEFAULT_REGIONS entry
    account_id: str = TEST_ACCOUNT_ID
    # False: the handler gets the JSON-decoded event, as on Lambda and behind an FC custom
    # container's server that decodes it; True: the payload bytes, as FC's Python runtime passes them
    raw_event: bool = False
    # modules the image's base has loaded before its handler's init (image_preload): each
    # invocation is forked from a process that imported them (tests.standins.zygote)
    preload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {self.platform!r}")
        if self.timeout_s <= 0 or self.memory_mb <= 0:
            raise ValueError(f"timeout_s and memory_mb must be positive, got {self.timeout_s} and {self.memory_mb}")
        object.__setattr__(self, "directory", Path(self.directory).absolute())
        if not self.region:
            object.__setattr__(self, "region", DEFAULT_REGIONS[self.platform])

    def arn(self, qualifier: str | None = None) -> str:
        """The ARN the function is invoked as (Lambda's ``invoked_function_arn``)."""
        if self.platform == FC:
            return f"acs:fc:{self.region}:{self.account_id}:functions/{self.name}"
        arn = f"arn:aws:lambda:{self.region}:{self.account_id}:function:{self.name}"
        return f"{arn}:{qualifier}" if qualifier else arn


@dataclass(frozen=True)
class InvocationResult:
    """What one invocation returned. ``error_type`` is None on success, else one of
    UNHANDLED, EXIT_ERROR, OUT_OF_MEMORY, TIMED_OUT; ``payload`` then holds the error JSON."""

    payload: bytes
    error_type: str | None
    log_tail: str
    duration_s: float                      # spawn to result, init included: what the caller waited
    request_id: str = ""
    init_duration_s: float | None = None   # None when init never finished
    max_memory_mb: float | None = None     # the handler process's peak RSS; None when it died unmeasured
    exit_code: int | None = None           # the process's, when it ended without a result

    @property
    def failed(self) -> bool:
        return self.error_type is not None


def reserved_environment(code: FunctionCode) -> dict[str, str]:
    """The variables the platform sets in every function, overriding the function's own."""
    if code.platform == FC:
        # documented for FC 3.0 ("Configure environment variables"; FC_FUNC_CODE_PATH is the code directory)
        return {
            "FC_FUNCTION_NAME": code.name,
            "FC_FUNCTION_HANDLER": code.handler,
            "FC_FUNCTION_MEMORY_SIZE": str(code.memory_mb),
            "FC_FUNC_CODE_PATH": str(code.directory),
            "FC_REGION": code.region,
            "FC_ACCOUNT_ID": code.account_id,
            "FC_FUNCTION_VERSION": "LATEST",
            "FC_INSTANCE_ID": uuid.uuid4().hex,
        }
    return {
        "AWS_LAMBDA_FUNCTION_NAME": code.name,
        "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(code.memory_mb),
        "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
        # not one of Lambda's documented variables: a stand-in extra; handlers should read
        # context.get_remaining_time_in_millis(), which works on both
        "AWS_LAMBDA_FUNCTION_TIMEOUT": f"{code.timeout_s:g}",
        "AWS_LAMBDA_LOG_GROUP_NAME": f"/aws/lambda/{code.name}",
        "AWS_REGION": code.region,
        "AWS_DEFAULT_REGION": code.region,
        "LAMBDA_TASK_ROOT": str(code.directory),
        "_HANDLER": code.handler,
        "TZ": ":UTC",
    }


def run_invocation(code: FunctionCode, payload: bytes, request_id: str | None = None, *,
                   qualifier: str | None = None, environ: Mapping[str, str] | None = None) -> InvocationResult:
    """Runs ``code``'s handler once on ``payload`` in a new process and waits for it.

    ``environ`` is the base environment (this process's by default). Never raises for what
    the function does; the result says how it failed.
    """
    if not code.directory.is_dir():
        raise ValueError(f"the code directory of function {code.name!r} does not exist: {code.directory}")
    request_id = request_id or str(uuid.uuid4())
    env = dict(os.environ if environ is None else environ)
    env.update(code.environment)
    env.update(reserved_environment(code))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code.directory), env.get("PYTHONPATH", "")) if p)

    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as log:
        stdin.write(payload)
        stdin.seek(0)
        read_fd, write_fd = os.pipe()
        start = time.monotonic()
        spec = {
            "handler": code.handler, "platform": code.platform, "request_id": request_id,
            "function_name": code.name, "function_arn": code.arn(qualifier), "memory_mb": code.memory_mb,
            "timeout_s": code.timeout_s, "region": code.region, "account_id": code.account_id,
            "raw_event": code.raw_event, "channel_fd": write_fd, "start_epoch_s": time.time(),
        }
        try:
            process = _start(code, spec, env, stdin, log, write_fd)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        try:
            outcome = _read_channel(read_fd, start, code.timeout_s)
        except BaseException:  # interrupted: the function must not outlive the call
            _kill_group(process.pid)
            process.wait()
            raise
        finally:
            os.close(read_fd)
        if outcome.tag is None:
            # no result: the deadline passed, or the channel closed and the process is ending
            # or (it closed the pipe) runs on, which the deadline still bounds
            timed_out = outcome.timed_out or not process.exited(outcome.deadline - time.monotonic())
        else:
            timed_out = False
            process.exited(EXIT_GRACE_S)
        if timed_out:   # still running: its peak so far is the one the kill below would lose
            outcome.peak_kib = peak_rss_kib(process.pid) or outcome.peak_kib
        _kill_group(process.pid)
        exit_code = process.wait()   # the group was just killed: this returns at once
        duration_s = time.monotonic() - start
        output = _tail(log, LOG_TAIL_BYTES)

    init_s = None if outcome.ready_at is None else outcome.ready_at - start
    max_memory_mb = None if outcome.peak_kib is None else outcome.peak_kib / 1024
    if timed_out:
        error_type, body = TIMED_OUT, _timeout_payload(code, request_id)
    elif outcome.tag is None:
        error_type, body = EXIT_ERROR, _exit_payload(code, request_id, exit_code, duration_s, max_memory_mb)
    elif max_memory_mb is not None and max_memory_mb > code.memory_mb:
        error_type, body = OUT_OF_MEMORY, _out_of_memory_payload(code, request_id, duration_s, max_memory_mb)
    elif outcome.tag == FAILURE:
        error_type, body = UNHANDLED, outcome.body
    else:
        error_type, body = None, outcome.body
    return InvocationResult(
        payload=body, error_type=error_type, request_id=request_id, duration_s=duration_s,
        init_duration_s=init_s, max_memory_mb=max_memory_mb,
        exit_code=exit_code if outcome.tag is None and not timed_out else None,
        log_tail=_log_tail(code, request_id, output, error_type, duration_s, init_s, max_memory_mb))


@dataclass
class _Outcome:
    tag: bytes | None       # SUCCESS or FAILURE; None: no result (channel closed or deadline passed)
    body: bytes
    ready_at: float | None  # monotonic time init finished
    deadline: float         # monotonic time the handler had to finish by
    timed_out: bool
    peak_kib: int | None = None


def _read_channel(fd: int, start: float, timeout_s: float) -> _Outcome:
    """Reads the bootstrap's messages until its result, EOF or the deadline."""
    buffer = bytearray()
    ready_at = peak_kib = None
    poller = select.poll()  # not select.select: a busy server's descriptors may pass FD_SETSIZE
    poller.register(fd, select.POLLIN)
    deadline = start + max(INIT_LIMIT_S, timeout_s)
    while True:
        while len(buffer) >= HEADER.size:
            tag, length = HEADER.unpack_from(buffer)
            end = HEADER.size + length
            if len(buffer) < end:
                break
            body = bytes(buffer[HEADER.size:end])
            del buffer[:end]
            if tag == MEMORY:
                peak_kib = int(body)
                continue
            if tag != READY:
                tag = tag if tag in (SUCCESS, FAILURE) else FAILURE
                return _Outcome(tag, body, ready_at, deadline, False, peak_kib)
            ready_at = time.monotonic()
            deadline = bootstrap.handler_deadline(start, ready_at, timeout_s)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return _Outcome(None, b"", ready_at, deadline, True, peak_kib)
        if not poller.poll(max(1, int(remaining * 1000))):
            continue
        chunk = os.read(fd, _READ_CHUNK)
        if not chunk:
            return _Outcome(None, b"", ready_at, deadline, False, peak_kib)
        buffer += chunk


def image_preload(directory: Path) -> tuple[str, ...]:
    """What an image's base has imported before its handler's init: torch, where the image
    installs it (its requirements pin it, as every flatpack image's do); nothing otherwise,
    so a function that never imports torch is not charged its memory."""
    requirements = directory / "requirements.txt"
    pins = requirements.read_text().split() if requirements.is_file() else []
    return ("torch",) if any(pin.startswith("torch==") for pin in pins) else ()


def _start(code: FunctionCode, spec: dict, env: dict[str, str], stdin: IO[bytes], log: IO[bytes],
           write_fd: int) -> _Fresh | _Forked:
    """The invocation's process: forked from the zygote of ``code.preload`` where there is
    one, else a fresh interpreter (also when the zygote cannot start or answer)."""
    argv = [bootstrap.__file__, json.dumps(spec)]
    if code.preload:
        zygote = _zygote(code.preload, env)
        if zygote is not None:
            forked = zygote.spawn(argv, code.directory, env, stdin.fileno(), log.fileno(), write_fd)
            if forked is not None:
                return forked
            _forget(zygote)     # it died: this invocation starts fresh, the next one a new zygote
    # -u: a killed function's last prints still reach the log
    return _Fresh(subprocess.Popen(
        [sys.executable, "-u", *argv], cwd=code.directory, env=env, stdin=stdin, stdout=log,
        stderr=subprocess.STDOUT, pass_fds=(write_fd,),
        start_new_session=True))  # its own process group, so a timeout kills its children too


class _Fresh:
    """An invocation's own interpreter, a child of this process."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.pid = process.pid

    def exited(self, timeout_s: float) -> bool:
        """Whether the process exited within ``timeout_s``; leaves it unreaped (a zombie keeps
        its process-group id from being reused before :func:`_kill_group`)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        delay = 0.0005
        while True:
            if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.02)

    def wait(self) -> int:
        return self.process.wait()


class _Forked:
    """An invocation forked from a zygote, which reaps it and writes its exit status to
    ``status_fd`` (so the group id is free once that is readable: :func:`_kill_group` may
    find no one, which it allows)."""

    def __init__(self, pid: int, status_fd: int) -> None:
        self.pid = pid
        self.status_fd = status_fd
        self.returncode: int | None = None

    def exited(self, timeout_s: float) -> bool:
        if self.returncode is not None:
            return True
        readable, _, _ = select.select([self.status_fd], [], [], max(0.0, timeout_s))
        return bool(readable)

    def wait(self) -> int:
        if self.returncode is None:
            # the caller killed the group first: the zygote reaps the child at once
            if not self.exited(ZYGOTE_REPLY_S):
                raise RuntimeError(f"the zygote reported no exit status of invocation pid {self.pid}")
            data = b""
            while chunk := os.read(self.status_fd, 64):
                data += chunk
            os.close(self.status_fd)
            self.returncode = int(data) if data else -signal.SIGKILL   # the zygote died: its children with it
        return self.returncode


class _Zygote:
    """One zygote process (tests.standins.zygote) and the control socket to it."""

    def __init__(self, modules: tuple[str, ...], env: dict[str, str]) -> None:
        # start-up time: flatpack (and torch) load only where an image's invocations are forked
        from flatpack.interrupts import die_with_parent, on_lasting_thread

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.control = ours
        self.lock = threading.Lock()
        try:
            # on a thread that lasts as long as this process: the zygote dies with the process
            # (PR_SET_PDEATHSIG), not with the thread of the invocation that started it
            self.process = on_lasting_thread(lambda: subprocess.Popen(
                [sys.executable, "-u", zygote.__file__, json.dumps(list(modules)), str(theirs.fileno())],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), preexec_fn=die_with_parent()))
        finally:
            theirs.close()
        ours.settimeout(ZYGOTE_START_S)
        if json.loads(ours.recv(4096) or b"null") != "ready":
            raise OSError("the zygote did not start")
        ours.settimeout(ZYGOTE_REPLY_S)

    def spawn(self, argv: list[str], cwd: Path, env: dict[str, str], stdin: int, log: int,
              channel: int) -> _Forked | None:
        """Forks one invocation; None when the zygote is gone (the caller starts it fresh)."""
        status_read, status_write = os.pipe()
        try:
            with self.lock:
                socket.send_fds(self.control, [json.dumps({"argv": argv, "cwd": str(cwd), "env": env}).encode()],
                                [stdin, log, channel, status_write])
                reply = self.control.recv(4096)
        except OSError:
            reply = b""
        finally:
            os.close(status_write)
        if not reply:
            os.close(status_read)
            return None
        return _Forked(json.loads(reply), status_read)

    def close(self) -> None:
        self.control.close()     # end of file: the zygote kills its children and exits
        try:
            self.process.wait(timeout=ZYGOTE_REPLY_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_ZYGOTES: dict[tuple, _Zygote | None] = {}
_ZYGOTES_LOCK = threading.Lock()


def _zygote(modules: tuple[str, ...], env: dict[str, str]) -> _Zygote | None:
    """The zygote for ``modules`` under the variables read while they load (an environment
    that differs in them gets its own), started on first use; None where one cannot start
    (``STANDIN_ZYGOTE=0`` asks for none)."""
    if os.environ.get(ZYGOTE_ENV, "1") == "0" or sys.platform != "linux":
        return None
    # start-up time: flatpack (and torch) load only where an image's invocations are forked
    from flatpack.runtime.forked import IMPORT_TIME_PREFIXES

    base = {name: value for name, value in env.items() if name.startswith(IMPORT_TIME_PREFIXES)}
    # the code directory the runner put first on PYTHONPATH is each child's own
    base["PYTHONPATH"] = os.pathsep.join(env.get("PYTHONPATH", "").split(os.pathsep)[1:])
    key = (modules, tuple(sorted(base.items())))
    with _ZYGOTES_LOCK:
        if key not in _ZYGOTES:
            try:
                _ZYGOTES[key] = _Zygote(modules, {**env, **base})
            except (OSError, json.JSONDecodeError):
                _ZYGOTES[key] = None
        return _ZYGOTES[key]


def _forget(zygote: _Zygote) -> None:
    with _ZYGOTES_LOCK:
        for key, known in list(_ZYGOTES.items()):
            if known is zygote:
                del _ZYGOTES[key]
    zygote.close()


def _close_zygotes() -> None:
    with _ZYGOTES_LOCK:
        for zygote in _ZYGOTES.values():
            if zygote is not None:
                zygote.close()
        _ZYGOTES.clear()


atexit.register(_close_zygotes)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(file: IO[bytes], size: int) -> bytes:
    file.seek(0, os.SEEK_END)
    file.seek(max(0, file.tell() - size))
    return file.read()


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def _exit_reason(exit_code: int) -> str:
    # the wording of Lambda's runtime (Go's os.ProcessState): "exit status 3", "signal: killed"
    if exit_code < 0:
        name = signal.strsignal(-exit_code)   # None: a number this platform does not name
        return f"signal: {name.lower() if name else -exit_code}"
    return f"exit status {exit_code}"


def _timeout_payload(code: FunctionCode, request_id: str) -> bytes:
    if code.platform == FC:
        # FC's documented message is "Function time out after ..."
        return json.dumps({"errorMessage": f"Function time out after {code.timeout_s:g} seconds"}).encode()
    message = f"RequestId: {request_id} Error: Task timed out after {code.timeout_s:.2f} seconds"
    return json.dumps({"errorType": TIMED_OUT, "errorMessage": message}).encode()


def _fc_exit_message(duration_s: float, max_memory_mb: float | None) -> bytes:
    message = (f"Process exited unexpectedly before completing request "
               f"(duration: {duration_s * 1000:.0f}ms, maxMemoryUsage: {max_memory_mb or 0:.0f}MB)")
    return json.dumps({"errorMessage": message}).encode()


def _exit_payload(code: FunctionCode, request_id: str, exit_code: int, duration_s: float,
                  max_memory_mb: float | None) -> bytes:
    if code.platform == FC:
        return _fc_exit_message(duration_s, max_memory_mb)
    if exit_code == 0:
        message = f"RequestId: {request_id} Error: Runtime exited without providing a reason"
    else:
        message = f"RequestId: {request_id} Error: Runtime exited with error: {_exit_reason(exit_code)}"
    return json.dumps({"errorType": EXIT_ERROR, "errorMessage": message}).encode()


def _out_of_memory_payload(code: FunctionCode, request_id: str, duration_s: float, max_memory_mb: float) -> bytes:
    if code.platform == FC:
        return _fc_exit_message(duration_s, max_memory_mb)
    message = f"RequestId: {request_id} Error: Runtime exited with error: signal: killed"
    return json.dumps({"errorType": OUT_OF_MEMORY, "errorMessage": message}).encode()


def _log_tail(code: FunctionCode, request_id: str, output: bytes, error_type: str | None, duration_s: float,
              init_s: float | None, max_memory_mb: float | None) -> str:
    """The last LOG_TAIL_BYTES of the function's log, framed the way each platform frames it."""
    text = output.decode(errors="replace")
    if text and not text.endswith("\n"):
        text += "\n"
    if code.platform == FC:
        log = f"FC Invoke Start RequestId: {request_id}\n{text}FC Invoke End RequestId: {request_id}\n"
    else:
        handler_s = duration_s - (init_s or 0.0)
        status = "\tStatus: timeout" if error_type == TIMED_OUT else ""
        init = f"\tInit Duration: {_ms(init_s)} ms" if init_s is not None else ""
        log = (f"START RequestId: {request_id} Version: $LATEST\n{text}END RequestId: {request_id}\n"
               f"REPORT RequestId: {request_id}\tDuration: {_ms(handler_s)} ms\t"
               f"Billed Duration: {int(handler_s * 1000) + 1} ms\tMemory Size: {code.memory_mb} MB\t"
               f"Max Memory Used: {max_memory_mb or 0:.0f} MB{init}{status}\n")
    return log.encode()[-LOG_TAIL_BYTES:].decode(errors="ignore")
