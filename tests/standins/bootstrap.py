"""The function side of one stand-in invocation: a minimal Lambda / FC Python runtime.

:mod:`tests.standins.runner` starts this file as a script (``python -u
bootstrap.py SPEC``) in the function's code directory, the event on stdin. It imports
``module.function`` from the handler string, tells the runner init is done, calls
``handler(event, context)`` and sends the JSON result, or the error in the platform's shape,
back on a pipe of its own (the handler may print to stdout/stderr, which the runner keeps
as the function's log).

It imports the standard library only, never flatpack (torch with it: ~2 s per invocation),
and runs as a script, not with ``python -m``, which would import its packages first: a real
runtime imports only what the handler imports. The runner imports the framing helpers and
:func:`handler_deadline` from here so both sides agree on them.

Channel framing: each message is a 1-byte tag, an 8-byte big-endian length, the body.
``R`` (init done, empty body), ``M`` (peak RSS in KiB, decimal), then one of ``S`` (the
result payload) or ``E`` (the error payload, JSON). A length-prefixed message needs no EOF,
so a forked child that inherits the pipe cannot stall the runner.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any, Callable, NoReturn

LAMBDA = "aws-lambda"
FC = "alibaba-fc"

READY, MEMORY, SUCCESS, FAILURE = b"R", b"M", b"S", b"E"
HEADER = struct.Struct(">cQ")

# Lambda runs a function's init outside its timeout for up to 10 s; a longer init is retried
# inside the first invocation, where it counts against the function timeout
# (docs.aws.amazon.com/lambda/latest/dg/lambda-runtime-environment.html, "Init phase").
INIT_LIMIT_S = 10.0


def frame(tag: bytes, body: bytes = b"") -> bytes:
    """One channel message."""
    return HEADER.pack(tag, len(body)) + body


def handler_deadline(start: float, ready: float, timeout_s: float) -> float:
    """When the handler must be done, on the clock ``start`` and ``ready`` are read from."""
    if ready - start <= INIT_LIMIT_S:
        return ready + timeout_s
    return start + timeout_s


class Context:
    """The handler's context: Lambda's Python ``LambdaContext`` attributes, plus the names
    FC's Python runtime uses (``request_id``, ``function.name``, ``region``...)."""

    def __init__(self, spec: dict[str, Any], deadline_epoch_s: float) -> None:
        self._deadline_ms = int(deadline_epoch_s * 1000)
        self.aws_request_id = self.request_id = spec["request_id"]
        self.function_name = spec["function_name"]
        self.function_version = "$LATEST"
        self.invoked_function_arn = spec["function_arn"]
        # a string, as awslambdaric reads it from AWS_LAMBDA_FUNCTION_MEMORY_SIZE
        self.memory_limit_in_mb = str(spec["memory_mb"])
        self.log_group_name = f"/aws/lambda/{spec['function_name']}"
        self.log_stream_name = spec["request_id"]
        self.identity = None
        self.client_context = None
        self.region = spec["region"]
        self.account_id = spec["account_id"]
        self.function = SimpleNamespace(name=spec["function_name"], handler=spec["handler"],
                                        memory=spec["memory_mb"], timeout=spec["timeout_s"])

    def get_remaining_time_in_millis(self) -> int:
        return max(0, self._deadline_ms - int(time.time() * 1000))


class _Fault(Exception):
    """A runtime-detected error (bad handler string, import failure...) with Lambda's type."""

    def __init__(self, error_type: str, message: str, trace: list | None = None) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.trace = trace or []


def load_handler(handler: str) -> Callable[[Any, Context], Any]:
    """``module.function`` (module may be dotted), imported the way awslambdaric does."""
    module_name, _, function_name = handler.rpartition(".")
    if not module_name or not function_name:
        raise _Fault("Runtime.MalformedHandlerName", f"Bad handler '{handler}': expected module.function")
    try:
        module = importlib.import_module(module_name.replace("/", "."))
    except ImportError as exc:
        raise _Fault("Runtime.ImportModuleError", f"Unable to import module '{module_name}': {exc}") from exc
    except SyntaxError as exc:
        trace = [f'  File "{exc.filename}" Line {exc.lineno}\n    {exc.text}']
        raise _Fault("Runtime.UserCodeSyntaxError", f"Syntax error in module '{module_name}': {exc}", trace) from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise _Fault("Runtime.HandlerNotFound", f"Handler '{function_name}' missing on module '{module_name}'")
    return function


def decode_event(data: bytes, raw: bool) -> Any:
    """The JSON-decoded payload, as Lambda hands it over (an empty payload as ``{}``), or the
    raw bytes, as FC's built-in Python runtime does."""
    if raw:
        return data
    try:
        return json.loads(data or b"{}")
    except ValueError as exc:
        raise _Fault("Runtime.UnmarshalError", f"Unable to unmarshal input: {exc}") from exc


def encode_result(result: Any, platform: str) -> bytes:
    """Lambda JSON-serializes every return value (a str too); FC passes bytes and str through."""
    if platform == FC and isinstance(result, (bytes, bytearray)):
        return bytes(result)
    if platform == FC and isinstance(result, str):
        return result.encode()
    try:
        return json.dumps(result).encode()
    except (TypeError, ValueError) as exc:
        raise _Fault("Runtime.MarshalError", f"Unable to marshal response: {exc}") from exc


def error_payload(error_type: str, message: str, trace: list, platform: str, request_id: str) -> bytes:
    """The error body each platform returns (FC has no requestId in it)."""
    body: dict[str, Any] = {"errorMessage": message, "errorType": error_type}
    if platform == LAMBDA:
        body["requestId"] = request_id
    body["stackTrace"] = trace
    return json.dumps(body).encode()


def exception_trace(exc: BaseException, platform: str, skip_frames: int) -> list:
    """Lambda's Python stack trace is formatted lines; FC's is [file, line, function, code] lists."""
    frames = traceback.extract_tb(exc.__traceback__)[skip_frames:]
    if platform == FC:
        return [[f'File "{f.filename}"', f"line {f.lineno}", f"in {f.name}", f.line or ""] for f in frames]
    return traceback.format_list(frames)


def _log_error(error_type: str, message: str, exc: BaseException | None) -> None:
    # Lambda's runtime writes "[ERROR] Type: message" and the traceback to the function's log
    print(f"[ERROR] {error_type}: {message}", file=sys.stderr)
    if exc is not None:
        traceback.print_exception(exc, file=sys.stderr)


def _send(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def peak_rss_kib(pid: int | str = "self") -> int | None:
    """VmHWM of a live process. Not getrusage's ru_maxrss: Linux carries the parent's peak
    across fork and exec into it, so a child of a torch-importing server would start at ~220 MB."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _finish(fd: int, tag: bytes, body: bytes) -> NoReturn:
    peak = peak_rss_kib()
    _send(fd, (frame(MEMORY, str(peak).encode()) if peak is not None else b"") + frame(tag, body))
    sys.stdout.flush()
    sys.stderr.flush()
    # Lambda freezes the sandbox once the handler returns: atexit hooks and non-daemon
    # threads do not get to delay the response
    os._exit(0)


def main(argv: list[str]) -> None:
    spec = json.loads(argv[1])
    platform = spec["platform"]
    channel = spec["channel_fd"]
    os.set_inheritable(channel, False)  # the handler's subprocesses must not hold the pipe
    # the script's own directory is sys.path[0]; the function's code directory replaces it,
    # as LAMBDA_TASK_ROOT comes first on a real runtime's path
    sys.path[0] = os.getcwd()
    event_bytes = sys.stdin.buffer.read()

    try:
        handler = load_handler(spec["handler"])
    except _Fault as fault:
        _log_error(fault.error_type, str(fault), None)
        _finish(channel, FAILURE, error_payload(fault.error_type, str(fault), fault.trace, platform,
                                                spec["request_id"]))
    except Exception as exc:  # the module raised at import: reported like a handler exception
        _log_error(type(exc).__name__, str(exc), exc)
        _finish(channel, FAILURE, error_payload(type(exc).__name__, str(exc), exception_trace(exc, platform, 0),
                                                platform, spec["request_id"]))
    _send(channel, frame(READY))
    context = Context(spec, handler_deadline(spec["start_epoch_s"], time.time(), spec["timeout_s"]))

    try:
        event = decode_event(event_bytes, spec["raw_event"])
        result = handler(event, context)
        body = encode_result(result, platform)
    except _Fault as fault:
        _log_error(fault.error_type, str(fault), None)
        _finish(channel, FAILURE, error_payload(fault.error_type, str(fault), [], platform, spec["request_id"]))
    except Exception as exc:  # SystemExit and KeyboardInterrupt end the process: Runtime.ExitError
        _log_error(type(exc).__name__, str(exc), exc)
        # frame 0 is this function's call of the handler; the trace starts in user code
        _finish(channel, FAILURE, error_payload(type(exc).__name__, str(exc), exception_trace(exc, platform, 1),
                                                platform, spec["request_id"]))
    _finish(channel, SUCCESS, body)


if __name__ == "__main__":
    main(sys.argv)
