"""Which cloud region a command uses when none is given, and `flatpack profile --region`."""

from __future__ import annotations

import boto3
import pytest

from flatpack import cli
from flatpack.backends import aws_lambda, profiling


def test_aws_region_wins_over_the_default_region_and_the_profile(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-2")
    monkeypatch.delenv("AWS_REGION", raising=False)
    assert aws_lambda.default_region(boto3.Session()) == "eu-west-2"
    # boto3 itself ignores AWS_REGION; the AWS CLI v2 (and flatpack) prefer it
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    assert boto3.Session().region_name == "eu-west-2"
    assert aws_lambda.default_region(boto3.Session()) == "eu-west-3"


def test_profile_region_reaches_the_profiler_functions_deploy():
    deploy, scratch = profiling._default_deploy("aws-lambda", False, (1024, 2048), "eu-west-1")
    assert scratch is None
    assert deploy.keywords == {"profile_tiers": (1024, 2048), "region": "eu-west-1"}
    deploy, _ = profiling._default_deploy("aws-lambda", False, (1024,))
    assert "region" not in deploy.keywords


def test_profile_region_on_emulated_tiers_is_refused_before_anything_is_deployed(capsys, monkeypatch):
    monkeypatch.setattr(cli, "load_factory", lambda *a, **k: (None, None))
    assert cli.main(["profile", "mlp", "--target", "aws-lambda", "--emulate", "--region", "eu-west-1"]) == 2
    assert "Leave --region out" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["profile"])
def test_region_is_in_the_help(verb, capsys):
    with pytest.raises(SystemExit):
        cli.main([verb, "--help"])
    assert "--region" in capsys.readouterr().out
