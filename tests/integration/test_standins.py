"""The local stand-ins of Lambda's and FC's invoke APIs, driven by the real SDK clients.

boto3 and the FC 3.0 SDK talk to the stand-ins through an endpoint override, moto serves
Lambda's control plane; handlers are tiny modules written into tmp_path. The tests that
start function processes are marked slow (each start costs an interpreter start, ~50 ms).
"""

from __future__ import annotations

import base64
import io
import json
import textwrap
from pathlib import Path
from typing import Iterator

import boto3
import pytest
from botocore.config import Config as BotoConfig

from tests.standins import runner
from tests.standins.fc_api import (ERROR_TYPE_HEADER, UNHANDLED_ERROR, LocalFunctionCompute,
                                   context_resolver)
from tests.standins.lambda_api import (LocalLambdaEndpoint, dockerfile_command, image_keys,
                                       moto_resolver, parse_function_name)
from tests.standins.runner import FC, FunctionCode, InvocationResult, run_invocation

# obviously fake credentials: moto and the stand-ins accept any, the FC stand-in checks these
ACCESS_KEY_ID, SECRET = "test-key-id", "test-secret"
ACCOUNT = runner.TEST_ACCOUNT_ID

HANDLER = '''
import json, os, signal, sys, time

def handler(event, context):
    event_type = type(event).__name__
    if isinstance(event, bytes):  # FunctionCode.raw_event: the payload as FC's Python runtime passes it
        event = json.loads(event or b"{}")
    action = event.get("action", "echo")
    print("handling", action)
    if action == "raise":
        raise ValueError("boom")
    if action == "exit":
        os._exit(event["code"])
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "sleep":
        time.sleep(event["seconds"])
    return {
        "event": event,
        "event_type": event_type,
        "function_name": context.function_name,
        "memory_limit_in_mb": context.memory_limit_in_mb,
        "request_id": context.aws_request_id,
        "arn": context.invoked_function_arn,
        "remaining_ms": context.get_remaining_time_in_millis(),
        "cwd": os.getcwd(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("AWS_LAMBDA_", "FC_", "LAMBDA_", "STAGE"))},
        "pid": os.getpid(), "session": os.getsid(0), "path0": sys.path[0],
        "preloaded": "colorsys" in sys.modules,   # what BASES preloads (nothing here imports it)
    }
'''


@pytest.fixture
def code_dir(tmp_path: Path) -> Path:
    """A build context: handler.py at its root, a Dockerfile whose CMD names the handler."""
    directory = tmp_path / "context"
    directory.mkdir()
    (directory / "handler.py").write_text(textwrap.dedent(HANDLER))
    (directory / "Dockerfile").write_text('FROM public.ecr.aws/lambda/python:3.11\nCOPY handler.py ./\n'
                                          'CMD [ "handler.handler" ]\n')
    return directory


# a fresh interpreter per invocation, and one forked from a process that preloaded a module
# (tests.standins.zygote: how a flatpack image's invocations start, with torch preloaded)
BASES = [(), ("colorsys",)]


def invoke_json(result: InvocationResult) -> dict:
    return json.loads(result.payload)


# --- pure helpers ----------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    ("fn", ("fn", None)),
    ("fn:prod", ("fn", "prod")),
    (f"{ACCOUNT}:function:fn", ("fn", None)),
    (f"arn:aws:lambda:us-east-1:{ACCOUNT}:function:fn", ("fn", None)),
    (f"arn:aws:lambda:us-east-1:{ACCOUNT}:function:fn:7", ("fn", "7")),
])
def test_function_names_and_arns_parse(value: str, expected: tuple) -> None:
    assert parse_function_name(value) == expected


@pytest.mark.parametrize("value", ["", "a:b:c:d:e", "fn:", "bad name", f"arn:aws:s3:us-east-1:{ACCOUNT}:function:fn"])
def test_malformed_function_names_are_rejected(value: str) -> None:
    with pytest.raises(ValueError):
        parse_function_name(value)


def test_image_keys_drop_the_registry_host() -> None:
    uri = f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/team/flatpack:stage0"
    assert image_keys(uri) == [uri, "team/flatpack:stage0", "flatpack:stage0"]
    assert image_keys("flatpack:stage0") == ["flatpack:stage0"]


def test_dockerfile_cmd_names_the_handler(tmp_path: Path) -> None:
    assert dockerfile_command(tmp_path) is None
    (tmp_path / "Dockerfile").write_text('FROM x\nCMD ["first.handler"]\ncmd app.main --flag\n')
    assert dockerfile_command(tmp_path) == "app.main"


def test_an_image_that_installs_torch_has_it_preloaded(tmp_path: Path) -> None:
    assert runner.image_preload(tmp_path) == ()
    (tmp_path / "requirements.txt").write_text("numpy==2.1.0 --hash=sha256:00\n")
    assert runner.image_preload(tmp_path) == ()
    (tmp_path / "requirements.txt").write_text("torch==2.13.0+cpu --hash=sha256:00\n")
    assert runner.image_preload(tmp_path) == ("torch",)


# --- the runner --------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("base", BASES)
def test_runner_returns_the_result_with_lambda_context_and_environment(base: tuple[str, ...], code_dir: Path) -> None:
    code = FunctionCode(code_dir, preload=base, environment={"STAGE_INDEX": "3"}, memory_mb=256, timeout_s=5,
                        name="stage-3")
    result = run_invocation(code, b'{"x": 1}', "req-1")
    assert result.error_type is None, result.payload
    body = invoke_json(result)
    assert body["event"] == {"x": 1}
    assert body["function_name"] == "stage-3" and body["memory_limit_in_mb"] == "256"
    assert body["request_id"] == "req-1"
    assert body["arn"] == f"arn:aws:lambda:us-east-1:{ACCOUNT}:function:stage-3"
    assert 0 < body["remaining_ms"] <= 5000
    assert Path(body["cwd"]) == code_dir
    assert body["env"] == {
        "STAGE_INDEX": "3", "AWS_LAMBDA_FUNCTION_NAME": "stage-3", "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": "256",
        "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST", "AWS_LAMBDA_FUNCTION_TIMEOUT": "5",
        "AWS_LAMBDA_LOG_GROUP_NAME": "/aws/lambda/stage-3", "LAMBDA_TASK_ROOT": str(code_dir)}
    assert "handling echo" in result.log_tail and "REPORT RequestId: req-1" in result.log_tail
    assert result.max_memory_mb is not None and 0 < result.max_memory_mb < 256
    # a runtime of its own either way: its own session, its code directory first on its path
    assert body["session"] == body["pid"] and Path(body["path0"]) == code_dir
    assert body["preloaded"] == bool(base)
    again = invoke_json(run_invocation(code, b'{"x": 2}', "req-1b"))
    assert again["pid"] != body["pid"] and again["event"] == {"x": 2} and again["env"] == body["env"]


@pytest.mark.slow
@pytest.mark.parametrize("base", BASES)
def test_runner_reports_a_handler_exception_in_lambdas_shape(base: tuple[str, ...], code_dir: Path) -> None:
    result = run_invocation(FunctionCode(code_dir, preload=base), b'{"action": "raise"}', "req-2")
    assert result.error_type == runner.UNHANDLED
    body = invoke_json(result)
    assert body["errorType"] == "ValueError" and body["errorMessage"] == "boom" and body["requestId"] == "req-2"
    assert "handler.py" in body["stackTrace"][0] and "bootstrap" not in body["stackTrace"][0]
    assert "[ERROR] ValueError: boom" in result.log_tail


@pytest.mark.slow
@pytest.mark.parametrize("base", BASES)
def test_runner_reports_import_failures(base: tuple[str, ...], code_dir: Path) -> None:
    result = run_invocation(FunctionCode(code_dir, preload=base, handler="missing.handler"), b"{}")
    assert result.error_type == runner.UNHANDLED
    assert invoke_json(result)["errorType"] == "Runtime.ImportModuleError"
    result = run_invocation(FunctionCode(code_dir, preload=base, handler="handler.nope"), b"{}")
    assert invoke_json(result)["errorType"] == "Runtime.HandlerNotFound"


@pytest.mark.slow
@pytest.mark.parametrize("base", BASES)
def test_runner_kills_a_function_at_its_timeout(base: tuple[str, ...], code_dir: Path) -> None:
    result = run_invocation(FunctionCode(code_dir, preload=base, timeout_s=0.5), b'{"action": "sleep", "seconds": 30}',
                            "req-3")
    assert result.error_type == runner.TIMED_OUT
    assert invoke_json(result)["errorMessage"] == "RequestId: req-3 Error: Task timed out after 0.50 seconds"
    assert result.duration_s < 5
    assert "handling sleep" in result.log_tail  # printed before the kill: the output is unbuffered


@pytest.mark.slow
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("event, reason, exit_code", [
    ({"action": "exit", "code": 3}, "exit status 3", 3),
    ({"action": "kill"}, "signal: killed", -9),
])
def test_runner_reports_an_exit_without_a_result(base: tuple[str, ...], code_dir: Path, event: dict, reason: str,
                                                 exit_code: int) -> None:
    result = run_invocation(FunctionCode(code_dir, preload=base), json.dumps(event).encode(), "req-4")
    assert result.error_type == runner.EXIT_ERROR and result.exit_code == exit_code
    assert invoke_json(result) == {"errorType": "Runtime.ExitError",
                                   "errorMessage": f"RequestId: req-4 Error: Runtime exited with error: {reason}"}


@pytest.mark.slow
@pytest.mark.parametrize("base", BASES)
def test_runner_fails_a_function_above_its_memory_size(base: tuple[str, ...], code_dir: Path) -> None:
    (code_dir / "hog.py").write_text("def handler(event, context):\n    block = bytearray(200 << 20)\n"
                                     "    return len(block)\n")
    result = run_invocation(FunctionCode(code_dir, preload=base, handler="hog.handler", memory_mb=128), b"{}")
    assert result.error_type == runner.OUT_OF_MEMORY
    assert result.max_memory_mb is not None and result.max_memory_mb > 200


@pytest.mark.slow
@pytest.mark.parametrize("base", BASES)
def test_runner_measures_a_function_that_closed_its_channel_and_ran_past_its_timeout(base: tuple[str, ...],
                                                                                     code_dir: Path) -> None:
    # the channel closed without a result, so no peak came over it: read before the kill
    (code_dir / "stray.py").write_text("import json, os, sys, time\n\ndef handler(event, context):\n"
                                       "    block = bytearray(200 << 20)\n"
                                       "    os.close(json.loads(sys.argv[1])['channel_fd'])\n"
                                       "    time.sleep(30)\n")
    # the timeout leaves the 200 MB time to be touched on a loaded host (0.5 s measured 145 MB at load 12)
    result = run_invocation(FunctionCode(code_dir, preload=base, handler="stray.handler", memory_mb=512, timeout_s=5.0),
                            b"{}")
    assert result.error_type == runner.TIMED_OUT and result.duration_s < 30     # its timeout, not its sleep
    assert result.max_memory_mb is not None and result.max_memory_mb > 200


@pytest.mark.slow
def test_an_invocation_still_runs_when_its_zygote_is_gone(code_dir: Path) -> None:
    """A zygote that died (killed, out of memory) costs speed, not answers: the invocation
    that finds it gone starts as a fresh interpreter, the next one from a new zygote."""
    code = FunctionCode(code_dir, preload=("colorsys",))
    assert invoke_json(run_invocation(code, b'{"x": 1}'))["preloaded"]
    for key, zygote in runner._ZYGOTES.items():
        if key[0] == ("colorsys",) and zygote is not None:
            zygote.process.kill()
            zygote.process.wait()
    body = invoke_json(run_invocation(code, b'{"x": 2}'))
    assert body["event"] == {"x": 2} and not body["preloaded"]
    body = invoke_json(run_invocation(code, b'{"x": 3}'))
    assert body["event"] == {"x": 3} and body["preloaded"]


@pytest.mark.slow
def test_runner_speaks_fc_on_fc(code_dir: Path) -> None:
    code = FunctionCode(code_dir, platform=FC, name="stage-0", memory_mb=512)
    body = invoke_json(run_invocation(code, b'{"x": 2}'))
    assert body["event"] == {"x": 2} and body["event_type"] == "dict"
    assert body["env"]["FC_FUNCTION_NAME"] == "stage-0" and body["env"]["FC_FUNCTION_MEMORY_SIZE"] == "512"
    assert body["env"]["FC_FUNC_CODE_PATH"] == str(code_dir)
    error = invoke_json(run_invocation(code, b'{"action": "raise"}'))
    assert error["errorType"] == "ValueError" and "requestId" not in error
    assert error["stackTrace"][0][0].endswith('handler.py"')  # FC's [file, line, function, code] frames
    raw = FunctionCode(code_dir, platform=FC, raw_event=True)
    assert invoke_json(run_invocation(raw, b'{"x": 3}'))["event_type"] == "bytes"


# --- the Lambda stand-in ----------------------------------------------------------------------

def _lambda_client(url: str):
    return boto3.client("lambda", endpoint_url=url, region_name="us-east-1", aws_access_key_id=ACCESS_KEY_ID,
                        aws_secret_access_key=SECRET, config=BotoConfig(retries={"max_attempts": 1}))


@pytest.fixture
def lambda_endpoint(code_dir: Path) -> Iterator[LocalLambdaEndpoint]:
    functions = {"stage-0": FunctionCode(code_dir, name="stage-0", timeout_s=0.5)}
    with LocalLambdaEndpoint(functions.get) as endpoint:
        yield endpoint


def test_lambda_unknown_functions_and_bad_requests_raise_botocore_errors() -> None:
    calls = []

    def record(code, payload, request_id=None, *, qualifier=None):
        calls.append((code, payload, request_id))
        return InvocationResult(b"{}", None, "", 0.0, request_id or "")

    endpoint = LocalLambdaEndpoint({"known": FunctionCode(Path("."))}.get, runner=record)
    with endpoint:
        client = _lambda_client(endpoint.url)
        with pytest.raises(client.exceptions.ResourceNotFoundException, match="function:nope"):
            client.invoke(FunctionName="nope")
        with pytest.raises(client.exceptions.InvalidRequestContentException):
            client.invoke(FunctionName="known", Payload=b"not json")
        assert client.invoke(FunctionName="known", InvocationType="DryRun")["StatusCode"] == 204
    assert calls == []  # none of these ran the function
    assert [(r.function, r.invocation_type, r.status) for r in endpoint.invocations] == [("known", "DryRun", 204)]


def test_lambda_passes_the_qualifier_to_the_runner() -> None:
    qualifiers = []

    def record(code, payload, request_id=None, *, qualifier=None):
        qualifiers.append(qualifier)
        return InvocationResult(b"{}", None, "", 0.0, request_id or "")

    with LocalLambdaEndpoint({"fn": FunctionCode(Path("."))}.get, runner=record) as endpoint:
        client = _lambda_client(endpoint.url)
        client.invoke(FunctionName="fn", Qualifier="prod")
        client.invoke(FunctionName="fn:7")
        client.invoke(FunctionName="fn")
    assert qualifiers == ["prod", "7", None]


@pytest.mark.slow
def test_lambda_invoke_through_boto3(lambda_endpoint: LocalLambdaEndpoint) -> None:
    client = _lambda_client(lambda_endpoint.url)
    response = client.invoke(FunctionName=f"arn:aws:lambda:us-east-1:{ACCOUNT}:function:stage-0",
                             Payload=json.dumps({"x": 1}), LogType="Tail")
    assert response["StatusCode"] == 200 and "FunctionError" not in response
    assert response["ExecutedVersion"] == "$LATEST"
    assert json.loads(response["Payload"].read())["event"] == {"x": 1}
    assert "handling echo" in base64.b64decode(response["LogResult"]).decode()

    failed = client.invoke(FunctionName="stage-0", Qualifier="$LATEST", Payload=b'{"action": "raise"}')
    assert failed["StatusCode"] == 200 and failed["FunctionError"] == "Unhandled"
    assert json.loads(failed["Payload"].read())["errorType"] == "ValueError"

    timed_out = client.invoke(FunctionName="stage-0", Payload=b'{"action": "sleep", "seconds": 30}')
    assert timed_out["FunctionError"] == "Unhandled"
    assert "Task timed out after 0.50 seconds" in json.loads(timed_out["Payload"].read())["errorMessage"]

    killed = client.invoke(FunctionName="stage-0", Payload=b'{"action": "kill"}')
    assert killed["FunctionError"] == "Unhandled"
    assert json.loads(killed["Payload"].read())["errorType"] == "Runtime.ExitError"

    assert client.invoke(FunctionName="stage-0", InvocationType="Event", Payload=b'{"y": 2}')["StatusCode"] == 202
    assert lambda_endpoint.wait_for_events(timeout_s=10)
    event = lambda_endpoint.invocations[-1]
    assert (event.function, event.invocation_type, event.status) == ("stage-0", "Event", 202)
    assert event.result is not None and json.loads(event.result.payload)["event"] == {"y": 2}
    assert [r.invocation_type for r in lambda_endpoint.invocations] == ["RequestResponse"] * 4 + ["Event"]
    assert lambda_endpoint.invocations[1].qualifier == "$LATEST"


@pytest.mark.slow
def test_moto_image_functions_resolve_to_their_build_contexts(code_dir: Path) -> None:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = dict(endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                       aws_access_key_id=ACCESS_KEY_ID, aws_secret_access_key=SECRET)
        # moto checks that the execution role exists in its IAM; it needs no ECR image
        # (MOTO_LAMBDA_STUB_ECR defaults to true)
        role = boto3.client("iam", **options).create_role(
            RoleName="flatpack-stage", AssumeRolePolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}]}))
        control = boto3.client("lambda", **options)
        image = f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/flatpack:stage0"
        control.create_function(FunctionName="stage-0", PackageType="Image", Code={"ImageUri": image},
                                Role=role["Role"]["Arn"], MemorySize=512, Timeout=30,
                                Environment={"Variables": {"STAGE_INDEX": "0"}})
        resolve = moto_resolver(control, {"flatpack:stage0": code_dir})
        assert resolve("missing") is None
        code = resolve("stage-0")
        assert code is not None
        assert (code.directory, code.handler, code.memory_mb, code.timeout_s) == (code_dir, "handler.handler", 512, 30)
        assert dict(code.environment) == {"STAGE_INDEX": "0"}

        with LocalLambdaEndpoint(resolve) as endpoint:
            response = _lambda_client(endpoint.url).invoke(FunctionName="stage-0", Payload=b"{}")
        body = json.loads(response["Payload"].read())
        assert body["env"]["STAGE_INDEX"] == "0" and body["memory_limit_in_mb"] == "512"
    finally:
        server.stop()


# --- the FC stand-in ---------------------------------------------------------------------------

def _fc_client(port: int, secret: str = SECRET):
    from alibabacloud_fc20230330.client import Client
    from alibabacloud_tea_openapi.models import Config

    return Client(Config(access_key_id=ACCESS_KEY_ID, access_key_secret=secret, endpoint=f"127.0.0.1:{port}",
                         protocol="http", region_id="cn-hangzhou"))


@pytest.mark.slow
def test_fc_function_lifecycle_and_invoke_through_the_sdk(code_dir: Path) -> None:
    from alibabacloud_fc20230330 import models
    from darabonba.runtime import RuntimeOptions
    from Tea.exceptions import TeaException

    image = "registry.cn-hangzhou.aliyuncs.com/flatpack/flatpack:stage0"
    fc = LocalFunctionCompute(context_resolver({"flatpack:stage0": code_dir}), access_keys={ACCESS_KEY_ID: SECRET})
    with fc:
        client = _fc_client(fc.port)
        created = client.create_function(models.CreateFunctionRequest(body=models.CreateFunctionInput(
            function_name="stage-0", runtime="custom-container", handler="handler.handler", memory_size=512,
            timeout=30, role=f"acs:ram::{ACCOUNT}:role/flatpack", environment_variables={"STAGE_INDEX": "0"},
            custom_container_config=models.CustomContainerConfig(image=image)))).body
        assert created.function_arn == f"acs:fc:cn-hangzhou:{ACCOUNT}:functions/stage-0" and created.state == "Active"
        assert client.get_function("stage-0", models.GetFunctionRequest()).body.memory_size == 512
        updated = client.update_function("stage-0", models.UpdateFunctionRequest(
            body=models.UpdateFunctionInput(memory_size=1024)))
        assert updated.body.memory_size == 1024
        listed = client.list_functions(models.ListFunctionsRequest(prefix="stage")).body.functions
        assert [f.function_name for f in listed] == ["stage-0"]

        response = client.invoke_function("stage-0", models.InvokeFunctionRequest(body=io.BytesIO(b'{"x": 1}')))
        assert response.headers is not None and response.body is not None
        assert response.status_code == 200 and ERROR_TYPE_HEADER not in response.headers
        body = json.loads(response.body.read())
        assert body["event"] == {"x": 1}
        assert body["env"]["STAGE_INDEX"] == "0" and body["env"]["FC_FUNCTION_MEMORY_SIZE"] == "1024"

        failed = client.invoke_function_with_options(
            "stage-0", models.InvokeFunctionRequest(body=io.BytesIO(b'{"action": "raise"}')),
            models.InvokeFunctionHeaders(x_fc_log_type="Tail"), RuntimeOptions())
        assert failed.headers is not None and failed.body is not None
        assert failed.status_code == 200 and failed.headers[ERROR_TYPE_HEADER] == UNHANDLED_ERROR
        assert json.loads(failed.body.read())["errorMessage"] == "boom"
        assert "FC Invoke Start" in base64.b64decode(failed.headers["x-fc-log-result"]).decode()

        queued = client.invoke_function_with_options(
            "stage-0", models.InvokeFunctionRequest(body=io.BytesIO(b'{"y": 2}')),
            models.InvokeFunctionHeaders(x_fc_invocation_type="Async"), RuntimeOptions())
        assert queued.status_code == 202
        assert fc.wait_for_events(timeout_s=10)
        assert [(r.invocation_type, r.status) for r in fc.invocations] == [("Sync", 200), ("Sync", 200), ("Async", 202)]

        with pytest.raises(TeaException) as exists:
            client.create_function(models.CreateFunctionRequest(body=models.CreateFunctionInput(
                function_name="stage-0", runtime="custom-container", handler="handler.handler",
                custom_container_config=models.CustomContainerConfig(image=image))))
        assert exists.value.code == "FunctionAlreadyExists"
        assert client.delete_function("stage-0").status_code == 204
        with pytest.raises(TeaException) as missing:
            client.get_function("stage-0", models.GetFunctionRequest())
        assert missing.value.code == "FunctionNotFound"
        with pytest.raises(TeaException) as forged:
            _fc_client(fc.port, secret="not-the-secret").list_functions(models.ListFunctionsRequest(prefix="a b~"))
        assert forged.value.code == "SignatureNotMatch"

    create = fc.requests[0]
    assert (create.method, create.path) == ("POST", "/2023-03-30/functions")
    assert create.headers["host"] == f"127.0.0.1:{fc.port}"  # the endpoint as given: no account id in the host
    assert create.headers["authorization"].startswith(f"ACS3-HMAC-SHA256 Credential={ACCESS_KEY_ID},")
    sent = create.json()
    assert sent["functionName"] == "stage-0" and sent["runtime"] == "custom-container"
    assert sent["memorySize"] == 512 and sent["timeout"] == 30 and sent["handler"] == "handler.handler"
    assert sent["customContainerConfig"] == {"image": image}
    assert sent["environmentVariables"] == {"STAGE_INDEX": "0"}
    invoke = fc.requests[4]
    assert (invoke.path, invoke.body) == ("/2023-03-30/functions/stage-0/invocations", b'{"x": 1}')
    assert fc.requests[6].headers["x-fc-invocation-type"] == "Async"


def test_fc_rejects_unsigned_requests() -> None:
    import urllib.error
    import urllib.request

    with LocalFunctionCompute(lambda function: None) as fc:
        with pytest.raises(urllib.error.HTTPError) as unsigned:
            urllib.request.urlopen(f"{fc.url}/2023-03-30/functions")
    assert unsigned.value.code == 400
    assert json.loads(unsigned.value.read())["Code"] == "MissingRequiredHeader"


@pytest.mark.parametrize("limit", ["ten", "0"])
def test_fc_answers_a_bad_list_limit_as_the_callers_error(limit: str) -> None:
    import urllib.error
    import urllib.request

    # without access keys the stand-in takes any signed-looking request
    signed = {"Authorization": f"ACS3-HMAC-SHA256 Credential={ACCESS_KEY_ID},SignedHeaders=host,Signature=00"}
    with LocalFunctionCompute(lambda function: None) as fc:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{fc.url}/2023-03-30/functions?limit={limit}",
                                                          headers=signed))
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["Code"] == "InvalidArgument"
