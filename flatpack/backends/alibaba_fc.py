"""The ``alibaba-fc`` backend: every stage is a Function Compute 3.0 function running a custom
container (the same handler Lambda runs, served by ``runtime.fc_server``), and the
functions share one private OSS bucket, reached through OSS's S3-compatible endpoint with
the same boto3 store the other backends use.

``deploy`` uses the ``alibabacloud-fc20230330`` SDK and the Alibaba Cloud default credential
chain (``alibabacloud_credentials``): checks before any API call (tiers within FC's range,
image sizes, names, region, credentials), the images built and pushed to Container
Registry (``docker``, or a ``push`` callable), the bucket, then one function per stage
with the stage's memory tier, a vCPU share within FC's 1:1-1:4 vCPU:GB range, the
execution role the user names (``role_arn``) and the store's address. Each created
resource goes into the ledger: a failure part-way rolls back, ``teardown`` removes it all.
"""

from __future__ import annotations

import difflib
import io
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from flatpack.backends import cloud
from flatpack.backends.functions import FUNCTION_CAPABILITIES
from flatpack.backends.results import TrainResult
from flatpack.backends.images import ImageContext, docker_build_and_push, function_images, image_of
from flatpack.backends.protocol import Capability
from flatpack.compiler import Compiled
from flatpack.errors import DeployError, InputError
from flatpack.platform.catalog import get_platform
from flatpack.runtime.function import Role
from flatpack.runtime.function_env import STORE_ENV
from flatpack.runtime.store import s3_addressing_style

__all__ = ["NAME", "CAPABILITIES", "LIMITS", "package", "deploy", "invoke", "teardown", "FcDeployment",
           "TrainResult"]

NAME = "alibaba-fc"
CAPABILITIES = FUNCTION_CAPABILITIES
LIMITS: dict[Capability, str] = {}   # a function backend offers every operation
PROFILE_FUNCTIONS = True         # deploy(profile_tiers=...) starts a profiler function per memory tier
API_VERSION = "2023-03-30"
TIMEOUT_S = 86400                # FC 3.0's longest execution; long enough that no run re-invokes itself
CONTAINER_PORT = 9000
# FC 3.0 regions (help.aliyun.com, "Endpoints" of the FC 2023-03-30 API); checked before any call
REGIONS = ("cn-hangzhou", "cn-shanghai", "cn-qingdao", "cn-beijing", "cn-zhangjiakou", "cn-huhehaote",
           "cn-wulanchabu", "cn-shenzhen", "cn-heyuan", "cn-guangzhou", "cn-chengdu", "cn-hongkong",
           "ap-southeast-1", "ap-southeast-3", "ap-southeast-5", "ap-southeast-7", "ap-northeast-1",
           "ap-northeast-2", "eu-central-1", "eu-west-1", "us-east-1", "us-west-1", "me-east-1",
           "me-central-1")
CREDENTIAL_CHAIN = ("environment variables ALIBABA_CLOUD_ACCESS_KEY_ID / ALIBABA_CLOUD_ACCESS_KEY_SECRET "
                    "(and ALIBABA_CLOUD_SECURITY_TOKEN)", "OIDC role (ALIBABA_CLOUD_ROLE_ARN, "
                    "ALIBABA_CLOUD_OIDC_PROVIDER_ARN, ALIBABA_CLOUD_OIDC_TOKEN_FILE)",
                    "the CLI profile file ~/.aliyun/config.json (ALIBABA_CLOUD_PROFILE)",
                    "the ECS instance RAM role (metadata service)",
                    "the credentials URI (ALIBABA_CLOUD_CREDENTIALS_URI)")

Push = Callable[[ImageContext, Path, str], None]


def vcpus_for(memory_mb: int) -> float:
    """The catalog's vCPU share for the tier, moved into FC's allowed range: a multiple of
    0.05 with vCPU:GB between 1:1 and 1:4."""
    memory_gb = memory_mb / 1024
    wanted = get_platform(NAME).tier(memory_mb).vcpus
    low, high = math.ceil(memory_gb / 4 / 0.05) * 0.05, math.floor(memory_gb / 0.05) * 0.05
    return round(min(max(wanted, low, 0.05), max(high, 0.05)), 2)


def resources(compiled: Compiled, name: str, region: str, account: str, *, bucket: str | None = None,
              namespace: str = "flatpack", role_arn: str | None = None, store_endpoint: str | None = None,
              profile_tiers: Sequence[int] | None = None) -> dict[str, Any]:
    bucket = bucket or cloud.default_bucket(name, account)
    endpoint = store_endpoint or f"https://s3.oss-{region}.aliyuncs.com"
    return {"name": name, "region": region, "account": account, "bucket": bucket, "run": name,
            "registry": f"registry.{region}.aliyuncs.com/{namespace}/{name}", "role_arn": role_arn,
            "store_url": f"s3://{bucket}/?region={region}&endpoint_url={endpoint}",
            "functions": [{**function, "cpu": vcpus_for(function["memory_mb"]), "timeout_s": TIMEOUT_S}
                          for function in cloud.functions(compiled, name, NAME, profile_tiers)]}


def ram_policy(res: dict[str, Any]) -> dict[str, Any]:
    """The least-privilege RAM policy for the functions' role: the run's objects in the
    deployment's bucket, and invoking only the deployment's own functions."""
    bucket, run, region, account = res["bucket"], res["run"], res["region"], res["account"]
    return {"Version": "1", "Statement": [
        {"Effect": "Allow", "Action": ["oss:GetObject", "oss:PutObject", "oss:DeleteObject"],
         "Resource": [f"acs:oss:*:*:{bucket}/{run}/*"]},
        {"Effect": "Allow", "Action": ["oss:ListObjects"], "Resource": [f"acs:oss:*:*:{bucket}"],
         "Condition": {"StringLike": {"oss:Prefix": [f"{run}/*"]}}},
        {"Effect": "Allow", "Action": ["fc:InvokeFunction"],
         "Resource": [f"acs:fc:{region}:{account}:functions/{f['name']}" for f in res["functions"]]},
    ]}


def oss_tls_only_policy(bucket: str) -> dict[str, Any]:
    """OSS's bucket policy refusing every request not made over HTTPS (``acs:SecureTransport``),
    to the bucket and its objects. With a Condition, a ``*`` principal includes the bucket's
    owner (OSS's rule): nobody reaches the bucket over plain HTTP."""
    return {"Version": "1", "Statement": [{
        "Effect": "Deny", "Principal": ["*"], "Action": ["oss:*"],
        "Resource": [f"acs:oss:*:*:{bucket}", f"acs:oss:*:*:{bucket}/*"],
        "Condition": {"Bool": {"acs:SecureTransport": ["false"]}}}]}


# OSS's native bodies (its S3-compatible endpoint has no encryption, policy or public access
# block operation: PutBucket, PutBucketACL, PutBucketLifecycle and PutBucketLogging only)
OSS_ENCRYPTION_XML = ('<?xml version="1.0" encoding="UTF-8"?>\n'
                      '<ServerSideEncryptionRule><ApplyServerSideEncryptionByDefault>'
                      '<SSEAlgorithm>AES256</SSEAlgorithm></ApplyServerSideEncryptionByDefault>'
                      '</ServerSideEncryptionRule>\n')
OSS_PUBLIC_ACCESS_BLOCK_XML = ('<?xml version="1.0" encoding="UTF-8"?>\n<PublicAccessBlockConfiguration>'
                               '<BlockPublicAccess>true</BlockPublicAccess></PublicAccessBlockConfiguration>\n')


def oss_api_endpoint(region: str) -> str:
    """OSS's own API endpoint of the region (HTTPS), beside the S3-compatible one."""
    return f"https://oss-{region}.aliyuncs.com"


def function_body(function: dict[str, Any], image_uri: str, res: dict[str, Any]) -> dict[str, Any]:
    """CreateFunction's body, as the FC API names the fields."""
    body = {"functionName": function["name"], "runtime": "custom-container", "handler": "handler.handler",
            "memorySize": function["memory_mb"], "cpu": function["cpu"], "timeout": function["timeout_s"],
            "diskSize": 512, "customContainerConfig": {"image": image_uri, "port": CONTAINER_PORT},
            "environmentVariables": {STORE_ENV: res["store_url"]},
            "description": cloud.describe_function(res["name"], function)}
    if res.get("role_arn"):
        body["role"] = res["role_arn"]
    return body


def package(compiled: Compiled, *, name: str | None = None, region: str = "cn-hangzhou",
            account: str = cloud.ACCOUNT_PLACEHOLDER, bucket: str | None = None, namespace: str = "flatpack",
            role_arn: str | None = None, base_image: str | None = None, lock: str | None = None) -> dict[str, bytes]:
    """Every file a deployment needs: ``images/<image>/`` build contexts, ``ram/policy.json``,
    ``s3/lifecycle.json``, ``oss/`` (the bucket's TLS-only policy, encryption and public access
    block), ``functions.json`` (each CreateFunction body) and ``commands.sh``."""
    name = name or cloud.deployment_name(compiled)
    cloud.check_name(name)
    res = resources(compiled, name, region, account, bucket=bucket, namespace=namespace, role_arn=role_arn)
    images = function_images(compiled, NAME, base=base_image, lock=lock)
    files: dict[str, bytes] = {}
    for image in images:
        files.update({f"images/{image.name}/{path}": data for path, data in image.files.items()})
    bodies = [function_body(f, f"{res['registry']}:{image_of(images, f['stage']).tag}", res) for f in res["functions"]]
    files["ram/policy.json"] = cloud.json_bytes(ram_policy(res))
    files["s3/lifecycle.json"] = cloud.json_bytes({"Rules": cloud.lifecycle_rules(res["run"])})
    files["oss/bucket-policy.json"] = cloud.json_bytes(oss_tls_only_policy(res["bucket"]))
    files["oss/encryption.xml"] = OSS_ENCRYPTION_XML.encode()
    files["oss/public-access-block.xml"] = OSS_PUBLIC_ACCESS_BLOCK_XML.encode()
    files["functions.json"] = cloud.json_bytes({"resources": res, "create_function": bodies})
    files["commands.sh"] = commands(compiled, res, images, bodies).encode()
    return files


def commands(compiled: Compiled, res: dict[str, Any], images: list[ImageContext], bodies: list[dict[str, Any]]) -> str:
    region, registry = res["region"], res["registry"].split("/")[0]
    lines = ["#!/usr/bin/env bash", f"# generated by flatpack: deployment {res['name']} of "
             f"{cloud.model_label(compiled)} on alibaba-fc ({region})", "set -euo pipefail", "",
             "# 1. images (Container Registry; the repository is created on first push)", *cloud.image_notes(images),
             f"docker login --username <ALIYUN_ACCOUNT> {registry}"]
    for image in images:
        uri = f"{res['registry']}:{image.tag}"
        lines += [f"docker build --platform linux/amd64 -t {uri} images/{image.name}", f"docker push {uri}"]
    s3, bucket = f"--endpoint-url https://s3.oss-{region}.aliyuncs.com", res["bucket"]
    lines += ["", "# 2. the bucket: private, HTTPS-only, encrypted (AES256), intermediate tensors expire.",
              "#    Created and given its lifecycle through OSS's S3-compatible endpoint; the rest is OSS's own API",
              "#    (the S3-compatible endpoint has no policy, encryption or public-access-block call): ossutil 2.x",
              f"aws s3api create-bucket {s3} --bucket {bucket} --acl private",
              f"ossutil api put-bucket-public-access-block --region {region} --bucket {bucket} "
              "--public-access-block-configuration file://oss/public-access-block.xml",
              f"ossutil api put-bucket-policy --region {region} --bucket {bucket} --body file://oss/bucket-policy.json",
              f"ossutil api put-bucket-encryption --region {region} --bucket {bucket} "
              "--server-side-encryption-rule file://oss/encryption.xml",
              f"aws s3api put-bucket-lifecycle-configuration {s3} --bucket {bucket} "
              "--lifecycle-configuration file://s3/lifecycle.json",
              "", "# 3. the functions' role: create a RAM role trusted by fc.aliyuncs.com with ram/policy.json "
              "attached, and pass its ARN as --role-arn", "", "# 4. one function per stage"]
    for body in bodies:
        lines.append(f"aliyun fc POST /{API_VERSION}/functions --region {region} --header "
                     f"\"Content-Type=application/json\" --body '{json.dumps(body)}'")
    lines += ["", "# flatpack records nothing of what these commands create: remove it by hand, or deploy "
              "without --dry-run so that flatpack teardown removes it", ""]
    return "\n".join(lines)


# checks before any API call ---------------------------------------------------------------------
def check_region(region: str | None) -> str:
    if not region:
        raise InputError("no Alibaba Cloud region: pass --region (region=...), or set ALIBABA_CLOUD_REGION_ID")
    if region not in REGIONS:
        close = difflib.get_close_matches(region, REGIONS, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise InputError(f"{region!r} is not a Function Compute 3.0 region.{hint} Nothing was deployed")
    return region


def credentials() -> Any:
    """The default chain's credential (access key id, secret, token); without one, the
    error lists the chain that was searched."""
    try:   # optional dependency: the Function Compute SDK (pip install 'flatpack[alibaba]')
        from alibabacloud_credentials.client import Client as CredentialClient
        import alibabacloud_fc20230330  # noqa: F401 - optional dependency too: checked here, used by the clients
    except ImportError:
        raise InputError("the alibaba-fc backend needs the Function Compute SDK: "
                         "pip install 'flatpack[alibaba]'. Nothing was deployed") from None

    try:
        client = CredentialClient(_environment_credentials())
        credential = client.get_credential()
        if not credential.get_access_key_id():
            raise ValueError("empty access key id")
    except Exception as err:  # noqa: BLE001 - the SDK raises plain exceptions for an empty chain
        raise DeployError(
            f"no Alibaba Cloud credentials found ({err}). The default chain searched, in order: "
            + "; ".join(CREDENTIAL_CHAIN) + ". Configure one: `aliyun configure`, or export "
            "ALIBABA_CLOUD_ACCESS_KEY_ID and ALIBABA_CLOUD_ACCESS_KEY_SECRET. Nothing was deployed") from None
    return client, credential


def _environment_credentials() -> Any:
    """The environment's key (ALIBABA_CLOUD_ACCESS_KEY_ID, _SECRET and SECURITY_TOKEN) as read
    now, or None for the default chain. The SDK's chain reads those variables once, when it is
    first imported: a process that imports it before setting them (a notebook, a test) would
    never see them."""
    # optional dependency: the Function Compute SDK (pip install 'flatpack[alibaba]')
    from alibabacloud_credentials.models import Config

    key_id = os.environ.get("ALIBABA_CLOUD_ACCESS_KEY_ID")
    secret = os.environ.get("ALIBABA_CLOUD_ACCESS_KEY_SECRET")
    if not key_id or not secret:
        return None
    token = os.environ.get("ALIBABA_CLOUD_SECURITY_TOKEN")
    if token:
        return Config(type="sts", access_key_id=key_id, access_key_secret=secret, security_token=token)
    return Config(type="access_key", access_key_id=key_id, access_key_secret=secret)


def _fc_client(credential_client: Any, region: str, account: str, endpoint: str | None) -> Any:
    # optional dependency: the Function Compute SDK (pip install 'flatpack[alibaba]')
    from alibabacloud_fc20230330.client import Client
    from alibabacloud_tea_openapi.models import Config

    if endpoint:
        host, protocol = endpoint.split("://", 1)[1], endpoint.split("://", 1)[0]
    else:
        host, protocol = f"{account}.{region}.fc.aliyuncs.com", "https"
    return Client(Config(credential=credential_client, endpoint=host, protocol=protocol, region_id=region,
                         read_timeout=TIMEOUT_S * 1000, connect_timeout=10_000))


def _s3_client(credential: Any, region: str, endpoint: str) -> Any:
    # start-up time: boto3 takes ~0.2 s to load, and only calls that reach the cloud need it
    import boto3
    from botocore.config import Config

    return boto3.client("s3", region_name=region, endpoint_url=endpoint,
                        aws_access_key_id=credential.get_access_key_id(),
                        aws_secret_access_key=credential.get_access_key_secret(),
                        aws_session_token=credential.get_security_token() or None,
                        config=Config(s3={"addressing_style": s3_addressing_style(endpoint)},
                                      retries={"mode": "standard", "max_attempts": 5}))


# deploy -----------------------------------------------------------------------------------------
def deploy(compiled: Compiled, *, region: str | None = None, account: str | None = None, name: str | None = None,
           bucket: str | None = None, namespace: str = "flatpack", role_arn: str | None = None,
           endpoint_urls: dict[str, str] | None = None, push: Push | None = None,
           out: str | os.PathLike | None = None, workdir: str | os.PathLike | None = None,
           profile_tiers: Sequence[int] | None = None, base_image: str | None = None,
           lock: str | None = None, digest: str | None = None) -> FcDeployment:
    """Creates the deployment and returns it. ``account``: the Alibaba Cloud account id (FC's
    endpoint is ``<account>.<region>.fc.aliyuncs.com``); ``role_arn``: the RAM role the
    functions run as (``ram/policy.json`` in the package is its least-privilege policy).
    ``endpoint_urls``: ``{"fc": ..., "oss": ...}`` to point at other endpoints (the tests'
    stand-ins; ``"oss-api"``: OSS's own API, which sets the bucket's policy, encryption and public
    access block). ``profile_tiers``: a profiler function per memory tier instead of one per stage.
    ``digest``: refuse, before any API call, unless ``compiled.digest`` is this."""
    endpoint_urls = dict(endpoint_urls or {})
    region, account, (credential_client, credential) = check_access(region=region, account=account)
    name, images = cloud.preflight(compiled, NAME, name, bucket, profile_tiers, base_image, lock, digest)
    if not role_arn:
        raise InputError("alibaba-fc functions reach the OSS bucket with their execution role's credentials: pass "
                         "role_arn (--role-arn), a RAM role trusted by fc.aliyuncs.com with the policy of "
                         "`flatpack deploy --dry-run`'s ram/policy.json attached. Nothing was deployed")
    if push is None and shutil.which("docker") is None:
        raise InputError("deploying to alibaba-fc builds container images, and no `docker` is on PATH. Install Docker, "
                         "or run `flatpack deploy --dry-run --out DIR` and push with DIR/commands.sh. Nothing was "
                         "deployed")
    res = resources(compiled, name, region, account, bucket=bucket, namespace=namespace, role_arn=role_arn,
                    store_endpoint=endpoint_urls.get("oss"), profile_tiers=profile_tiers)
    cloud.check_bucket_name(res["bucket"])
    out_dir = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix=f"flatpack-{name}-"))
    ledger = cloud.Ledger(NAME, name, region, details={"resources": res, "endpoint_urls": endpoint_urls})
    clients = _Clients(credential_client, credential, res, endpoint_urls)
    cloud.create_recorded(ledger, _deleters(clients),
                          lambda: _create(res, images, ledger, clients, out_dir,
                                          push or (lambda image, context, uri: docker_build_and_push(context, uri))),
                          out_dir, f"deploying {name} to alibaba-fc ({region})")
    return FcDeployment(compiled, res, ledger, clients, Path(workdir) if workdir else out_dir / "logs",
                        (credential.get_access_key_id(), credential.get_access_key_secret(),
                         credential.get_security_token()))


def check_access(*, region: str | None = None, account: str | None = None, **_: Any) -> tuple[str, str, Any]:
    """(region, account, (credential client, credential)) of a deployment, once the SDKs are
    installed, the region is one of FC 3.0's, the account is given and credentials are
    configured: what :func:`deploy` checks first, with no artifact needed, so ``flatpack
    deploy`` asks it before compiling the model. Other deploy options are accepted and ignored."""
    _require_oss2()
    region = check_region(region or os.environ.get("ALIBABA_CLOUD_REGION_ID"))
    account = account or os.environ.get("ALIBABA_CLOUD_ACCOUNT_ID")
    if not account:
        raise InputError("no Alibaba Cloud account id: pass --account (account=...) or set ALIBABA_CLOUD_ACCOUNT_ID; "
                         "FC's endpoint is <account>.<region>.fc.aliyuncs.com. Nothing was deployed")
    return region, account, credentials()


def _require_oss2() -> None:
    try:
        import oss2  # noqa: F401 - optional dependency: OSS's own API (pip install 'flatpack[oss]')
    except ImportError:
        raise InputError("alibaba-fc secures the OSS bucket (HTTPS-only policy, encryption, public access block) "
                         "through OSS's own API, which needs the oss2 SDK: pip install 'flatpack[oss]'. "
                         "Nothing was deployed") from None


def _oss_bucket(credential: Any, region: str, bucket: str, endpoint: str) -> Any:
    """oss2's client for the bucket's own API (signature V4, STS token when the chain gives one)."""
    import oss2   # optional dependency: OSS's own API (pip install 'flatpack[oss]')

    key, secret, token = (credential.get_access_key_id(), credential.get_access_key_secret(),
                          credential.get_security_token())
    auth = (oss2.StsAuth(key, secret, token, auth_version=oss2.AUTH_VERSION_4) if token
            else oss2.AuthV4(key, secret))
    return oss2.Bucket(auth, endpoint, bucket, region=region, connect_timeout=30)


def configure_oss_bucket(oss: Any) -> Callable[[Any, str, str], None]:
    """What makes an OSS bucket match the S3 one (``cloud.configure_bucket``): public access
    blocked, HTTPS-only, AES256 by default, intermediate tensors expiring. ``oss``: oss2's
    client of the bucket."""
    def configure(s3: Any, bucket: str, run: str) -> None:
        import oss2   # optional dependency: OSS's own API (pip install 'flatpack[oss]')

        # oss2 writes str(value) into the XML: "true" as OSS's API reference spells it, not Python's "True"
        oss.put_bucket_public_access_block("true")
        oss.put_bucket_policy(json.dumps(oss_tls_only_policy(bucket)))
        oss.put_bucket_encryption(oss2.models.ServerSideEncryptionRule(sse_algorithm="AES256"))
        # lifecycle: the S3-compatible endpoint supports it, and the rules are the S3 ones
        s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={
            "Rules": cloud.lifecycle_rules(run)})

    return configure


class _Clients:
    def __init__(self, credential_client: Any, credential: Any, res: dict[str, Any],
                 endpoint_urls: dict[str, str]) -> None:
        self.credential = credential
        self.fc = _fc_client(credential_client, res["region"], res["account"], endpoint_urls.get("fc"))
        self.s3 = _s3_client(credential, res["region"], res["store_url"].split("endpoint_url=", 1)[1])
        self.oss_api = endpoint_urls.get("oss-api") or oss_api_endpoint(res["region"])
        self.res = res

    def oss(self) -> Any:
        return _oss_bucket(self.credential, self.res["region"], self.res["bucket"], self.oss_api)


def _create(res: dict[str, Any], images: list[ImageContext], ledger: cloud.Ledger, clients: _Clients,
            out_dir: Path, push: Push) -> None:
    # optional dependency: the Function Compute SDK (pip install 'flatpack[alibaba]')
    from alibabacloud_fc20230330 import models

    uris = cloud.push_images(images, res["registry"], out_dir, push, ledger)
    cloud.make_bucket(clients.s3, res, ledger, configure_oss_bucket(clients.oss()))

    for function in res["functions"]:
        body = function_body(function, uris[image_of(images, function["stage"]).name], res)
        clients.fc.create_function(models.CreateFunctionRequest(body=models.CreateFunctionInput().from_map(body)))
        ledger.add("function", function["name"])


def _deleters(clients: _Clients) -> dict[str, Callable[[dict[str, str]], None]]:
    def delete_function(entry: dict[str, str]) -> None:
        try:
            clients.fc.delete_function(entry["name"])
        except Exception as err:  # noqa: BLE001 - the SDK's TeaException carries FC's error code
            if getattr(err, "code", None) != "FunctionNotFound":
                raise

    return {"function": delete_function, "bucket": lambda e: cloud.delete_bucket(clients.s3, e["name"])}


def invoke(deployment: FcDeployment, role: Role) -> cloud.ThreadInvocation:
    """Invokes the role's function synchronously on a thread (FC's InvokeFunction)."""
    return deployment.launch(role)


def teardown(deployment: FcDeployment | str | os.PathLike) -> list[str]:
    """Removes everything the deployment created; a deployment record's directory works too.
    Images stay in Container Registry (flatpack did not create the repository)."""
    if isinstance(deployment, FcDeployment):
        return deployment.teardown()
    ledger = cloud.Ledger.load(deployment)
    credential_client, credential = credentials()
    clients = _Clients(credential_client, credential, ledger.details["resources"],
                       ledger.details.get("endpoint_urls", {}))
    return cloud.remove(ledger, _deleters(clients), Path(deployment))


class FcDeployment(cloud.CloudDeployment):
    """A deployment on Function Compute: each function a synchronous invocation of the stage's FC function."""

    platform = NAME

    def deleters(self) -> dict[str, Callable[[dict[str, str]], None]]:
        return _deleters(self.clients)

    def invoke_function(self, function: str, payload: bytes) -> tuple[bytes, str | None, bytes]:
        # optional dependency: the Function Compute SDK (pip install 'flatpack[alibaba]')
        from alibabacloud_fc20230330 import models
        from alibabacloud_tea_util.models import RuntimeOptions

        request = models.InvokeFunctionRequest(body=io.BytesIO(payload))
        headers = models.InvokeFunctionHeaders(x_fc_invocation_type="Sync")
        runtime = RuntimeOptions(read_timeout=TIMEOUT_S * 1000, connect_timeout=10_000, autoretry=False)
        response = self.clients.fc.invoke_function_with_options(function, request, headers, runtime)
        return response.body.read(), (response.headers or {}).get("x-fc-error-type"), b""


def backend() -> Any:
    """This module, as the backend registry hands it out."""
    return sys.modules[__name__]
