"""The ``aws-lambda`` backend: every stage is a Lambda function running a container image,
and the functions share one private S3 bucket.

``package`` writes what a deployment needs (image build contexts, the IAM policies, the
bucket's lifecycle rule, the function settings, and the commands that would create it all
by hand); ``deploy`` creates it with boto3 and the standard credential chain:

1. checks before any API call: tiers within Lambda's range, image sizes, names, region,
   credentials (and who they belong to: ``sts:GetCallerIdentity``, which creates nothing);
2. an ECR repository, and the images built and pushed (``docker``, or a ``push`` callable);
3. one S3 bucket per deployment: private, encrypted, intermediate tensors expire;
4. an IAM role whose policy allows only the run's prefix in that bucket, invoking only the
   deployment's own functions, and writing their logs;
5. one function per stage with the stage's memory tier, 900 s timeout and environment
   (replicas are concurrent invocations of it);
6. with ``endpoint=Endpoint(...)``: the serving master behind a function URL, its own
   least-privilege role, and provisioned concurrency when asked (``backends.lambda_endpoint``).

Each created resource goes into a ledger; a failure part-way rolls back what was created,
and ``teardown`` (or ``flatpack teardown DIR``) removes it all. ``LambdaDeployment.train``
and ``.infer`` are the local backend's (``backends.functions``) with functions invoked
through Lambda's Invoke API.
"""

from __future__ import annotations

import base64
import difflib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from flatpack import logs
from flatpack.backends import cloud, lambda_endpoint
from flatpack.backends.lambda_endpoint import Endpoint
from flatpack.backends.functions import FUNCTION_CAPABILITIES
from flatpack.backends.results import TrainResult
from flatpack.backends.images import ImageContext, docker_build_and_push, function_images, image_of
from flatpack.backends.protocol import Capability
from flatpack.compiler import Compiled
from flatpack.errors import DeployError, InputError
from flatpack.runtime.function import Role
from flatpack.runtime.function_env import STORE_ENV
from flatpack.partitioner.cost.gillis import ForkJoinPlan
from flatpack.runtime.store import s3_addressing_style

__all__ = ["NAME", "CAPABILITIES", "LIMITS", "package", "deploy", "invoke", "teardown", "LambdaDeployment",
           "TrainResult", "Endpoint"]

LOG = logs.get("deploy")
NAME = "aws-lambda"
CAPABILITIES = FUNCTION_CAPABILITIES
LIMITS: dict[Capability, str] = {}   # a function backend offers every operation
PROFILE_FUNCTIONS = True        # deploy(profile_tiers=...) starts a profiler function per memory tier
TIMEOUT_S = 900                 # Lambda's maximum; the runtime re-invokes itself before it
TIME_LIMIT_MARGIN_S = 60        # a function checkpoints and asks to be invoked again this early
ROLE_PROPAGATION_S = 60         # a new IAM role takes seconds before Lambda may assume it
INVOKE_SERVICE = "lambda-invoke"   # endpoint_urls key for the Invoke API when it differs from the control plane

Push = Callable[[ImageContext, Path, str], None]


# the resources a deployment consists of: pure data, computed before any API call -----------
def resources(compiled: Compiled, name: str, region: str, account: str, bucket: str | None = None,
              store_endpoint: str | None = None, profile_tiers: Sequence[int] | None = None,
              endpoint: Endpoint | None = None) -> dict[str, Any]:
    """Names, ARNs and settings of everything ``deploy`` creates (``endpoint``: the serving
    endpoint's too, under ``"endpoint"``)."""
    bucket = bucket or cloud.default_bucket(name, account)
    repository_uri = f"{account}.dkr.ecr.{region}.amazonaws.com/{name}"
    store_url = f"s3://{bucket}/?region={region}" + (f"&endpoint_url={store_endpoint}" if store_endpoint else "")
    functions = [{**function, "timeout_s": TIMEOUT_S,
                  "arn": f"arn:aws:lambda:{region}:{account}:function:{function['name']}"}
                 for function in cloud.functions(compiled, name, NAME, profile_tiers)]
    res = {"name": name, "region": region, "account": account, "bucket": bucket, "run": name,
           "repository": name, "repository_uri": repository_uri, "role": f"{name}-role",
           "role_arn": f"arn:aws:iam::{account}:role/{name}-role", "policy": f"{name}-policy",
           "store_url": store_url, "functions": functions}
    if endpoint is not None:
        res["endpoint"] = lambda_endpoint.resources(res, endpoint, fork_join_stages(compiled))
    return res


def fork_join_stages(compiled: Compiled) -> tuple[int, ...]:
    """The stages whose functions serve fork-join inference: the master's (0) and those of the
    groups with workers (a group's workers run its stage's function)."""
    groups = ForkJoinPlan.from_plan(compiled.plan).groups
    return tuple(sorted({0, *(index for index, group in enumerate(groups) if group.workers)}))


def lifecycle(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The bucket's rules: the run's intermediate tensors expire, and so do the serving
    master's sessions (requests and responses) when there is an endpoint."""
    rules = cloud.lifecycle_rules(res["run"])
    if "endpoint" in res:
        rules.append({"ID": "flatpack-expire-serve-sessions", "Status": "Enabled",
                      "Filter": {"Prefix": res["endpoint"]["sessions"]},
                      "Expiration": {"Days": cloud.INTERMEDIATE_EXPIRY_DAYS}})
    return rules


def trust_policy() -> dict[str, Any]:
    return {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}]}


def role_policy(res: dict[str, Any]) -> dict[str, Any]:
    """Least privilege: the run's objects in the deployment's bucket, listing only the run's
    prefix, invoking only the deployment's functions (fork-join masters invoke workers),
    and the functions' own log groups."""
    bucket, run, region, account = res["bucket"], res["run"], res["region"], res["account"]
    log_groups = [f"arn:aws:logs:{region}:{account}:log-group:/aws/lambda/{f['name']}" for f in res["functions"]]
    objects: str | list[str] = f"arn:aws:s3:::{bucket}/{run}/*"
    prefixes = [f"{run}/*"]
    if "endpoint" in res:       # the serving master's sessions run under prefixes of their own
        sessions = res["endpoint"]["sessions"]
        objects, prefixes = [f"arn:aws:s3:::{bucket}/{run}/*", f"arn:aws:s3:::{bucket}/{sessions}*"], \
            [f"{run}/*", f"{sessions}*"]
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "RunObjects", "Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
         "Resource": objects},
        {"Sid": "ListRunPrefix", "Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}",
         "Condition": {"StringLike": {"s3:prefix": prefixes}}},
        {"Sid": "InvokeOwnFunctions", "Effect": "Allow", "Action": "lambda:InvokeFunction",
         "Resource": [f["arn"] for f in res["functions"]]},
        {"Sid": "OwnLogs", "Effect": "Allow",
         "Action": ["logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents"],
         "Resource": log_groups + [f"{group}:*" for group in log_groups]},
    ]}


def package(compiled: Compiled, *, name: str | None = None, region: str = "us-east-1",
            account: str = cloud.ACCOUNT_PLACEHOLDER, bucket: str | None = None, base_image: str | None = None,
            lock: str | None = None, endpoint: Endpoint | None = None) -> dict[str, bytes]:
    """Every file a deployment needs, by path: ``images/<image>/`` build contexts, ``iam/``,
    ``s3/lifecycle.json``, ``s3/bucket-policy.json``, ``functions.json`` and ``commands.sh``
    (the same deployment by hand). ``base_image`` (``name:tag@sha256:...``) and ``lock`` (a
    hash-locked requirements text) replace the catalog's base and the committed lock.
    ``endpoint``: also the serving endpoint's files under ``endpoint/`` (its role policy, the
    callers' policy, its environment, and ``endpoint.json`` with the provisioned concurrency's
    price)."""
    name = name or cloud.deployment_name(compiled)
    cloud.check_name(name)
    if endpoint is not None:
        endpoint.warn_if_public()
    res = resources(compiled, name, region, account, bucket, endpoint=endpoint)
    images = function_images(compiled, NAME, base=base_image, lock=lock)
    files: dict[str, bytes] = {}
    for image in images:
        files.update({f"images/{image.name}/{path}": data for path, data in image.files.items()})
    files["iam/trust-policy.json"] = cloud.json_bytes(trust_policy())
    files["iam/role-policy.json"] = cloud.json_bytes(role_policy(res))
    files["s3/lifecycle.json"] = cloud.json_bytes({"Rules": lifecycle(res)})
    files["s3/bucket-policy.json"] = cloud.json_bytes(cloud.tls_only_policy(res["bucket"]))
    if endpoint is not None:
        files.update(endpoint_files(compiled, res, endpoint))
    files["functions.json"] = cloud.json_bytes({"resources": res, "images": [
        {"name": image.name, "tag": image.tag, "stages": list(image.stages), "estimated_bytes": image.estimated_bytes}
        for image in images]})
    files["commands.sh"] = commands(compiled, res, images).encode()
    return files


def commands(compiled: Compiled, res: dict[str, Any], images: list[ImageContext]) -> str:
    """The shell commands that create this deployment by hand (what ``deploy`` does with boto3)."""
    region, registry = res["region"], res["repository_uri"].split("/")[0]
    lines = ["#!/usr/bin/env bash",
             f"# generated by flatpack: deployment {res['name']} of {cloud.model_label(compiled)}"
             f" on aws-lambda ({region})", "set -euo pipefail", "", "# 1. images", *cloud.image_notes(images),
             f"aws ecr create-repository --region {region} --repository-name {res['repository']} "
             "--image-scanning-configuration scanOnPush=true",
             f"aws ecr get-login-password --region {region} | docker login --username AWS --password-stdin {registry}"]
    for image in images:
        uri = f"{res['repository_uri']}:{image.tag}"
        lines += [f"docker build --platform linux/amd64 --provenance=false -t {uri} images/{image.name}",
                  f"docker push {uri}"]
    bucket = res["bucket"]
    location = "" if region == "us-east-1" else f" --create-bucket-configuration LocationConstraint={region}"
    lines += ["", "# 2. the bucket: private, TLS-only, encrypted, intermediate tensors expire",
              f"aws s3api create-bucket --region {region} --bucket {bucket}{location}",
              f"aws s3api put-public-access-block --bucket {bucket} --public-access-block-configuration "
              "BlockPublicAcls=true,IgnorePublicAcls=true,BlockPublicPolicy=true,RestrictPublicBuckets=true",
              f"aws s3api put-bucket-policy --bucket {bucket} --policy file://s3/bucket-policy.json",
              f"aws s3api put-bucket-encryption --bucket {bucket} --server-side-encryption-configuration "
              "'{\"Rules\":[{\"ApplyServerSideEncryptionByDefault\":{\"SSEAlgorithm\":\"AES256\"},\"BucketKeyEnabled\":true}]}'",
              f"aws s3api put-bucket-lifecycle-configuration --bucket {bucket} --lifecycle-configuration file://s3/lifecycle.json",
              "", "# 3. the functions' role: least privilege",
              f"aws iam create-role --role-name {res['role']} --assume-role-policy-document file://iam/trust-policy.json",
              f"aws iam put-role-policy --role-name {res['role']} --policy-name {res['policy']} "
              "--policy-document file://iam/role-policy.json", "", "# 4. one function per stage"]
    for function in res["functions"]:
        uri = f"{res['repository_uri']}:{image_of(images, function['stage']).tag}"
        lines.append(f"aws lambda create-function --region {region} --function-name {function['name']} "
                     f"--package-type Image --code ImageUri={uri} --role {res['role_arn']} "
                     f"--memory-size {function['memory_mb']} --timeout {function['timeout_s']} "
                     f"--environment 'Variables={{{STORE_ENV}={res['store_url']}}}'")
    if "endpoint" in res:
        lines += lambda_endpoint.commands(res, res["endpoint"], f"{res['repository_uri']}:{image_of(images, 0).tag}")
    lines += ["", "# flatpack records nothing of what these commands create: remove it by hand, or deploy "
              "without --dry-run so that flatpack teardown removes it", ""]
    return "\n".join(lines)


def serve_config(compiled: Compiled, res: dict[str, Any], invoke_endpoint: str | None = None) -> str:
    """The serving master's configuration (``runtime.url_handler.SERVE_ENV``): where the
    fork-join spec is, the digest, the function of each fork-join stage, the requests it
    accepts (the input contract ``flatpack serve`` checks: each input's shape, dtype and free
    dimensions, the fewest samples the plan's batch splits need) and the most samples."""
    functions = {str(f["stage"]): f["name"] for f in res["functions"] if f["arn"] in res["endpoint"]["invoked_arns"]}
    config = {"spec": res["endpoint"]["spec_key"], "digest": compiled.digest, "functions": functions,
              "contract": compiled.request_contract().dumps(), "max_samples": res["endpoint"]["max_request_samples"],
              "outputs": lambda_endpoint.response_names(compiled)}
    if invoke_endpoint:
        config["invoke_endpoint"] = invoke_endpoint     # a stand-in's Invoke API (tests)
    return json.dumps(config, separators=(",", ":"))


def endpoint_files(compiled: Compiled, res: dict[str, Any], endpoint: Endpoint) -> dict[str, bytes]:
    endpoint_res = res["endpoint"]
    environment = lambda_endpoint.function_environment(res, endpoint_res, serve_config(compiled, res))
    return {"endpoint/role-policy.json": cloud.json_bytes(lambda_endpoint.serving_policy(res, endpoint_res)),
            "endpoint/caller-policy.json": cloud.json_bytes(lambda_endpoint.caller_policy(endpoint_res)),
            "endpoint/environment.json": cloud.json_bytes({"Variables": environment}),
            "endpoint/endpoint.json": cloud.json_bytes({"resources": endpoint_res,
                                                        "price": lambda_endpoint.price(endpoint),
                                                        "price_note": lambda_endpoint.describe_price(endpoint)})}


# checks before any API call ------------------------------------------------------------------
def known_regions(session: Any) -> set[str]:
    regions: set[str] = set()
    for partition in session.get_available_partitions():
        regions.update(session.get_available_regions("lambda", partition_name=partition))
    return regions


def default_region(session: Any) -> str | None:
    """The region when none is given, as the AWS CLI v2 resolves it: ``AWS_REGION``, then
    ``AWS_DEFAULT_REGION`` and the profile's ``region`` (boto3's ``session.region_name``,
    which does not read ``AWS_REGION``)."""
    return os.environ.get("AWS_REGION") or session.region_name


def check_region(session: Any, region: str | None) -> str:
    if not region:
        raise InputError("no AWS region: pass --region (region=...), or set AWS_REGION / AWS_DEFAULT_REGION, or "
                         "a region in your AWS profile (aws configure)")
    regions = known_regions(session)
    if region not in regions:
        close = difflib.get_close_matches(region, sorted(regions), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise InputError(f"{region!r} is not an AWS region where Lambda runs.{hint} Nothing was deployed")
    return region


def check_access(*, region: str | None = None, session: Any = None, **_: Any) -> str:
    """The region a deployment goes to, once it is one where Lambda runs and credentials are
    configured: what :func:`deploy` checks first, with no artifact needed, so ``flatpack
    deploy`` asks it before compiling the model (a missing credential is said in a second,
    not after the model's trace). Other deploy options are accepted and ignored."""
    # start-up time: boto3 takes ~0.2 s to load, and only calls that reach the cloud need it
    import boto3

    session = session or boto3.Session()
    region = check_region(session, region or default_region(session))
    check_credentials(session)
    return region


def check_credentials(session: Any) -> Any:
    """The session's credentials; without any, the error lists the chain boto3 searched."""
    credentials = session.get_credentials()
    if credentials is not None:
        return credentials
    resolver = session._session.get_component("credential_provider")  # botocore's chain, in its order
    chain = ", ".join(provider.METHOD for provider in resolver.providers)
    raise DeployError(
        "no AWS credentials found. boto3 searched, in order: " + chain + " (environment variables "
        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, the shared credentials file "
        "~/.aws/credentials, the config file ~/.aws/config for the profile in AWS_PROFILE, SSO, the container "
        "and instance metadata endpoints). Configure one: `aws configure`, `aws sso login --profile NAME` with "
        "AWS_PROFILE=NAME, or export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY. Nothing was deployed")


def caller_account(session: Any, region: str, endpoint_urls: dict[str, str]) -> str:
    # start-up time: boto3 takes ~0.2 s to load, and only calls that reach the cloud need it
    from botocore.exceptions import ClientError, NoCredentialsError

    sts = _client(session, "sts", region, endpoint_urls)
    try:
        return str(sts.get_caller_identity()["Account"])
    except NoCredentialsError as err:
        raise DeployError(f"{err}; configure AWS credentials (aws configure). Nothing was deployed") from None
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        raise DeployError(f"AWS refused the credentials ({code}: {err.response.get('Error', {}).get('Message', '')}). "
                          "Check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or your profile (aws sts "
                          "get-caller-identity shows whose they are). Nothing was deployed") from None


def _client(session: Any, service: str, region: str, endpoint_urls: dict[str, str], **config: Any) -> Any:
    # start-up time: boto3 takes ~0.2 s to load, and only calls that reach the cloud need it
    from botocore.config import Config

    settings = {"retries": {"mode": "standard", "max_attempts": 5}, "connect_timeout": 10, **config}
    return session.client(service, region_name=region, endpoint_url=endpoint_urls.get(service),
                          config=Config(**settings))


# pushing images --------------------------------------------------------------------------------
def docker_push(ecr: Any) -> Push:
    """Builds and pushes with the docker CLI, logged in with an ECR authorization token."""
    logged_in: set[str] = set()

    def push(image: ImageContext, context: Path, uri: str) -> None:
        registry = uri.split("/")[0]
        if registry not in logged_in:
            token = ecr.get_authorization_token()["authorizationData"][0]["authorizationToken"]
            user, password = base64.b64decode(token).decode().split(":", 1)
            subprocess.run(["docker", "login", "--username", user, "--password-stdin", registry],
                           input=password.encode(), check=True, capture_output=True)
            logged_in.add(registry)
        docker_build_and_push(context, uri, "--provenance=false")

    return push


# deploy -----------------------------------------------------------------------------------------
def deploy(compiled: Compiled, *, region: str | None = None, name: str | None = None, bucket: str | None = None,
           session: Any = None, endpoint_urls: dict[str, str] | None = None, push: Push | None = None,
           out: str | os.PathLike | None = None, workdir: str | os.PathLike | None = None,
           profile_tiers: Sequence[int] | None = None, base_image: str | None = None,
           lock: str | None = None, tls_only: bool = True, digest: str | None = None,
           endpoint: Endpoint | None = None) -> LambdaDeployment:
    """Creates the deployment (see the module's docstring) and returns it. ``endpoint_urls``
    points services at other endpoints (``{"s3": ..., "lambda": ..., "lambda-invoke": ...}``;
    the tests' local stand-ins). ``out``: where the build contexts and the deployment record
    go (default: a temporary directory; keep it for ``flatpack teardown``).
    ``profile_tiers``: instead of a function per stage, a profiler function per memory tier,
    each with every stage's artifact (``flatpack profile --target aws-lambda``).
    ``tls_only=False`` leaves out the bucket policy that refuses plain-HTTP requests: only for a
    stand-in S3 reached over ``http://`` in ``endpoint_urls`` (moto enforces the policy there);
    the record keeps which it was. ``digest``: refuse, before any API call, unless
    ``compiled.digest`` is this; the functions check their stages against ``compiled.digest``
    either way (it travels in each invocation). ``endpoint``: also the serving endpoint
    (``backends.lambda_endpoint``); its URL is ``deployment.resources["endpoint"]["url"]`` and
    the provisioned concurrency's price is logged and recorded."""
    # start-up time: boto3 takes ~0.2 s to load, and only calls that reach the cloud need it
    import boto3

    if endpoint is not None:
        endpoint.warn_if_public()
    endpoint_urls = dict(endpoint_urls or {})
    session = session or boto3.Session()
    region = check_access(region=region, session=session)
    name, images = cloud.preflight(compiled, NAME, name, bucket, profile_tiers, base_image, lock, digest)
    if push is None and shutil.which("docker") is None:
        raise InputError("deploying to aws-lambda builds container images, and no `docker` is on PATH. Install Docker, "
                         "or run `flatpack deploy --dry-run --out DIR` and build and push the images with "
                         "DIR/commands.sh. Nothing was deployed")
    account = caller_account(session, region, endpoint_urls)
    res = resources(compiled, name, region, account, bucket, endpoint_urls.get("s3"), profile_tiers, endpoint)
    cloud.check_bucket_name(res["bucket"])
    out_dir = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix=f"flatpack-{name}-"))
    ledger = cloud.Ledger(NAME, name, region, details={"resources": res, "endpoint_urls": endpoint_urls,
                                                       "tls_only": tls_only})
    clients = _Clients(session, region, endpoint_urls)
    cloud.create_recorded(ledger, _deleters(clients),
                          lambda: _create(compiled, res, images, ledger, clients, out_dir,
                                          push or docker_push(clients.ecr), tls_only),
                          out_dir, f"deploying {name} to aws-lambda ({region})")
    credentials = session.get_credentials().get_frozen_credentials()
    deployment = LambdaDeployment(compiled, res, ledger, clients, Path(workdir) if workdir else out_dir / "logs",
                                  (credentials.access_key, credentials.secret_key, credentials.token))
    if endpoint is not None:
        # the fork-join spec each of the serving master's sessions starts from
        deployment.store.put(res["endpoint"]["spec_key"], deployment.inference_spec().dumps())
        LOG.info("serving endpoint %s (auth %s); %s", res["endpoint"]["url"], endpoint.auth,
                 lambda_endpoint.describe_price(endpoint))
    return deployment


class _Clients:
    def __init__(self, session: Any, region: str, endpoint_urls: dict[str, str]) -> None:
        self.ecr = _client(session, "ecr", region, endpoint_urls)
        self.s3 = _client(session, "s3", region, endpoint_urls,
                          s3={"addressing_style": s3_addressing_style(endpoint_urls.get("s3"))})
        self.iam = _client(session, "iam", region, endpoint_urls)
        self.control = _client(session, "lambda", region, endpoint_urls)
        invoke_urls = {"lambda": endpoint_urls.get(INVOKE_SERVICE, endpoint_urls.get("lambda"))}
        self.invoke_endpoint = invoke_urls["lambda"]    # None: Lambda's own
        # a synchronous invocation lasts up to the function's timeout; botocore must not retry it on its own
        self.invoke = _client(session, "lambda", region, {k: v for k, v in invoke_urls.items() if v},
                              read_timeout=TIMEOUT_S + 60, retries={"mode": "standard", "max_attempts": 1},
                              max_pool_connections=256)


def _create(compiled: Compiled, res: dict[str, Any], images: list[ImageContext], ledger: cloud.Ledger,
            clients: _Clients, out_dir: Path, push: Push, tls_only: bool = True) -> None:
    name = res["name"]
    repository = clients.ecr.create_repository(repositoryName=res["repository"],
                                               imageScanningConfiguration={"scanOnPush": True})["repository"]
    ledger.add("repository", res["repository"])
    uris = cloud.push_images(images, repository["repositoryUri"], out_dir, push, ledger)
    cloud.make_bucket(clients.s3, res, ledger,
                      lambda s3, bucket, run: cloud.configure_bucket(s3, bucket, run, tls_only=tls_only))

    clients.iam.create_role(RoleName=res["role"], AssumeRolePolicyDocument=json.dumps(trust_policy()),
                            Description=f"flatpack deployment {name}: its functions' role")
    ledger.add("role", res["role"])
    clients.iam.put_role_policy(RoleName=res["role"], PolicyName=res["policy"],
                                PolicyDocument=json.dumps(role_policy(res)))
    ledger.add("role-policy", res["policy"], role=res["role"])

    for function in res["functions"]:
        uri = uris[image_of(images, function["stage"]).name]
        _create_function(clients.control, function, uri, res)
        ledger.add("function", function["name"])
    waiter = clients.control.get_waiter("function_active_v2")
    for function in res["functions"]:
        waiter.wait(FunctionName=function["name"], WaiterConfig={"Delay": 2, "MaxAttempts": 150})
    if "endpoint" in res:
        clients.s3.put_bucket_lifecycle_configuration(Bucket=res["bucket"],
                                                      LifecycleConfiguration={"Rules": lifecycle(res)})
        environment = lambda_endpoint.function_environment(res, res["endpoint"], serve_config(
            compiled, res, clients.invoke_endpoint))
        res["endpoint"]["url"] = lambda_endpoint.create(
            clients.control, clients.iam, res, res["endpoint"], uris[image_of(images, 0).name], environment,
            trust_policy(), ledger, _create_function)


def _create_function(control: Any, function: dict[str, Any], uri: str, res: dict[str, Any],
                     environment: dict[str, str] | None = None) -> None:
    # start-up time: boto3 takes ~0.2 s to load, and only calls that reach the cloud need it
    from botocore.exceptions import ClientError

    deadline = time.time() + ROLE_PROPAGATION_S
    while True:
        try:
            control.create_function(
                FunctionName=function["name"], PackageType="Image", Code={"ImageUri": uri}, Role=res["role_arn"],
                MemorySize=function["memory_mb"], Timeout=function["timeout_s"],
                Environment={"Variables": environment or {STORE_ENV: res["store_url"]}},
                Description=function.get("description") or cloud.describe_function(res["name"], function),
                Architectures=["x86_64"])
            return
        except ClientError as err:
            message = err.response.get("Error", {}).get("Message", "")
            # IAM is eventually consistent: a role created a moment ago may not be assumable yet
            if "cannot be assumed" not in message or time.time() > deadline:
                raise
            time.sleep(3)


def _deleters(clients: _Clients) -> dict[str, Callable[[dict[str, str]], None]]:
    # start-up time: boto3 takes ~0.2 s to load, and only calls that reach the cloud need it
    from botocore.exceptions import ClientError

    def gone_is_fine(call: Callable[[], Any], *codes: str) -> None:
        try:
            call()
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") not in codes:
                raise

    return {
        "function": lambda e: gone_is_fine(lambda: clients.control.delete_function(FunctionName=e["name"]),
                                           "ResourceNotFoundException"),
        "role-policy": lambda e: gone_is_fine(lambda: clients.iam.delete_role_policy(RoleName=e["role"],
                                                                                     PolicyName=e["name"]),
                                              "NoSuchEntity"),
        "role": lambda e: gone_is_fine(lambda: clients.iam.delete_role(RoleName=e["name"]), "NoSuchEntity"),
        "bucket": lambda e: cloud.delete_bucket(clients.s3, e["name"]),
        "repository": lambda e: gone_is_fine(
            lambda: clients.ecr.delete_repository(repositoryName=e["name"], force=True), "RepositoryNotFoundException"),
    }


def invoke(deployment: LambdaDeployment, role: Role) -> cloud.ThreadInvocation:
    """Invokes the role's function synchronously on a thread (Lambda's Invoke API)."""
    return deployment.launch(role)


def teardown(deployment: LambdaDeployment | str | os.PathLike, *, session: Any = None) -> list[str]:
    """Removes everything the deployment created; a deployment record's directory works too
    (``flatpack teardown DIR``). Returns what was removed."""
    if isinstance(deployment, LambdaDeployment):
        return deployment.teardown()
    # start-up time: boto3 takes ~0.2 s to load, and only calls that reach the cloud need it
    import boto3

    ledger = cloud.Ledger.load(deployment)
    session = session or boto3.Session()
    check_credentials(session)
    clients = _Clients(session, ledger.region, ledger.details.get("endpoint_urls", {}))
    return cloud.remove(ledger, _deleters(clients), Path(deployment))


class LambdaDeployment(cloud.CloudDeployment):
    """A deployment on Lambda: each function a synchronous invocation of the stage's Lambda function."""

    platform = NAME
    time_limit_s = TIMEOUT_S - TIME_LIMIT_MARGIN_S

    def deleters(self) -> dict[str, Callable[[dict[str, str]], None]]:
        return _deleters(self.clients)

    def invoke_function(self, function: str, payload: bytes) -> tuple[bytes, str | None, bytes]:
        response = self.clients.invoke.invoke(FunctionName=function, InvocationType="RequestResponse",
                                              LogType="Tail", Payload=payload)
        return (response["Payload"].read(), response.get("FunctionError"),
                base64.b64decode(response.get("LogResult", "")))


def backend() -> Any:
    """This module, as the backend registry hands it out."""
    return sys.modules[__name__]
