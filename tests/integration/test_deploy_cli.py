"""``flatpack deploy`` and ``flatpack teardown`` on the command line: a dry run writes
everything and prints the commands; without credentials the error names the chain searched;
teardown removes what a deployment's record lists."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flatpack import cli
from flatpack.backends import aws_lambda, gpu_container, images
from flatpack.backends.lock import lock_problems

from .conftest import ecr_push
from .test_local_training import compiled_with, make_model

pytestmark = pytest.mark.slow


def image_contexts(out: Path) -> dict[str, dict[str, bytes]]:
    return {context.name: {path.relative_to(context).as_posix(): path.read_bytes()
                           for path in context.rglob("*") if path.is_file()}
            for context in sorted((out / "images").iterdir())}


@pytest.mark.parametrize(("target", "expected"), [
    ("aws-lambda", ["commands.sh", "functions.json", "iam/role-policy.json", "iam/trust-policy.json",
                    "s3/lifecycle.json", "s3/bucket-policy.json"]),
    ("alibaba-fc", ["commands.sh", "functions.json", "ram/policy.json", "s3/lifecycle.json", "oss/bucket-policy.json",
                    "oss/encryption.xml", "oss/public-access-block.xml"]),
    ("gpu-container", ["commands.sh", "Dockerfile", "launch.sh", "k8s/job.yaml", "run.json"]),
])
def test_a_dry_run_writes_the_deployment_and_prints_the_commands(target, expected, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["deploy", "mlp", "--target", target, "--dry-run", "--out", str(out), "--name", "fp-mlp-test"]) == 0
    printed = capsys.readouterr().out
    assert "dry run: nothing was created" in printed
    for path in expected:
        assert (out / path).is_file(), path
    if target == "gpu-container":
        gpu_container.check_package({path.relative_to(out).as_posix(): path.read_bytes()
                                     for path in out.rglob("*") if path.is_file()})
        assert "kubectl apply -f k8s/job.yaml" in printed
    else:
        contexts = image_contexts(out)
        assert contexts and all(images.check_context(files) == [] for files in contexts.values())
    assert "docker build" in printed and "docker push" in printed
    assert ("aws lambda create-function" in printed) == (target == "aws-lambda")
    assert ("aliyun fc POST /2023-03-30/functions" in printed) == (target == "alibaba-fc")
    assert not (out / "deployment.json").exists()        # nothing was deployed, so nothing to tear down
    assert_hardened(target, out)


def test_a_gpu_container_bundle_for_a_cpu_cluster_runs_gloo_with_an_executable_launcher(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["deploy", "mlp", "--target", "gpu-container", "--backend", "gloo", "--out", str(out),
                     "--name", "fp-mlp-cpu"]) == 0
    assert os.access(out / "launch.sh", os.X_OK)
    _, job, _ = gpu_container.parse_yaml_documents((out / "k8s/job.yaml").read_text())
    assert job["metadata"]["annotations"]["flatpack.io/backend"] == "gloo"
    limits = job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits and {"cpu", "memory"} <= set(limits)
    assert json.loads((out / "run.json").read_text())["backend"] == "gloo"
    capsys.readouterr()
    assert cli.main(["deploy", "mlp", "--target", "aws-lambda", "--backend", "gloo", "--dry-run",
                     "--out", str(tmp_path / "other")]) == 2
    assert "--backend chooses the gpu-container ranks' collective backend" in capsys.readouterr().err


def dockerfiles(target: str, out: Path) -> list[str]:
    if target == "gpu-container":
        return [(out / "Dockerfile").read_text()]
    return [(context / "Dockerfile").read_text() for context in sorted((out / "images").iterdir())]


def assert_hardened(target: str, out: Path) -> None:
    """The static check of issue 17 on a dry-run bundle: non-root user, digest-pinned bases,
    hashed requirements, pod security context, TLS-only and encrypted buckets with lifecycle rules."""
    for dockerfile in dockerfiles(target, out):
        instructions = [line for line in dockerfile.splitlines() if line.strip() and not line.startswith("#")]
        assert images.hardening_problems(instructions) == []
        assert re.search(r"^FROM \S+@sha256:[0-9a-f]{64}$", dockerfile, re.MULTILINE)
        assert re.search(r"^USER 10001:10001$", dockerfile, re.MULTILINE)
    requirements = ([out / "requirements.txt"] if target == "gpu-container"
                    else list(out.glob("images/*/requirements.txt")))
    assert requirements and all(lock_problems(path.read_text()) == [] for path in requirements)
    commands = (out / "commands.sh").read_text()
    if target == "gpu-container":
        _, job, policy = gpu_container.parse_yaml_documents((out / "k8s/job.yaml").read_text())
        pod = job["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        container = pod["containers"][0]["securityContext"]
        assert container["readOnlyRootFilesystem"] is True and container["allowPrivilegeEscalation"] is False
        assert container["capabilities"]["drop"] == ["ALL"]
        assert policy["kind"] == "NetworkPolicy" and sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"]
        return
    assert "docker buildx imagetools inspect" in commands and "--require-hashes" in commands
    lifecycle = json.loads((out / "s3/lifecycle.json").read_text())["Rules"]
    assert {rule["Filter"]["Prefix"].split("/")[1] for rule in lifecycle} >= {"act", "grad", "data"}
    if target == "aws-lambda":
        [deny] = json.loads((out / "s3/bucket-policy.json").read_text())["Statement"]
        assert deny["Effect"] == "Deny" and deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
        for call in ("put-public-access-block", "put-bucket-policy --bucket fp-mlp-test",
                     "put-bucket-encryption", "AES256", "put-bucket-lifecycle-configuration"):
            assert call in commands, call
    else:
        [deny] = json.loads((out / "oss/bucket-policy.json").read_text())["Statement"]
        assert deny["Effect"] == "Deny" and deny["Condition"] == {"Bool": {"acs:SecureTransport": ["false"]}}
        assert "<SSEAlgorithm>AES256</SSEAlgorithm>" in (out / "oss/encryption.xml").read_text()
        assert "<BlockPublicAccess>true</BlockPublicAccess>" in (out / "oss/public-access-block.xml").read_text()
        for call in ("create-bucket --endpoint-url https://s3.oss-", "--acl private", "put-bucket-public-access-block",
                     "file://oss/public-access-block.xml", "put-bucket-policy", "file://oss/bucket-policy.json",
                     "put-bucket-encryption", "file://oss/encryption.xml", "put-bucket-lifecycle-configuration"):
            assert call in commands, call


@pytest.mark.parametrize("target", ["aws-lambda", "alibaba-fc", "gpu-container"])
def test_a_dry_run_refuses_a_tag_only_base_and_an_unhashed_lock(target, tmp_path, capsys):
    arguments = ["deploy", "mlp", "--target", target, "--dry-run", "--name", "fp-mlp-test"]
    assert cli.main([*arguments, "--out", str(tmp_path / "a"), "--base-image", "python:3.12-slim"]) == 2
    assert "docker buildx imagetools inspect python:3.12-slim" in capsys.readouterr().err
    (tmp_path / "lock.txt").write_text("torch==2.13.0\nnumpy==2.4.6\n")
    assert cli.main([*arguments, "--out", str(tmp_path / "b"), "--lock", str(tmp_path / "lock.txt")]) == 2
    assert "torch==2.13.0 has no --hash" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


def test_deploy_refuses_the_local_target_and_a_used_directory(tmp_path, capsys):
    assert cli.main(["deploy", "mlp", "--target", "local", "--out", str(tmp_path / "a")]) == 2
    assert "flatpack run MODEL" in capsys.readouterr().err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("x")
    assert cli.main(["deploy", "mlp", "--target", "aws-lambda", "--dry-run", "--out", str(tmp_path / "used")]) == 2
    assert "is not empty" in capsys.readouterr().err


@pytest.mark.parametrize(("target", "flags", "expected"), [
    ("aws-lambda", ["--region", "us-east-1"], ["no AWS credentials found", "boto3 searched, in order: env",
                                               "aws configure"]),
    ("alibaba-fc", ["--region", "cn-hangzhou", "--account", "1234567890"],
     ["no Alibaba Cloud credentials found", "ALIBABA_CLOUD_ACCESS_KEY_ID", "aliyun configure"]),
])
def test_without_credentials_the_error_names_the_chain_and_the_fix(target, flags, expected, tmp_path):
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith(("AWS_", "ALIBABA_CLOUD_"))}
    environment.update(HOME=str(tmp_path), AWS_EC2_METADATA_DISABLED="true",
                       ALIBABA_CLOUD_ECS_METADATA_DISABLED="true")
    done = subprocess.run([sys.executable, "-m", "flatpack", "deploy", "mlp", "--target", target, *flags,
                           "--out", str(tmp_path / "out")], env=environment, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    for text in expected:
        assert text in done.stderr
    assert "Nothing was deployed" in done.stderr
    # said before the model is compiled (a large model's trace takes a minute)
    assert "compiled mlp" not in done.stdout + done.stderr


def test_teardown_removes_what_the_record_lists(moto_server, tmp_path, monkeypatch, capsys):
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    session = moto_server.session()
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], 2, memory_mb=512)
    deployment = aws_lambda.deploy(compiled, region="us-east-1", session=session, endpoint_urls=moto_server.endpoints(),
                                   push=ecr_push(session, moto_server.url), out=tmp_path)
    function = deployment.resources["functions"][0]["name"]
    assert cli.main(["teardown", str(tmp_path)]) == 0
    assert f"function {function}" in capsys.readouterr().out
    control = session.client("lambda", endpoint_url=moto_server.url)
    assert function not in [f["FunctionName"] for f in control.list_functions()["Functions"]]
    assert cli.main(["teardown", str(tmp_path)]) == 0
    assert "nothing left to remove" in capsys.readouterr().out
    assert cli.main(["teardown", str(tmp_path / "elsewhere")]) == 2
    assert "no deployment record" in capsys.readouterr().err


def test_a_dry_run_prints_json_with_the_plan_the_files_and_the_commands(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["deploy", "mlp", "--target", "aws-lambda", "--dry-run", "--out", str(out), "--name",
                     "fp-mlp-test", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["dry_run"] is True and document["created"] == [] and document["plan"]["stages"]
    assert all((out / path).is_file() for path in document["files"])
    assert "docker build" in document["commands"] and document["commands"] == (out / "commands.sh").read_text()


def test_a_dry_run_with_an_endpoint_writes_its_iam_and_prints_its_price(tmp_path, capsys):
    """``--endpoint AWS_IAM --provisioned-concurrency 1``: planned for inference, the serving
    master's role policy, callers' policy and URL in the bundle, the provisioned price in the
    JSON; --endpoint elsewhere than aws-lambda is refused."""
    from flatpack.backends.lambda_endpoint import DEFAULT_MEMORY_MB, price, Endpoint

    out = tmp_path / "out"
    assert cli.main(["deploy", "mlp", "--target", "aws-lambda", "--dry-run", "--out", str(out), "--name",
                     "fp-mlp-test", "--endpoint", "AWS_IAM", "--provisioned-concurrency", "1", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["endpoint_price"] == price(Endpoint(provisioned=1))
    assert document["endpoint_price"]["memory_mb"] == DEFAULT_MEMORY_MB
    for path in ("endpoint/role-policy.json", "endpoint/caller-policy.json", "endpoint/environment.json",
                 "endpoint/endpoint.json"):
        assert (out / path).is_file(), path
    assert "create-function-url-config --region us-east-1 --function-name fp-mlp-test-serve --qualifier live " \
           "--auth-type AWS_IAM" in document["commands"]
    assert "add-permission" not in document["commands"]
    assert cli.main(["deploy", "mlp", "--target", "alibaba-fc", "--dry-run", "--out", str(tmp_path / "fc"),
                     "--endpoint", "AWS_IAM"]) != 0
    assert "--endpoint exposes a serving master through a Lambda function URL" in capsys.readouterr().err
