"""``flatpack deploy`` and ``flatpack teardown`` on the command line: a dry run writes
everything and prints the commands; without credentials the error names the chain searched;
teardown removes what a deployment's record lists."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flatpack import cli
from flatpack.backends import aws_lambda, gpu_container, images

from .conftest import ecr_push
from .test_local_training import compiled_with, make_model

pytestmark = pytest.mark.slow


def image_contexts(out: Path) -> dict[str, dict[str, bytes]]:
    return {context.name: {path.relative_to(context).as_posix(): path.read_bytes()
                           for path in context.rglob("*") if path.is_file()}
            for context in sorted((out / "images").iterdir())}


@pytest.mark.parametrize(("target", "expected"), [
    ("aws-lambda", ["commands.sh", "functions.json", "iam/role-policy.json", "iam/trust-policy.json",
                    "s3/lifecycle.json"]),
    ("alibaba-fc", ["commands.sh", "functions.json", "ram/policy.json", "s3/lifecycle.json"]),
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
