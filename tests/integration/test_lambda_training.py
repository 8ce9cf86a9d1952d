"""Training through Lambda's Invoke API, end to end on local stand-ins: moto serves the control
plane (the deploy creates real resources there) and S3 (the functions' store); our Lambda
Invoke endpoint runs each invocation's handler from the generated image build context in a
subprocess, so boto3's ``invoke`` and the runtime copied into the image run unchanged. The
parameters must equal single-process training."""

from __future__ import annotations

import logging

import pytest
import torch

from flatpack.analysis.reference import train_single_process
from flatpack.backends import aws_lambda
from flatpack.backends.profiling import profile_in_target
from flatpack.partitioner.cost.gillis import ForkJoinPlan
from tests.standins.lambda_api import LocalLambdaEndpoint, moto_resolver

from .conftest import ecr_push
from .test_local_training import BATCH, assert_same_parameters, batches, compiled_with, make_model

pytestmark = pytest.mark.slow


@pytest.fixture
def lambda_deployment(moto_server, tmp_path, monkeypatch):
    """A two-stage deployment (stage 0 with two replicas) and the Invoke endpoint that runs it."""
    # what Lambda gives a function from its execution role; here moto's test credentials
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)   # moto logs every request
    session = moto_server.session()
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [2, 1], 4, memory_mb=1024)
    contexts: dict[str, str] = {}
    endpoint = LocalLambdaEndpoint(moto_resolver(session.client("lambda", endpoint_url=moto_server.url), contexts))
    endpoint.start()
    deployment = aws_lambda.deploy(compiled, region="us-east-1", session=session, out=tmp_path,
                                   endpoint_urls=moto_server.endpoints(**{"lambda-invoke": endpoint.url}),
                                   push=ecr_push(session, moto_server.url),
                                   # moto speaks plain HTTP and enforces the TLS-only bucket policy
                                   tls_only=False)
    for image in deployment.ledger.details["images"].values():
        contexts[image["uri"]] = str(tmp_path / image["context"])
    try:
        yield deployment, endpoint
    finally:
        deployment.teardown()
        endpoint.stop()


def test_training_through_the_invoke_api_equals_single_process(lambda_deployment):
    deployment, endpoint = lambda_deployment
    data = batches(2)
    optimizer = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
    reference, losses = train_single_process(make_model(), data, 2, optimizer=optimizer)
    result = deployment.train(data, iterations=2, optimizer=optimizer, timeout_s=300)
    assert_same_parameters(result, reference)
    assert result.losses == pytest.approx(losses, rel=1e-4, abs=1e-5)
    # each replica was one synchronous invocation of its stage's function
    invoked = sorted(record.function for record in endpoint.invocations)
    names = [function["name"] for function in deployment.resources["functions"]]
    assert invoked == sorted([names[0], names[0], names[1]])
    assert {record.invocation_type for record in endpoint.invocations} == {"RequestResponse"}


def test_fork_join_inference_through_the_invoke_api_equals_the_model(lambda_deployment):
    deployment, endpoint = lambda_deployment
    model = make_model().eval()
    for seed in range(2):
        x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(deployment.infer(x), model(x))
    deployment.stop_inference()
    # the master and one function per fork-join worker, each invoked once and kept warm for both requests
    groups = ForkJoinPlan.from_plan(deployment.compiled.plan).groups
    assert len(endpoint.invocations) == 1 + sum(group.workers for group in groups)
    assert all(record.result is not None and not record.result.failed for record in endpoint.invocations)


def test_in_target_profiling_deploys_a_profiler_function_per_tier(moto_server, tmp_path, monkeypatch):
    """``flatpack profile --target aws-lambda``'s path: a function per memory tier, each timing
    every layer inside Lambda (here the stand-in), and everything removed afterwards."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    session = moto_server.session()
    contexts: dict[str, str] = {}
    endpoint = LocalLambdaEndpoint(moto_resolver(session.client("lambda", endpoint_url=moto_server.url), contexts))
    endpoint.start()
    deployed = []

    def deploy(compiled):
        deployment = aws_lambda.deploy(compiled, region="us-east-1", session=session, out=tmp_path / "deploy",
                                       endpoint_urls=moto_server.endpoints(**{"lambda-invoke": endpoint.url}),
                                       push=ecr_push(session, moto_server.url), profile_tiers=(512, 1024),
                                       tls_only=False)   # moto: plain HTTP, and it enforces the TLS-only policy
        for image in deployment.ledger.details["images"].values():
            contexts[image["uri"]] = str(tmp_path / "deploy" / image["context"])
        deployed.append(deployment)
        return deployment

    before = sorted(f["FunctionName"] for f in session.client("lambda", endpoint_url=moto_server.url)
                    .list_functions()["Functions"])
    try:
        calibration = profile_in_target(make_model(), (torch.randn(BATCH, 8),), target="aws-lambda",
                                        tiers=(512, 1024), batch_sizes=(1, 2), repeats=1, deploy=deploy,
                                        out=tmp_path / "calibration.json")
    finally:
        endpoint.stop()
    assert calibration.platform == "aws-lambda" and calibration.tiers_mb == (512, 1024)
    assert calibration.provenance["cpu_share"] != "emulated"
    names = [function["name"] for function in deployed[0].resources["functions"]]
    assert names == [f"{deployed[0].resources['name']}-p00512", f"{deployed[0].resources['name']}-p01024"]
    assert sorted(record.function for record in endpoint.invocations) == names
    for index in range(len(calibration.layer_names)):
        seconds = calibration.seconds(index, 1024, 2)
        assert seconds is not None and all(part > 0 for part in seconds)
    after = sorted(f["FunctionName"] for f in session.client("lambda", endpoint_url=moto_server.url)
                   .list_functions()["Functions"])
    assert after == before and deployed[0].ledger.created == []


@pytest.mark.parametrize(("faults", "options", "reason"), [
    # the runtime dies under the handler (Runtime.ExitError): invoked again from the last checkpoint
    ([{"stage": 1, "replica": 0, "iteration": 1, "at": "backward", "action": "kill"}], {}, "lost"),
    # near the time limit the handler returns 75 and the invoker invokes the function again
    ([{"stage": s, "replica": 0, "iteration": 0, "at": "start", "action": "sleep", "seconds": 2.5} for s in (0, 1)],
     {"time_limit_s": 2.0}, "time limit"),
])
def test_a_lost_or_timed_out_invocation_is_invoked_again(lambda_deployment, faults, options, reason):
    deployment, endpoint = lambda_deployment
    data = batches(3)
    reference, _losses = train_single_process(make_model(), data, 3, optimizer="adam")
    result = deployment.train(data, iterations=3, optimizer="adam", faults=faults, timeout_s=300, **options)
    assert_same_parameters(result, reference)
    assert any(restart.reason == reason for restart in result.restarts)
    if reason == "lost":
        assert any(record.result is not None and record.result.error_type == "Runtime.ExitError"
                   for record in endpoint.invocations)
