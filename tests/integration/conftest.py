"""Fixtures for integration tests: real servers on 127.0.0.1 (SeaweedFS for S3, moto for the AWS
control planes)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import pytest

from flatpack.runtime.s3server import LocalS3Server
from flatpack.runtime.store import S3Store

if TYPE_CHECKING:
    import boto3


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LocalS3Server]:
    """One SeaweedFS server for the whole session (each start takes ~0.8 s of the test that waits)."""
    server = LocalS3Server()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_store(s3_server: LocalS3Server) -> Iterator[S3Store]:
    """An S3Store under a fresh prefix; everything under it is deleted afterwards."""
    prefix = f"test-{uuid.uuid4().hex}/"
    store = s3_server.store(prefix=prefix)
    try:
        yield store
    finally:
        store.close()
        with s3_server.store() as root:
            root.delete_prefix(prefix)


@dataclass
class Moto:
    """moto in server mode: the AWS control planes (S3, IAM, STS, ECR, Lambda) on 127.0.0.1."""

    url: str

    def session(self, **credentials: str) -> boto3.Session:
        import boto3

        return boto3.Session(aws_access_key_id=credentials.get("key", "testing"),
                             aws_secret_access_key=credentials.get("secret", "testing"), region_name="us-east-1")

    def endpoints(self, **extra: str) -> dict[str, str]:
        return {**{service: self.url for service in ("s3", "iam", "sts", "ecr", "lambda")}, **extra}

    def require_authentication(self, on: bool) -> None:
        """moto checks credentials against its own IAM from the next request on (or stops)."""
        import requests

        requests.post(f"{self.url}/moto-api/reset-auth", data=b"0" if on else b"1000000000", timeout=10)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[Moto]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield Moto(f"http://{host}:{port}")
    finally:
        server.stop()


def ecr_push(session: boto3.Session, url: str) -> Callable[..., None]:
    """What `docker push` does to the registry, without a Docker engine: the image's manifest
    is registered in ECR under its tag, so Lambda's control plane finds the image."""
    import json

    ecr = session.client("ecr", endpoint_url=url)
    pushed: list[str] = []

    def push(image, context, uri: str) -> None:
        repository, tag = uri.split("/", 1)[1].rsplit(":", 1)
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                    "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                               "digest": f"sha256:{image.tag:0<64}", "size": len(image.files["Dockerfile"])},
                    "layers": []}
        ecr.put_image(repositoryName=repository, imageManifest=json.dumps(manifest), imageTag=tag)
        pushed.append(uri)

    push.pushed = pushed  # type: ignore[attr-defined]
    return push
