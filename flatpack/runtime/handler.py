"""A function's entry point on a cloud platform: AWS Lambda calls ``handle(event, context)``,
and so does Function Compute through the container's small HTTP server (``fc_server``).

The event carries only the role (``{"role": "<Role JSON>"}``), or is a function URL's HTTP
request to the serving master (``runtime.url_handler``); the store's address is in the
function's environment (``FLATPACK_STORE``), set when the function was created, and the
credentials are the execution role's, which the platform puts in the environment. The
stage artifacts are baked into the image (``FLATPACK_ARTIFACTS``, by default
``$LAMBDA_TASK_ROOT/artifacts``). The body is the local function's (``worker.run_role``), so
a stage computes the same on every backend.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from flatpack.runtime import url_handler
from flatpack.runtime.function import ARTIFACTS_ENV, Role, peak_rss_bytes
from flatpack.runtime.function_env import STORE_ENV
from flatpack.runtime.store import open_plain_store
from flatpack.runtime.worker import run_role

TASK_ROOT_ENV = "LAMBDA_TASK_ROOT"


def handle(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """Runs the role in ``event`` and returns ``{"exit": code, "worker": ..., "peak_bytes": ...}``;
    the exit codes are the local function's (0 done, 75 invoke me again, 86 out of memory)."""
    started = time.time()
    if url_handler.is_url_event(event):     # the serving master behind a function URL (backends.lambda_endpoint)
        os.environ.setdefault(ARTIFACTS_ENV, os.path.join(os.environ.get(TASK_ROOT_ENV, os.getcwd()), "artifacts"))
        return url_handler.handle(event, context)
    if not isinstance(event, dict) or "role" not in event:
        raise ValueError(f"a flatpack function's event is {{\"role\": <Role JSON>}}, got {str(event)[:200]!r}")
    store_url = os.environ.get(STORE_ENV)
    if not store_url:
        raise RuntimeError(f"{STORE_ENV} is not set in the function's environment; redeploy with flatpack deploy")
    _alibaba_credentials_for_s3()
    os.environ.setdefault(ARTIFACTS_ENV, os.path.join(os.environ.get(TASK_ROOT_ENV, os.getcwd()), "artifacts"))
    role = Role.loads(event["role"] if isinstance(event["role"], str) else json.dumps(event["role"]))
    code = run_role(role, open_plain_store(store_url), started)
    return {"exit": code, "worker": role.worker, "peak_bytes": peak_rss_bytes()}



# FC gives a function its role's credentials under Alibaba's names; the store speaks to OSS
# through its S3-compatible endpoint with boto3, which reads AWS's names
_ALIBABA_TO_AWS = {"ALIBABA_CLOUD_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
                   "ALIBABA_CLOUD_ACCESS_KEY_SECRET": "AWS_SECRET_ACCESS_KEY",
                   "ALIBABA_CLOUD_SECURITY_TOKEN": "AWS_SESSION_TOKEN"}


def _alibaba_credentials_for_s3() -> None:
    if "AWS_ACCESS_KEY_ID" in os.environ or "ALIBABA_CLOUD_ACCESS_KEY_ID" not in os.environ:
        return
    for alibaba, aws in _ALIBABA_TO_AWS.items():
        if os.environ.get(alibaba):
            os.environ[aws] = os.environ[alibaba]
