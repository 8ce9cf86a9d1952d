"""The aws-lambda deployment's serving endpoint on local stand-ins: moto creates the serving
master, its function URL and its role, whose policy documents are checked action by action
and resource by resource; our Lambda Invoke endpoint runs the serving master on a function-URL
event, which runs the fork-join functions through the same Invoke API, and the answer equals
the model. The public variant (auth NONE) warns and is written with its permission."""

from __future__ import annotations

import base64
import json
import logging

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from flatpack.backends import aws_lambda, lambda_endpoint
from flatpack.backends.lambda_endpoint import Endpoint, PublicEndpointWarning
from flatpack.partitioner.cost.gillis import ForkJoinPlan
from flatpack.platform.catalog import LAMBDA_PROVISIONED_PRICE_PER_GB_S
from tests.standins.lambda_api import LocalLambdaEndpoint, moto_resolver

from .conftest import ecr_push
from .test_local_training import BATCH, compiled_with, make_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiled():
    # stage 0 is a group split over two partitions, stage 1 runs on the master
    return compiled_with(make_model(), [(0, 50), (50, 100)], [2, 1], 1, memory_mb=1024)


@pytest.fixture
def served(moto_server, compiled, tmp_path, monkeypatch):
    """A deployment with its serving endpoint, and the Invoke endpoint that runs its functions."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")       # what Lambda gives a function from its role
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    session = moto_server.session()
    contexts: dict[str, str] = {}
    invoke = LocalLambdaEndpoint(moto_resolver(session.client("lambda", endpoint_url=moto_server.url), contexts))
    invoke.start()
    deployment = aws_lambda.deploy(compiled, region="us-east-1", session=session, out=tmp_path,
                                   endpoint_urls=moto_server.endpoints(**{"lambda-invoke": invoke.url}),
                                   push=ecr_push(session, moto_server.url), tls_only=False, endpoint=Endpoint())
    for image in deployment.ledger.details["images"].values():
        contexts[image["uri"]] = str(tmp_path / image["context"])
    try:
        yield deployment, invoke, session
    finally:
        deployment.teardown()
        invoke.stop()


def url_event(method: str, path: str, body: dict | None = None) -> dict:
    """A function URL's request as Lambda hands it to the function (payload format 2.0)."""
    return {"version": "2.0", "rawPath": path, "headers": {"content-type": "application/json"},
            "requestContext": {"http": {"method": method, "path": path}}, "isBase64Encoded": False,
            "body": json.dumps(body) if body is not None else ""}


def test_the_endpoint_is_least_privilege_iam_behind_a_url_and_answers_as_the_model(served, moto_server):
    deployment, invoke, session = served
    res, endpoint = deployment.resources, deployment.resources["endpoint"]
    url = moto_server.url
    iam, control = session.client("iam", endpoint_url=url), session.client("lambda", endpoint_url=url)
    bucket, run, account = res["bucket"], res["run"], res["account"]
    stage_arns = [function["arn"] for function in res["functions"]]

    # the serving master's role: invoking the stage functions it starts, its sessions' objects, its logs
    policy = iam.get_role_policy(RoleName=endpoint["role"], PolicyName=endpoint["policy"])["PolicyDocument"]
    log_group = f"arn:aws:logs:us-east-1:{account}:log-group:/aws/lambda/{res['name']}-serve"
    assert policy["Statement"] == [
        {"Sid": "InvokeStageFunctions", "Effect": "Allow", "Action": "lambda:InvokeFunction",
         "Resource": [stage_arns[0]]},       # stage 1 has no workers: the master runs it
        {"Sid": "SessionObjects", "Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"],
         "Resource": f"arn:aws:s3:::{bucket}/{run}-serve-*"},
        {"Sid": "ServeSpec", "Effect": "Allow", "Action": "s3:GetObject",
         "Resource": f"arn:aws:s3:::{bucket}/{run}/spec/serve"},
        {"Sid": "ListSessions", "Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}",
         "Condition": {"StringLike": {"s3:prefix": [f"{run}-serve-*"]}}},
        {"Sid": "OwnLogs", "Effect": "Allow",
         "Action": ["logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents"],
         "Resource": [log_group, f"{log_group}:*"]}]
    trust = iam.get_role(RoleName=endpoint["role"])["Role"]["AssumeRolePolicyDocument"]
    assert trust["Statement"] == [{"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"},
                                   "Action": "sts:AssumeRole"}]
    # the stage functions may reach the sessions' objects too, and nothing more than before
    stage = iam.get_role_policy(RoleName=res["role"], PolicyName=res["policy"])["PolicyDocument"]
    objects = {statement["Sid"]: statement for statement in stage["Statement"]}["RunObjects"]
    assert objects["Resource"] == [f"arn:aws:s3:::{bucket}/{run}/*", f"arn:aws:s3:::{bucket}/{run}-serve-*"]

    # the function URL: IAM-authenticated, on the serving master, with no public permission
    configuration = control.get_function_url_config(FunctionName=endpoint["function"])
    assert configuration["AuthType"] == "AWS_IAM" and configuration["FunctionUrl"] == endpoint["url"]
    with pytest.raises(control.exceptions.ResourceNotFoundException):
        control.get_policy(FunctionName=endpoint["function"])
    serving = control.get_function(FunctionName=endpoint["function"])["Configuration"]
    assert serving["Role"] == endpoint["role_arn"] and serving["MemorySize"] == lambda_endpoint.DEFAULT_MEMORY_MB

    # a request as the URL hands it over: the serving master runs it through the fork-join functions
    model = make_model().eval()
    x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(3))
    client = session.client("lambda", endpoint_url=invoke.url)
    answer = client.invoke(FunctionName=endpoint["function"],
                           Payload=json.dumps(url_event("POST", "/v1/predict", {"inputs": {"x": x.tolist()}})))
    response = json.loads(answer["Payload"].read())
    assert response["statusCode"] == 200, response
    assert response["headers"]["x-flatpack-digest"] == deployment.compiled.digest
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(json.loads(response["body"])["outputs"]["output"]), model(x))
    # the same request as a safetensors file, base64 in the event as a function URL passes binary
    # bodies, answered in kind
    binary = {**url_event("POST", "/v1/predict"), "headers": {"content-type": "application/safetensors"},
              "body": base64.b64encode(save_safetensors({"x": x})).decode(), "isBase64Encoded": True}
    answer = client.invoke(FunctionName=endpoint["function"], Payload=json.dumps(binary))
    response = json.loads(answer["Payload"].read())
    assert response["statusCode"] == 200 and response["isBase64Encoded"], response
    assert response["headers"]["content-type"] == "application/safetensors"
    with torch.no_grad():
        torch.testing.assert_close(load_safetensors(base64.b64decode(response["body"]))["output"], model(x))
    invoke.wait_for_events(120)
    # the serving master, and for each of the two requests one session: the master and each of
    # group 0's workers, all invocations of stage 0's function, all ended by the session's stop message
    workers = sum(group.workers for group in ForkJoinPlan.from_plan(deployment.compiled.plan).groups)
    functions = sorted(record.function for record in invoke.invocations)
    assert functions == sorted([endpoint["function"]] * 2 + [res["functions"][0]["name"]] * (2 * (1 + workers)))
    assert all(record.result is not None and not record.result.failed for record in invoke.invocations)


def test_the_serving_master_answers_health_and_refuses_bad_requests_before_any_function(compiled, monkeypatch):
    """In process, with no store and no function to reach: what it answers without them. It
    checks a request as ``flatpack serve`` does (``runtime.request_tensors``, the contract the
    deploy wrote): a wrong shape, too few samples for the plan's batch split or more than the
    endpoint's cap is a 4xx here, not a 500 from a stage worker."""
    from flatpack.runtime import url_handler

    contract = compiled.request_contract()
    assert contract.min_samples == 2            # stage 0 is split by batch over two partitions
    monkeypatch.setenv(url_handler.SERVE_ENV, json.dumps({"spec": "run/spec/serve", "digest": "d" * 64,
                                                          "functions": {}, "contract": contract.dumps(),
                                                          "max_samples": 4}))
    assert url_handler.handle(url_event("GET", "/healthz"))["statusCode"] == 200
    assert url_handler.handle(url_event("GET", "/v1/predict"))["statusCode"] == 404
    cases = [({"inputs": {"y": [[1.0] * 8] * 2}}, 422, "unknown input 'y'"), ([1, 2], 400, '{"inputs"'),
             ({"inputs": {"x": [[1.0] * 8, [1.0] * 7]}}, 422, "not a rectangular list"),
             ({"inputs": {"x": [[float("nan")] * 8] * 2}}, 400, "the request body"),
             ({"inputs": {"x": [[1.0] * 7] * 2}}, 422, "input 'x'"),
             ({"inputs": {"x": [[1.0] * 8]}}, 422, "at least 2"),
             ({"inputs": {"x": [[1.0] * 8] * 5}}, 413, "the limit is 4"),
             ({"inputs": {"x": [[True] * 8] * 2}}, 422, "booleans")]
    for body, status, message in cases:
        answer = url_handler.handle(url_event("POST", "/v1/predict", body))   # type: ignore[arg-type]
        assert answer["statusCode"] == status and message in json.loads(answer["body"])["error"], (body, answer)
    # nested past what Python's json recursion takes: refused as a bad body, not raised out of the handler
    nested = url_handler.handle({**url_event("POST", "/v1/predict"), "body": "[" * 5000 + "]" * 5000})
    assert nested["statusCode"] == 400 and "levels deep" in json.loads(nested["body"])["error"]
    # a form type (what curl -d sends) is named; no type at all is read as JSON
    form = url_handler.handle({**url_event("POST", "/v1/predict", {"inputs": {}}),
                               "headers": {"Content-Type": "application/x-www-form-urlencoded"}})
    assert form["statusCode"] == 415 and "application/safetensors" in json.loads(form["body"])["error"]
    untyped = url_handler.handle({**url_event("POST", "/v1/predict", {"inputs": {"x": [[1.0] * 7] * 2}}),
                                  "headers": {}})
    assert untyped["statusCode"] == 422
    bad_base64 = url_handler.handle({**url_event("POST", "/v1/predict"), "body": "%%%", "isBase64Encoded": True})
    assert bad_base64["statusCode"] == 400 and "base64" in json.loads(bad_base64["body"])["error"]


def test_the_endpoint_caps_requests_as_flatpack_serve_does():
    """The endpoint's default cap on a request's samples is ``flatpack serve``'s (the two
    constants live in two layers); a cap below 1 is refused."""
    from flatpack.serve.settings import DEFAULT_MAX_REQUEST_SAMPLES

    assert Endpoint().max_request_samples == DEFAULT_MAX_REQUEST_SAMPLES
    with pytest.raises(Exception, match="max_request_samples"):
        Endpoint(max_request_samples=0)


def test_a_public_endpoint_warns_and_the_bundle_prices_its_provisioned_concurrency(compiled):
    endpoint = Endpoint(auth="NONE", provisioned=2, memory_mb=2048)
    with pytest.warns(PublicEndpointWarning, match="anyone who finds the URL"):
        files = aws_lambda.package(compiled, name="fp-served", account="123456789012", endpoint=endpoint)
    record = json.loads(files["endpoint/endpoint.json"])
    hourly = 2 * 2 * LAMBDA_PROVISIONED_PRICE_PER_GB_S * 3600
    assert record["price"]["dollars_per_hour"] == pytest.approx(hourly)
    assert record["price"]["dollars_per_month"] == pytest.approx(hourly * 730)
    assert f"${hourly:.4f}/hour" in record["price_note"]
    commands = files["commands.sh"].decode()
    assert "put-provisioned-concurrency-config --region us-east-1 --function-name fp-served-serve --qualifier live " \
           "--provisioned-concurrent-executions 2" in commands
    assert "create-function-url-config --region us-east-1 --function-name fp-served-serve --qualifier live " \
           "--auth-type NONE" in commands
    assert "--principal '*' --function-url-auth-type NONE" in commands
    caller = json.loads(files["endpoint/caller-policy.json"])
    assert caller["Statement"] == [{
        "Sid": "CallServingEndpoint", "Effect": "Allow", "Action": "lambda:InvokeFunctionUrl",
        "Resource": "arn:aws:lambda:us-east-1:123456789012:function:fp-served-serve:live",
        "Condition": {"StringEquals": {"lambda:FunctionUrlAuthType": "AWS_IAM"}}}]
    assert lambda_endpoint.public_permission(record["resources"]) == {
        "FunctionName": "fp-served-serve", "StatementId": "FunctionURLAllowPublicAccess",
        "Action": "lambda:InvokeFunctionUrl", "Principal": "*", "FunctionUrlAuthType": "NONE", "Qualifier": "live"}
    with pytest.raises(Exception, match="AWS_IAM \\(default\\) or NONE"):
        Endpoint(auth="PUBLIC")
