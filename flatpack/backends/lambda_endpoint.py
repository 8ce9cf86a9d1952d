"""The serving endpoint of an aws-lambda deployment: the serving master behind a Lambda
function URL, with least-privilege IAM and, when asked, provisioned concurrency.

The serving master is one more function, ``<name>-serve``: the image of stage 0 with its
handler (``runtime.handler`` hands a function-URL event to ``runtime.url_handler``). It
answers ``POST /v1/predict`` (``{"inputs": {...}}`` as JSON) by invoking the fork-join
master and workers for the request (asynchronously, Gillis's per-request fork-join), and
``GET /healthz`` without them.

Its role may do exactly this (:func:`serving_policy`):

* ``lambda:InvokeFunction`` on the stage functions it starts (the master's and those of the
  groups with workers), nothing else of Lambda;
* ``s3:GetObject``/``s3:PutObject`` on its sessions' keys (``<run>-serve-*``), ``s3:GetObject``
  on the fork-join spec the deploy wrote (``<run>/spec/serve``), and ``s3:ListBucket`` of the
  sessions' prefix only (without it S3 answers 403 for a key not written yet, which a wait
  must read as "not yet");
* its own log group.

The URL's auth type is ``AWS_IAM`` by default: only callers whose IAM identity may
``lambda:InvokeFunctionUrl`` on it get through (``endpoint/caller-policy.json`` is that
policy, for the user to attach). ``NONE`` (anyone on the internet may call it, and every call
is billed to the account) only when asked, with a warning; Lambda then also needs a
resource-based permission for principal ``*``, which deploy adds.

Provisioned concurrency (``provisioned``): that many execution environments of the serving
master kept initialized, on an alias ``live`` that the URL points at; its price per hour,
from the catalog (``LAMBDA_PROVISIONED_PRICE_PER_GB_S``), is returned by :func:`price` and
shown by ``flatpack deploy``.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from flatpack.compiler import Compiled
from flatpack.ir import structure

from flatpack.errors import InputError
from flatpack.platform.catalog import LAMBDA_PROVISIONED_PRICE_PER_GB_S
from flatpack.runtime.function_env import STORE_ENV
from flatpack.runtime.url_handler import SERVE_ENV

AUTH_TYPES = ("AWS_IAM", "NONE")
ALIAS = "live"
SERVE_SUFFIX = "-serve"
# the serving master parses JSON tensors and waits on the store: torch's import and a request's
# tensors fit 1 GB, and Lambda's CPU share grows with memory (1,769 MB is one vCPU)
DEFAULT_MEMORY_MB = 1024
# a request may start a session (the fork-join functions' cold starts, tens of seconds) before it runs
TIMEOUT_S = 300
HOURS_PER_MONTH = 730


class PublicEndpointWarning(UserWarning):
    """A function URL with auth type NONE: anyone may call it, billed to the account."""


@dataclass(frozen=True)
class Endpoint:
    """What the deploy exposes: ``auth`` (``AWS_IAM`` or ``NONE``), ``provisioned``
    execution environments kept warm (0: none) and the serving master's ``memory_mb``."""

    auth: str = "AWS_IAM"
    provisioned: int = 0
    memory_mb: int = DEFAULT_MEMORY_MB
    # the cap on one request's samples (413 beyond it), flatpack serve's default
    # (serve.settings.DEFAULT_MAX_REQUEST_SAMPLES, a layer above; test_lambda_endpoint holds them equal)
    max_request_samples: int = 256

    def __post_init__(self) -> None:
        if self.auth not in AUTH_TYPES:
            raise InputError(f"the endpoint's auth type is AWS_IAM (default) or NONE (public), not {self.auth!r}")
        if not (isinstance(self.provisioned, int) and self.provisioned >= 0):
            raise InputError(f"provisioned concurrency must be a whole number of at least 0, got {self.provisioned!r}")
        if not (isinstance(self.memory_mb, int) and 128 <= self.memory_mb <= 10240):
            raise InputError(f"the serving master's memory must be 128 to 10240 MB, got {self.memory_mb!r}")
        if not (isinstance(self.max_request_samples, int) and self.max_request_samples >= 1):
            raise InputError(f"the endpoint's max_request_samples must be a whole number of at least 1, got "
                             f"{self.max_request_samples!r}")

    def warn_if_public(self) -> None:
        if self.auth == "NONE":
            warnings.warn("the function URL's auth type is NONE: anyone who finds the URL can call the model, and "
                          "every call is billed to this account; keep the default AWS_IAM unless the endpoint must "
                          "be public", PublicEndpointWarning, stacklevel=3)


def price(endpoint: Endpoint) -> dict[str, float | str]:
    """What the provisioned concurrency costs while it is configured, whatever the traffic."""
    per_hour = endpoint.provisioned * endpoint.memory_mb / 1024 * LAMBDA_PROVISIONED_PRICE_PER_GB_S * 3600
    return {"provisioned": endpoint.provisioned, "memory_mb": endpoint.memory_mb, "dollars_per_hour": per_hour,
            "dollars_per_month": per_hour * HOURS_PER_MONTH,
            "price_per_gb_s": LAMBDA_PROVISIONED_PRICE_PER_GB_S,
            "source": "flatpack.platform.catalog.LAMBDA_PROVISIONED_PRICE_PER_GB_S (AWS Lambda pricing, us-east-1)"}


def describe_price(endpoint: Endpoint) -> str:
    if not endpoint.provisioned:
        return ("no provisioned concurrency: the serving master's first request after a quiet spell pays its cold "
                "start (give provisioned=N to keep N environments warm)")
    figures = price(endpoint)
    return (f"provisioned concurrency {endpoint.provisioned} x {endpoint.memory_mb} MB: "
            f"${figures['dollars_per_hour']:.4f}/hour, ${figures['dollars_per_month']:.2f}/month, billed while "
            "configured whether or not requests come")


def resources(res: dict[str, Any], endpoint: Endpoint, fork_join_stages: tuple[int, ...]) -> dict[str, Any]:
    """Names and ARNs of the endpoint's resources, beside the deployment's ``res``;
    ``fork_join_stages``: the stages whose functions a session starts."""
    name, region, account = res["name"], res["region"], res["account"]
    function = f"{name}{SERVE_SUFFIX}"
    invoked = [f["arn"] for f in res["functions"] if f["stage"] in fork_join_stages]
    return {"function": function, "arn": f"arn:aws:lambda:{region}:{account}:function:{function}",
            "role": f"{name}-serve-role", "role_arn": f"arn:aws:iam::{account}:role/{name}-serve-role",
            "policy": f"{name}-serve-policy", "invoked_arns": invoked, "auth": endpoint.auth,
            "provisioned": endpoint.provisioned, "memory_mb": endpoint.memory_mb, "timeout_s": TIMEOUT_S,
            "qualifier": ALIAS if endpoint.provisioned else None, "spec_key": f"{res['run']}/spec/serve",
            "sessions": f"{res['run']}-serve-", "max_request_samples": endpoint.max_request_samples}


def serving_policy(res: dict[str, Any], endpoint_res: dict[str, Any]) -> dict[str, Any]:
    """The serving master's role policy: see the module docstring, statement by statement."""
    bucket, region, account = res["bucket"], res["region"], res["account"]
    log_group = f"arn:aws:logs:{region}:{account}:log-group:/aws/lambda/{endpoint_res['function']}"
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "InvokeStageFunctions", "Effect": "Allow", "Action": "lambda:InvokeFunction",
         "Resource": list(endpoint_res["invoked_arns"])},
        {"Sid": "SessionObjects", "Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"],
         "Resource": f"arn:aws:s3:::{bucket}/{endpoint_res['sessions']}*"},
        {"Sid": "ServeSpec", "Effect": "Allow", "Action": "s3:GetObject",
         "Resource": f"arn:aws:s3:::{bucket}/{endpoint_res['spec_key']}"},
        {"Sid": "ListSessions", "Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}",
         "Condition": {"StringLike": {"s3:prefix": [f"{endpoint_res['sessions']}*"]}}},
        {"Sid": "OwnLogs", "Effect": "Allow",
         "Action": ["logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents"],
         "Resource": [log_group, f"{log_group}:*"]},
    ]}


def response_names(compiled: Compiled) -> dict[str, str]:
    """Each output's name in a response, to the graph output it is: as ``flatpack serve`` names
    them (``runtime.request_tensors.flat_outputs``): ``output`` for one tensor, ``output_0``... for a
    tuple, the keys of a dict."""
    names = compiled.info.output_names
    built = structure.rebuild(compiled.info.output_structure, lambda index: names[index])
    if isinstance(built, str):
        return {"output": built}
    if isinstance(built, Mapping):
        return {str(key): value for key, value in built.items() if isinstance(value, str)}
    if isinstance(built, (tuple, list)):
        return {f"output_{index}": value for index, value in enumerate(built) if isinstance(value, str)}
    return {name: name for name in names}


def caller_policy(endpoint_res: dict[str, Any]) -> dict[str, Any]:
    """What a caller's IAM identity needs to call an ``AWS_IAM`` URL: invoking it through its
    URL only (not the Invoke API)."""
    arn = endpoint_res["arn"] + (f":{endpoint_res['qualifier']}" if endpoint_res["qualifier"] else "")
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "CallServingEndpoint", "Effect": "Allow", "Action": "lambda:InvokeFunctionUrl", "Resource": arn,
         "Condition": {"StringEquals": {"lambda:FunctionUrlAuthType": "AWS_IAM"}}}]}


def public_permission(endpoint_res: dict[str, Any]) -> dict[str, Any]:
    """The resource-based permission a URL of auth type NONE needs (Lambda refuses its calls without it)."""
    permission = {"FunctionName": endpoint_res["function"], "StatementId": "FunctionURLAllowPublicAccess",
                  "Action": "lambda:InvokeFunctionUrl", "Principal": "*", "FunctionUrlAuthType": "NONE"}
    if endpoint_res["qualifier"]:
        permission["Qualifier"] = endpoint_res["qualifier"]
    return permission


def function_environment(res: dict[str, Any], endpoint_res: dict[str, Any], config: str) -> dict[str, str]:
    """The serving master's environment: the store, and its configuration (``runtime.url_handler``)."""
    return {STORE_ENV: res["store_url"], SERVE_ENV: config}


def commands(res: dict[str, Any], endpoint_res: dict[str, Any], uri: str) -> list[str]:
    """The shell commands that create the endpoint by hand (what deploy does with boto3)."""
    region, function = res["region"], endpoint_res["function"]
    lines = ["", "# 5. the serving endpoint: its role (least privilege), the serving master, its function URL",
             f"aws iam create-role --role-name {endpoint_res['role']} "
             "--assume-role-policy-document file://iam/trust-policy.json",
             f"aws iam put-role-policy --role-name {endpoint_res['role']} --policy-name {endpoint_res['policy']} "
             "--policy-document file://endpoint/role-policy.json",
             f"aws lambda create-function --region {region} --function-name {function} --package-type Image "
             f"--code ImageUri={uri} --role {endpoint_res['role_arn']} --memory-size {endpoint_res['memory_mb']} "
             f"--timeout {endpoint_res['timeout_s']} --environment file://endpoint/environment.json"]
    qualifier = ""
    if endpoint_res["qualifier"]:
        qualifier = f" --qualifier {endpoint_res['qualifier']}"
        lines += [f"VERSION=$(aws lambda publish-version --region {region} --function-name {function} "
                  "--query Version --output text)",
                  f"aws lambda create-alias --region {region} --function-name {function} --name "
                  f"{endpoint_res['qualifier']} --function-version $VERSION",
                  f"aws lambda put-provisioned-concurrency-config --region {region} --function-name {function}"
                  f"{qualifier} --provisioned-concurrent-executions {endpoint_res['provisioned']}"]
    lines.append(f"aws lambda create-function-url-config --region {region} --function-name {function}{qualifier} "
                 f"--auth-type {endpoint_res['auth']}")
    if endpoint_res["auth"] == "NONE":
        lines.append(f"aws lambda add-permission --region {region} --function-name {function}{qualifier} "
                     "--statement-id FunctionURLAllowPublicAccess --action lambda:InvokeFunctionUrl --principal '*' "
                     "--function-url-auth-type NONE   # PUBLIC: anyone may call it, billed to this account")
    else:
        lines.append("# callers need endpoint/caller-policy.json on their IAM identity, and sign their requests "
                     "(SigV4, service lambda)")
    return lines


def create(control: Any, iam: Any, res: dict[str, Any], endpoint_res: dict[str, Any], uri: str,
           environment: dict[str, str], trust: dict[str, Any], ledger: Any, create_function: Any) -> str:
    """Creates the role, the serving master, its alias and provisioned concurrency (when
    asked) and its function URL; returns the URL. Each resource goes into ``ledger`` (the
    function's URL, alias and permission go with the function)."""
    iam.create_role(RoleName=endpoint_res["role"], AssumeRolePolicyDocument=json.dumps(trust),
                    Description=f"flatpack deployment {res['name']}: its serving master's role")
    ledger.add("role", endpoint_res["role"])
    iam.put_role_policy(RoleName=endpoint_res["role"], PolicyName=endpoint_res["policy"],
                        PolicyDocument=json.dumps(serving_policy(res, endpoint_res)))
    ledger.add("role-policy", endpoint_res["policy"], role=endpoint_res["role"])
    function = {"name": endpoint_res["function"], "stage": 0, "memory_mb": endpoint_res["memory_mb"],
                "timeout_s": endpoint_res["timeout_s"],
                "description": f"flatpack {res['name']}: the serving master (function URL)"}
    create_function(control, function, uri, {**res, "role_arn": endpoint_res["role_arn"]}, environment)
    ledger.add("function", endpoint_res["function"])
    control.get_waiter("function_active_v2").wait(FunctionName=endpoint_res["function"],
                                                 WaiterConfig={"Delay": 2, "MaxAttempts": 150})
    qualifier = {"Qualifier": endpoint_res["qualifier"]} if endpoint_res["qualifier"] else {}
    if endpoint_res["qualifier"]:
        version = control.publish_version(FunctionName=endpoint_res["function"])["Version"]
        control.create_alias(FunctionName=endpoint_res["function"], Name=endpoint_res["qualifier"],
                             FunctionVersion=version)
        control.put_provisioned_concurrency_config(FunctionName=endpoint_res["function"],
                                                   ProvisionedConcurrentExecutions=endpoint_res["provisioned"],
                                                   **qualifier)
    url = control.create_function_url_config(FunctionName=endpoint_res["function"], AuthType=endpoint_res["auth"],
                                             **qualifier)["FunctionUrl"]
    if endpoint_res["auth"] == "NONE":
        control.add_permission(**public_permission(endpoint_res))
    return url
