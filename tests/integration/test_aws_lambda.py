"""The aws-lambda backend against moto in server mode: the real boto3 calls create an ECR
repository, a private encrypted bucket with a lifecycle rule, a least-privilege role and a
function per stage; a failure part-way rolls back; teardown removes everything; bad input
fails before any API call. (Invocation runs through our Lambda Invoke stand-in:
test_lambda_training.py.)"""

from __future__ import annotations

import json
import re

import pytest
from botocore.exceptions import ClientError

from flatpack.backends import aws_lambda, cloud, images
from flatpack.errors import DeployError, InputError

from .conftest import ecr_push
from .test_local_training import compiled_with, make_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiled():
    return compiled_with(make_model(), [(0, 50), (50, 100)], [2, 1], 4, memory_mb=512)


def calls_made(session) -> list[str]:
    """Every AWS API operation the session's clients call from now on."""
    calls: list[str] = []
    session.events.register("before-call", lambda model, **_: calls.append(model.name))
    return calls


def account_state(session, url: str) -> dict[str, list[str]]:
    s3, iam = session.client("s3", endpoint_url=url), session.client("iam", endpoint_url=url)
    control, ecr = session.client("lambda", endpoint_url=url), session.client("ecr", endpoint_url=url)
    return {"buckets": sorted(b["Name"] for b in s3.list_buckets()["Buckets"] if b["Name"].startswith("fp-")),
            "roles": sorted(r["RoleName"] for r in iam.list_roles()["Roles"] if r["RoleName"].startswith("fp-")),
            "functions": sorted(f["FunctionName"] for f in control.list_functions()["Functions"]
                                if f["FunctionName"].startswith("fp-")),
            "repositories": sorted(r["repositoryName"] for r in ecr.describe_repositories()["repositories"]
                                   if r["repositoryName"].startswith("fp-"))}


def test_deploy_creates_least_privilege_resources_and_teardown_removes_them(moto_server, compiled, tmp_path):
    session = moto_server.session()
    before = account_state(session, moto_server.url)
    push = ecr_push(session, moto_server.url)
    deployment = aws_lambda.deploy(compiled, region="us-east-1", session=session,
                                   endpoint_urls=moto_server.endpoints(), push=push, out=tmp_path)
    res = deployment.resources
    url = moto_server.url
    s3, iam = session.client("s3", endpoint_url=url), session.client("iam", endpoint_url=url)
    control = session.client("lambda", endpoint_url=url)

    # one image for this small model, pushed once, shared by both stages' functions
    assert len(push.pushed) == 1
    assert images.check_context({p.relative_to(tmp_path / "images" / "stages-000-001").as_posix(): p.read_bytes()
                                 for p in (tmp_path / "images" / "stages-000-001").rglob("*") if p.is_file()}) == []

    # the bucket: private, TLS-only, encrypted, intermediate tensors expire
    block = s3.get_public_access_block(Bucket=res["bucket"])["PublicAccessBlockConfiguration"]
    assert all(block.values())
    [deny] = json.loads(s3.get_bucket_policy(Bucket=res["bucket"])["Policy"])["Statement"]
    assert deny["Effect"] == "Deny" and deny["Principal"] == "*" and deny["Action"] == "s3:*"
    assert deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert sorted(deny["Resource"]) == [f"arn:aws:s3:::{res['bucket']}", f"arn:aws:s3:::{res['bucket']}/*"]
    # moto evaluates it: an object write over plain HTTP (this endpoint) is refused, credentials or
    # not; without the policy the same write goes through (the policy is what refused it)
    key = f"{res['run']}/ckpt/stage_000"
    with pytest.raises(ClientError) as refused:
        s3.put_object(Bucket=res["bucket"], Key=key, Body=b"overwritten")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert deployment.ledger.details["tls_only"] is True
    s3.delete_bucket_policy(Bucket=res["bucket"])
    s3.put_object(Bucket=res["bucket"], Key=key, Body=b"written")
    s3.delete_object(Bucket=res["bucket"], Key=key)
    s3.put_bucket_policy(Bucket=res["bucket"], Policy=json.dumps(cloud.tls_only_policy(res["bucket"])))
    encryption = s3.get_bucket_encryption(Bucket=res["bucket"])["ServerSideEncryptionConfiguration"]
    assert encryption["Rules"][0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    rules = s3.get_bucket_lifecycle_configuration(Bucket=res["bucket"])["Rules"]
    expiring = {rule["Filter"]["Prefix"] for rule in rules if rule["Expiration"]["Days"] == 1}
    assert {f"{res['run']}/act/", f"{res['run']}/grad/", f"{res['run']}/data/"} <= expiring
    assert not any(prefix.startswith(f"{res['run']}/ckpt") for prefix in expiring)   # checkpoints stay

    # the role: assumed by Lambda only; its policy names only this run's prefix and these functions
    trust = iam.get_role(RoleName=res["role"])["Role"]["AssumeRolePolicyDocument"]
    assert trust["Statement"][0]["Principal"] == {"Service": "lambda.amazonaws.com"}
    policy = iam.get_role_policy(RoleName=res["role"], PolicyName=res["policy"])["PolicyDocument"]
    statements = {statement["Sid"]: statement for statement in policy["Statement"]}
    assert statements["RunObjects"]["Resource"] == f"arn:aws:s3:::{res['bucket']}/{res['run']}/*"
    assert statements["ListRunPrefix"]["Condition"] == {"StringLike": {"s3:prefix": [f"{res['run']}/*"]}}
    own = sorted(f["arn"] for f in res["functions"])
    assert sorted(statements["InvokeOwnFunctions"]["Resource"]) == own
    assert "*" not in json.dumps(statements["InvokeOwnFunctions"]) and "s3:*" not in json.dumps(policy)

    # a function per stage, with the stage's tier, Lambda's longest timeout and the store's address
    for function, stage in zip(res["functions"], compiled.plan.stages):
        configuration = control.get_function(FunctionName=function["name"])["Configuration"]
        assert configuration["MemorySize"] == stage.memory_mb
        assert configuration["Timeout"] == aws_lambda.TIMEOUT_S
        assert configuration["PackageType"] == "Image"
        assert configuration["Role"] == res["role_arn"]
        assert configuration["Environment"]["Variables"]["FLATPACK_STORE"].startswith(f"s3://{res['bucket']}/")

    record = json.loads((tmp_path / cloud.RECORD_FILE).read_text())
    assert {entry["kind"] for entry in record["created"]} == {"repository", "bucket", "role", "role-policy", "function"}

    removed = deployment.teardown()
    assert len(removed) == len(record["created"])
    assert account_state(session, moto_server.url) == before
    assert json.loads((tmp_path / cloud.RECORD_FILE).read_text())["created"] == []


def test_a_failure_mid_deploy_rolls_back_everything(moto_server, compiled, tmp_path):
    session = moto_server.session()
    before = account_state(session, moto_server.url)
    created = []

    def second_function_fails(params, **_):
        created.append(params["FunctionName"])
        if len(created) == 2:
            raise RuntimeError("injected: the second CreateFunction fails")

    session.events.register("before-parameter-build.lambda.CreateFunction", second_function_fails)
    with pytest.raises(DeployError) as failure:
        aws_lambda.deploy(compiled, region="us-east-1", session=session, endpoint_urls=moto_server.endpoints(),
                          push=ecr_push(session, moto_server.url), out=tmp_path)
    message = str(failure.value)
    assert "injected" in message and "Rolled back" in message and "Nothing is left behind" in message
    assert {entry.split()[0] for entry in failure.value.rolled_back} == {"function", "role-policy", "role", "bucket",
                                                                         "repository"}
    assert account_state(session, moto_server.url) == before


def test_teardown_from_the_record_in_another_process(moto_server, compiled, tmp_path):
    session = moto_server.session()
    before = account_state(session, moto_server.url)
    aws_lambda.deploy(compiled, region="us-east-1", session=session, endpoint_urls=moto_server.endpoints(),
                      push=ecr_push(session, moto_server.url), out=tmp_path)
    assert account_state(session, moto_server.url) != before
    removed = aws_lambda.teardown(tmp_path, session=session)
    assert any(entry.startswith("bucket ") for entry in removed)
    assert account_state(session, moto_server.url) == before
    assert aws_lambda.teardown(tmp_path, session=session) == []    # again: nothing left, no error


@pytest.mark.parametrize(("change", "expected"), [
    ({"memory_mb": 20480}, "asks for 20480 MB, but aws-lambda functions have 128-10240 MB"),
    ({"region": "us-east-9"}, "'us-east-9' is not an AWS region where Lambda runs. Did you mean us-east-2, us-east-1"),
    ({"bucket": "My_Bucket"}, "bucket name 'My_Bucket' is not valid"),
    ({"image_bytes": 11 << 30}, "over aws-lambda's 10 GB container image limit"),
])
def test_bad_input_fails_before_any_api_call(moto_server, compiled, tmp_path, monkeypatch, change, expected):
    session = moto_server.session()
    if "memory_mb" in change:
        compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], 2, memory_mb=change["memory_mb"])
    if "image_bytes" in change:
        monkeypatch.setattr(images, "runtime_dependency_bytes", lambda: change["image_bytes"])
    calls = calls_made(session)
    with pytest.raises(InputError, match=re.escape(expected)):
        aws_lambda.deploy(compiled, region=change.get("region", "us-east-1"), bucket=change.get("bucket"),
                          session=session, endpoint_urls=moto_server.endpoints(),
                          push=ecr_push(session, moto_server.url), out=tmp_path)
    assert calls == []
    assert not (tmp_path / "images").exists()


def test_deploy_refuses_another_artifacts_digest_before_any_call(moto_server, compiled, tmp_path):
    """deploy(digest=) pins the artifact: another one is refused before any API call or file."""
    from flatpack.errors import ArtifactError

    session = moto_server.session()
    calls = calls_made(session)
    with pytest.raises(ArtifactError, match="the artifact to deploy"):
        aws_lambda.deploy(compiled, region="us-east-1", session=session, endpoint_urls=moto_server.endpoints(),
                          push=ecr_push(session, moto_server.url), out=tmp_path, digest="0" * 64)
    assert calls == []
    assert not (tmp_path / "images").exists()


def test_missing_credentials_name_the_chain_searched(moto_server, compiled, tmp_path, monkeypatch):
    import boto3

    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    session = boto3.Session(region_name="us-east-1")
    with pytest.raises(DeployError) as failure:
        aws_lambda.deploy(compiled, session=session, endpoint_urls=moto_server.endpoints(), push=lambda *a: None,
                          out=tmp_path)
    message = str(failure.value)
    assert "no AWS credentials found" in message
    assert "env" in message and "shared-credentials-file" in message and "aws configure" in message


def test_wrong_credentials_are_refused_with_nothing_created(moto_server, compiled, tmp_path):
    session = moto_server.session(key="unknown-key-id", secret="unknown-secret")
    before = account_state(moto_server.session(), moto_server.url)
    moto_server.require_authentication(True)
    try:
        with pytest.raises(DeployError, match="AWS refused the credentials \\(InvalidClientTokenId"):
            aws_lambda.deploy(compiled, region="us-east-1", session=session, endpoint_urls=moto_server.endpoints(),
                              push=ecr_push(session, moto_server.url), out=tmp_path)
    finally:
        moto_server.require_authentication(False)
    assert account_state(moto_server.session(), moto_server.url) == before
