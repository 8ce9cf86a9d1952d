"""The alibaba-fc backend with the real Function Compute 3.0 SDK against our local stand-in of
the FC API (which checks the SDK's request signatures and runs each invocation's handler from
the generated image build context), and moto's S3 standing in for OSS's S3-compatible
endpoint. Checks the requests the SDK sends, training equivalence, rollback and teardown."""

from __future__ import annotations

import http.server
import json
import logging
import threading
from typing import Iterator

import pytest

from flatpack.analysis.reference import train_single_process
from flatpack.backends import alibaba_fc
from flatpack.errors import DeployError, InputError
from tests.standins.fc_api import LocalFunctionCompute, context_resolver

from .test_local_training import assert_same_parameters, batches, compiled_with, make_model

pytestmark = pytest.mark.slow

KEY_ID, SECRET = "LTAI-flatpack-test", "test-secret"
ACCOUNT = "1234567890123456"


class OssApiRecorder:
    """Stands in for OSS's own bucket API (policy, encryption, public access block: the calls its
    S3-compatible endpoint lacks): records what oss2 sends and answers 200, as OSS does."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_PUT(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                recorder.requests.append(("PUT", self.path, dict(self.headers), body))
                self.send_response(200)
                self.send_header("x-oss-request-id", "flatpack-test")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def oss_api() -> Iterator[OssApiRecorder]:
    recorder = OssApiRecorder()
    try:
        yield recorder
    finally:
        recorder.close()


@pytest.fixture
def fc(moto_server, monkeypatch, oss_api):
    """The FC stand-in, checking signatures with the test access key, and the default
    credential chain finding that key in the environment."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_SECRET", SECRET)
    contexts: dict[str, str] = {}
    service = LocalFunctionCompute(context_resolver(contexts), access_keys={KEY_ID: SECRET})
    service.start()
    try:
        yield service, contexts, {"fc": service.url, "oss": moto_server.url, "oss-api": oss_api.url}
    finally:
        service.stop()


def deploy(compiled, fc, tmp_path, **options):
    _service, contexts, endpoints = fc
    deployment = alibaba_fc.deploy(compiled, region="cn-hangzhou", account=ACCOUNT, endpoint_urls=endpoints,
                                   push=lambda image, context, uri: contexts.__setitem__(uri, str(context)),
                                   role_arn=f"acs:ram::{ACCOUNT}:role/flatpack-fc", out=tmp_path, **options)
    return deployment


def test_deploy_train_and_teardown_through_the_fc_sdk(fc, oss_api, moto_server, tmp_path):
    service, _, _ = fc
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 2], 4, memory_mb=1024)
    deployment = deploy(compiled, fc, tmp_path)
    try:
        # the bucket through OSS's own API: public access blocked, HTTPS-only, AES256 (signed V4 with our key)
        bucket = deployment.resources["bucket"]
        sent = {path.split("?", 1)[1].rstrip("="): (headers, body) for _, path, headers, body in oss_api.requests}
        assert sorted(sent) == ["encryption", "policy", "publicAccessBlock"]
        assert all(path.startswith(f"/{bucket}/?") for _, path, _, _ in oss_api.requests)
        credential = f"OSS4-HMAC-SHA256 Credential={KEY_ID}/"
        assert all({k.lower(): v for k, v in headers.items()}["authorization"].startswith(credential)
                   for headers, _ in sent.values())
        assert b"<BlockPublicAccess>true</BlockPublicAccess>" in sent["publicAccessBlock"][1]
        assert b"<SSEAlgorithm>AES256</SSEAlgorithm>" in sent["encryption"][1]
        assert json.loads(sent["policy"][1]) == alibaba_fc.oss_tls_only_policy(bucket)
        [deny] = json.loads(sent["policy"][1])["Statement"]
        assert deny["Effect"] == "Deny" and deny["Condition"] == {"Bool": {"acs:SecureTransport": ["false"]}}
        # and through the S3-compatible endpoint (moto here): the lifecycle rule expiring run data
        s3 = moto_server.session().client("s3", endpoint_url=moto_server.url)
        rules = s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
        assert {rule["Filter"]["Prefix"] for rule in rules} >= {f"{deployment.resources['run']}/act/"}

        creates = [request.json() for request in service.requests
                   if request.method == "POST" and request.path == "/2023-03-30/functions"]
        assert [body["functionName"] for body in creates] == [f["name"] for f in deployment.resources["functions"]]
        for body in creates:
            assert body["runtime"] == "custom-container"
            assert body["memorySize"] == 1024 and 1 / 4 <= body["cpu"] <= 1.0
            assert body["customContainerConfig"]["image"].startswith("registry.cn-hangzhou.aliyuncs.com/flatpack/")
            assert body["customContainerConfig"]["port"] == alibaba_fc.CONTAINER_PORT
            assert body["environmentVariables"]["FLATPACK_STORE"].startswith(f"s3://{deployment.resources['bucket']}/")
            assert body["role"] == f"acs:ram::{ACCOUNT}:role/flatpack-fc"
        assert all(request.headers.get("authorization", "").startswith(f"ACS3-HMAC-SHA256 Credential={KEY_ID}")
                   for request in service.requests)

        data = batches(2)
        optimizer = {"name": "adam", "lr": 0.01}
        reference, losses = train_single_process(make_model(), data, 2, optimizer=optimizer)
        result = deployment.train(data, iterations=2, optimizer=optimizer, timeout_s=300)
        assert_same_parameters(result, reference)
        assert result.losses == pytest.approx(losses, rel=1e-4, abs=1e-5)
        assert len(service.invocations) == 3      # one synchronous invocation per stage replica
    finally:
        removed = deployment.teardown()
    assert service.functions == {}
    assert sorted(entry.split()[0] for entry in removed) == ["bucket", "function", "function"]


def test_a_failure_mid_deploy_rolls_back_only_what_it_created(fc, tmp_path):
    from alibabacloud_fc20230330 import models

    service, _, endpoints = fc
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], 2, memory_mb=512)
    name = "fp-clash-test"
    # a function of that name already exists (someone else's): the second CreateFunction fails
    credential_client, _ = alibaba_fc.credentials()
    client = alibaba_fc._fc_client(credential_client, "cn-hangzhou", ACCOUNT, endpoints["fc"])
    client.create_function(models.CreateFunctionRequest(body=models.CreateFunctionInput().from_map({
        "functionName": f"{name}-s001", "runtime": "custom-container", "memorySize": 512, "handler": "index.handler",
        "customContainerConfig": {"image": "registry.cn-hangzhou.aliyuncs.com/other/app:1"}})))
    with pytest.raises(DeployError) as failure:
        deploy(compiled, fc, tmp_path, name=name)
    assert "FunctionAlreadyExists" in str(failure.value) and "Nothing is left behind" in str(failure.value)
    assert sorted(failure.value.rolled_back) == [f"bucket {name}-{ACCOUNT}", f"function {name}-s000"]
    assert list(service.functions) == [f"{name}-s001"]      # not ours: left alone


def test_a_key_set_after_the_sdk_read_the_environment_is_found(monkeypatch):
    """The SDK's default chain reads the key's variables once, at its import; flatpack reads
    them when it deploys (a test, or a notebook, sets them after the import)."""
    from alibabacloud_credentials.utils import auth_util

    monkeypatch.setattr(auth_util, "environment_access_key_id", None)      # as imported without them
    monkeypatch.setattr(auth_util, "environment_access_key_secret", None)
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_SECRET", SECRET)
    monkeypatch.delenv("ALIBABA_CLOUD_SECURITY_TOKEN", raising=False)
    _client, credential = alibaba_fc.credentials()
    assert (credential.get_access_key_id(), credential.get_access_key_secret()) == (KEY_ID, SECRET)


def test_bad_input_fails_before_any_api_call(fc, tmp_path):
    service, _, _ = fc
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], 2, memory_mb=512)
    with pytest.raises(InputError, match="'cn-hangzou' is not a Function Compute 3.0 region. Did you mean cn-hangzhou"):
        alibaba_fc.deploy(compiled, region="cn-hangzou", account=ACCOUNT, push=lambda *a: None, out=tmp_path)
    with pytest.raises(InputError, match="bucket name 'Flat_Pack' is not valid"):
        alibaba_fc.deploy(compiled, region="cn-hangzhou", account=ACCOUNT, bucket="Flat_Pack", push=lambda *a: None)
    with pytest.raises(InputError, match="pass role_arn"):
        alibaba_fc.deploy(compiled, region="cn-hangzhou", account=ACCOUNT, push=lambda *a: None,
                          endpoint_urls=fc[2], out=tmp_path)
    assert service.requests == []


def test_without_oss2_the_deploy_stops_before_any_api_call(fc, tmp_path, monkeypatch):
    """The bucket's policy, encryption and public access block need OSS's own API (oss2)."""
    import sys

    service, _, _ = fc
    monkeypatch.setitem(sys.modules, "oss2", None)
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], 2, memory_mb=512)
    with pytest.raises(InputError, match=r"needs the oss2 SDK: pip install 'flatpack\[oss\]'"):
        deploy(compiled, fc, tmp_path)
    assert service.requests == []
