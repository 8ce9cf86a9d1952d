"""What the cloud function backends (``aws-lambda``, ``alibaba-fc``) share: checks that run
before any API call, the ledger that rolls a failed deploy back and drives teardown, the
deployment's bucket (S3, or OSS through its S3-compatible endpoint), and invocations as
threads the invoker polls like processes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from flatpack.atomic import write_atomic
from flatpack.backends.functions import FunctionDeployment
from flatpack.backends.images import SHARE_IMAGE_BELOW_BYTES, ImageContext, function_images, model_label
from flatpack.compiler import Compiled
from flatpack.errors import DeployError, InputError
from flatpack.platform.catalog import get_platform
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.function import Role
from flatpack.runtime.store_url import open_store
from flatpack.stage.integrity import check_digest

# the run's tensors that are dead once their iteration (or request) is done; the invoker
# deletes them as it goes, the lifecycle rule catches what a crashed invoker left behind
INTERMEDIATE_KINDS = ("data", "act", "grad", "sync", "reduced", "shared", "norm", "marker", "infer")
INTERMEDIATE_EXPIRY_DAYS = 1     # S3 lifecycle rules count in whole days
RECORD_FILE = "deployment.json"
RECORD_FORMAT = "flatpack-deployment"
ACCOUNT_PLACEHOLDER = "<ACCOUNT_ID>"     # what package() writes where the account id goes


def deployment_name(compiled: Compiled, prefix: str = "fp") -> str:
    """``fp-<model>-<6 hex>``: valid as a function, role, repository and bucket name part."""
    model = re.sub(r"[^a-z0-9]+", "-", model_label(compiled).lower()).strip("-") or "model"
    return f"{prefix}-{model[:24].rstrip('-')}-{uuid.uuid4().hex[:6]}"


_NAME = re.compile(r"^[a-z][a-z0-9-]{1,38}[a-z0-9]$")


def check_name(name: str) -> None:
    """A deployment name that every resource can carry: the functions (``-s000``, ``-p01024``),
    the role (``-role``), the repository (lowercase only) and the bucket (with the account id)."""
    if not _NAME.match(name) or "--" in name:
        raise InputError(f"deployment name {name!r} is not valid: use 3-40 lowercase letters, digits and single "
                         "hyphens, starting with a letter (it names the functions, the role, the image repository "
                         "and the bucket); nothing was deployed")


def default_bucket(name: str, account: str) -> str:
    """``<name>-<account>``: bucket names are global, and the account id keeps two accounts'
    deployments apart (left off while the account is a placeholder)."""
    suffix = "" if account == ACCOUNT_PLACEHOLDER else f"-{account}"
    return f"{name[:63 - len(suffix)]}{suffix}".lower()


def preflight(compiled: Compiled, target: str, name: str | None, bucket: str | None,
              profile_tiers: Sequence[int] | None, base_image: str | None = None,
              lock: str | None = None, digest: str | None = None) -> tuple[str, list[ImageContext]]:
    """The checks every cloud deploy makes before any API call (the artifact's digest when one
    is pinned, tiers, image sizes, names, a digest-pinned base and a hash-locked requirements
    file), so that bad input leaves nothing behind; returns the deployment's name and its images."""
    if digest is not None:   # this must be the artifact that was compiled (docs/security.md)
        check_digest(compiled.index.raw, digest, "the artifact to deploy")
    functions(compiled, "check", target, profile_tiers)
    # a profiler function needs every layer: one image holds them all
    images = function_images(compiled, target,
                             share_below_bytes=sys.maxsize if profile_tiers else SHARE_IMAGE_BELOW_BYTES,
                             base=base_image, lock=lock)
    name = name or deployment_name(compiled)
    check_name(name)
    if bucket is not None:
        check_bucket_name(bucket)
    return name, images


def image_notes(images: Sequence[ImageContext]) -> list[str]:
    """commands.sh's lines on what the images start from and install (the hardening a reader checks)."""
    bases = sorted({line for image in images for line in image.files["Dockerfile"].decode().splitlines()
                    if line.startswith(("# base:", "# refresh:"))})
    return [*bases, "# requirements.txt is a hash lock: pip --require-hashes installs only those files "
            "(regenerate: python -m flatpack.backends.lock function)",
            "# each image runs as an unprivileged USER; its files are root's and read-only to it"]


def json_bytes(data: Any) -> bytes:
    """A generated JSON file (policies, function settings): indented, newline-terminated."""
    return (json.dumps(data, indent=2) + "\n").encode()


def push_images(images: Sequence[ImageContext], repository_uri: str, out_dir: Path,
                push: Callable[[ImageContext, Path, str], None], ledger: Ledger) -> dict[str, str]:
    """Writes each image's build context under ``out_dir/images/``, pushes it as
    ``repository_uri:<content tag>`` and records it; image name -> URI."""
    uris = {}
    for image in images:
        context = image.write(out_dir / "images" / image.name)
        uris[image.name] = f"{repository_uri}:{image.tag}"
        push(image, context, uris[image.name])
    ledger.details["images"] = {image.name: {"uri": uris[image.name], "stages": list(image.stages),
                                             "context": f"images/{image.name}"} for image in images}
    return uris


def check_tiers(compiled: Compiled, target: str) -> None:
    """Every stage has a memory tier the platform offers; caught before any API call."""
    platform = get_platform(target)
    for index, stage in enumerate(compiled.plan.stages):
        if stage.memory_mb is None:
            raise InputError(f"stage {index} has no memory tier; {target} functions need one. Compile with "
                             f"target={target!r} and a solver that picks tiers (dp, miqp), or set memory_mb in the "
                             "plan")
        if not platform.min_memory_mb <= stage.memory_mb <= platform.max_memory_mb:
            raise InputError(f"stage {index} asks for {stage.memory_mb} MB, but {target} functions have "
                             f"{platform.min_memory_mb}-{platform.max_memory_mb} MB. Cut the model into more stages "
                             f"or pick a tier of at most {platform.max_memory_mb} MB; nothing was deployed")


def function_name(name: str, role_kind: str, index: int) -> str:
    """A stage's function (``-sNNN``) or, for in-target profiling and target calibration, a tier's
    (``-pMMMMM``, MB)."""
    return f"{name}-p{index:05d}" if role_kind in ("profile", "calibrate") else f"{name}-s{index:03d}"


def functions(compiled: Compiled, name: str, target: str,
              profile_tiers: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """The deployment's functions: one per stage with the stage's tier, or for in-target
    profiling one per memory tier (each holds every layer's artifact)."""
    if not profile_tiers:
        check_tiers(compiled, target)
        return [{"name": function_name(name, "train", index), "stage": index, "memory_mb": stage.memory_mb}
                for index, stage in enumerate(compiled.plan.stages)]
    platform = get_platform(target)
    for memory_mb in profile_tiers:
        platform.tier(memory_mb)    # refuses a size the platform does not offer, naming its range
    return [{"name": function_name(name, "profile", memory_mb), "stage": None, "memory_mb": memory_mb}
            for memory_mb in profile_tiers]


def describe_function(name: str, function: dict[str, Any]) -> str:
    if function["stage"] is None:
        return f"flatpack {name}: profiler for the {function['memory_mb']} MB tier"
    return f"flatpack {name}: stage {function['stage']}"


_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def check_bucket_name(name: str) -> None:
    """S3's bucket naming rules (OSS's are the same subset, less dots)."""
    problem = None
    if not _BUCKET.match(name):
        problem = ("3-63 characters of lowercase letters, digits, dots and hyphens, starting and ending with a letter "
                   "or digit")
    elif "." in name:
        # S3 allows them, but flatpack reaches buckets virtual-hosted over HTTPS, where a dot
        # in the host name breaks the certificate match (OSS allows no dots at all)
        problem = "without periods"
    elif name.startswith(("xn--", "sthree-")) or name.endswith(("-s3alias", "--ol-s3")):
        problem = "no reserved prefix (xn--, sthree-) or suffix (-s3alias, --ol-s3)"
    else:
        try:
            ipaddress.IPv4Address(name)
            problem = "not formatted as an IP address"
        except ValueError:
            pass
    if problem:
        raise InputError(f"bucket name {name!r} is not valid: bucket names must be {problem}. Pass another --bucket, "
                         "or leave it out and flatpack names one; nothing was deployed")


def lifecycle_rules(run: str) -> list[dict[str, Any]]:
    return [{"ID": f"flatpack-expire-{kind}", "Status": "Enabled", "Filter": {"Prefix": f"{run}/{kind}/"},
             "Expiration": {"Days": INTERMEDIATE_EXPIRY_DAYS}} for kind in INTERMEDIATE_KINDS]


@dataclass
class Ledger:
    """What a deploy created, in order. A failed deploy undoes it in reverse; the record
    (``deployment.json``) lets ``teardown`` remove everything later, from another process."""

    target: str
    name: str
    region: str
    created: list[dict[str, str]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def add(self, kind: str, name: str, **extra: str) -> None:
        self.created.append({"kind": kind, "name": name, **extra})

    def undo(self, deleters: dict[str, Callable[[dict[str, str]], None]]) -> tuple[list[str], list[str]]:
        """Deletes the created resources, newest first; returns (removed, failed to remove)."""
        removed, failed, kept = [], [], []
        for entry in reversed(self.created):
            label = f"{entry['kind']} {entry['name']}"
            try:
                deleters[entry["kind"]](entry)
                removed.append(label)
            except Exception as err:  # noqa: BLE001 - keep removing the rest, then say what stayed
                failed.append(f"{label} ({err})")
                kept.insert(0, entry)
        self.created = kept
        return removed, failed

    def to_json(self) -> dict[str, Any]:
        return {"format": RECORD_FORMAT, "target": self.target, "name": self.name, "region": self.region,
                "created": self.created, "details": self.details}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> Ledger:
        if data.get("format") != RECORD_FORMAT:
            raise InputError(f"{where} is not a flatpack deployment record (format {data.get('format')!r})")
        return cls(data["target"], data["name"], data["region"], list(data["created"]), dict(data.get("details", {})))

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / RECORD_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_atomic(path, json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Ledger:
        path = Path(directory)
        path = path / RECORD_FILE if path.is_dir() else path
        if not path.exists():
            raise InputError(f"no deployment record at {path}; pass the --out directory flatpack deploy wrote")
        return cls.from_json(json.loads(path.read_text()), str(path))


def rollback(ledger: Ledger, deleters: dict[str, Callable[[dict[str, str]], None]], cause: BaseException,
             what: str) -> DeployError:
    """Undoes a failed deploy and returns the error to raise: the cause, and what was removed."""
    removed, failed = ledger.undo(deleters)
    message = f"{what} failed: {cause}"
    if removed:
        message += f"\nRolled back: {', '.join(removed)}."
    if failed:
        message += (f"\nCould NOT remove: {', '.join(failed)}; delete them by hand or run "
                    "flatpack teardown on the deployment record.")
    elif not removed:
        message += "\nNothing had been created."
    else:
        message += "\nNothing is left behind."
    return DeployError(message, rolled_back=tuple(removed))


def create_recorded(ledger: Ledger, deleters: dict[str, Callable[[dict[str, str]], None]],
                    create: Callable[[], None], record_dir: Path, what: str) -> None:
    """Runs ``create`` (which adds each resource to ``ledger`` as it makes it); a failure
    rolls back what was made and raises the :class:`DeployError` that says so. The record
    is saved either way."""
    try:
        create()
    except BaseException as err:
        error = rollback(ledger, deleters, err, what)
        ledger.save(record_dir)
        if isinstance(err, KeyboardInterrupt):
            raise
        raise error from err
    ledger.save(record_dir)


def remove(ledger: Ledger, deleters: dict[str, Callable[[dict[str, str]], None]],
           record_dir: Path | None) -> list[str]:
    """Teardown: removes what the ledger lists, updates the record, and says what stayed."""
    removed, failed = ledger.undo(deleters)
    if record_dir is not None:
        ledger.save(record_dir)
    if failed:
        raise DeployError(f"teardown of {ledger.name} could not remove: {', '.join(failed)}. Removed: "
                          f"{', '.join(removed) or 'nothing'}. Run flatpack teardown again once the cause is fixed",
                          rolled_back=tuple(removed))
    return removed


# the deployment's bucket -------------------------------------------------------------------
def create_bucket(s3: Any, bucket: str, region: str) -> None:
    # us-east-1 is S3's default location and refuses to be named as a constraint
    # ACL private: said, not assumed (OSS's S3-compatible PutBucket takes it; AWS's default agrees)
    if region == "us-east-1":
        s3.create_bucket(Bucket=bucket, ACL="private")
    else:
        s3.create_bucket(Bucket=bucket, ACL="private", CreateBucketConfiguration={"LocationConstraint": region})


def make_bucket(s3: Any, res: dict[str, Any], ledger: Ledger,
                configure: Callable[[Any, str, str], None] | None = None) -> None:
    """The deployment's bucket, recorded as soon as it exists, then configured (by default
    :func:`configure_bucket`; OSS passes its own, see ``alibaba_fc``)."""
    create_bucket(s3, res["bucket"], res["region"])
    ledger.add("bucket", res["bucket"])
    (configure or configure_bucket)(s3, res["bucket"], res["run"])


PUBLIC_ACCESS_BLOCK = {"BlockPublicAcls": True, "IgnorePublicAcls": True, "BlockPublicPolicy": True,
                       "RestrictPublicBuckets": True}
SSE_S3 = {"Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}, "BucketKeyEnabled": True}]}


def tls_only_policy(bucket: str) -> dict[str, Any]:
    """A bucket policy that refuses every request not made over TLS, to the bucket and its
    objects, whoever makes it (AWS's ``aws:SecureTransport``): credentials sent over plain
    HTTP are refused before they are of use to a listener, and so is a reply with data."""
    return {"Version": "2012-10-17", "Statement": [{
        "Sid": "DenyInsecureTransport", "Effect": "Deny", "Principal": "*", "Action": "s3:*",
        "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
        "Condition": {"Bool": {"aws:SecureTransport": "false"}}}]}


def configure_bucket(s3: Any, bucket: str, run: str, tls_only: bool = True) -> None:
    """Private, TLS-only, encrypted, with a lifecycle rule that expires intermediate tensors.

    The public access block goes first: the TLS-only policy is a Deny (not public), and a
    later mistake cannot make the bucket public. ``tls_only=False`` leaves the policy off, for
    a local stand-in reached over plain HTTP only (the policy would refuse every request)."""
    s3.put_public_access_block(Bucket=bucket, PublicAccessBlockConfiguration=PUBLIC_ACCESS_BLOCK)
    if tls_only:
        s3.put_bucket_policy(Bucket=bucket, Policy=json.dumps(tls_only_policy(bucket)))
    s3.put_bucket_encryption(Bucket=bucket, ServerSideEncryptionConfiguration=SSE_S3)
    s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": lifecycle_rules(run)})


def delete_bucket(s3: Any, bucket: str) -> None:
    """Empties the bucket (it is the deployment's own) and deletes it; gone already is fine."""
    # start-up time: boto3 takes ~0.2 s to load, and only calls that reach the cloud need it
    from botocore.exceptions import ClientError

    try:
        paginator = s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        s3.delete_bucket(Bucket=bucket)
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") not in ("NoSuchBucket", "404"):
            raise


# invocations -------------------------------------------------------------------------------
class ThreadInvocation:
    """A synchronous invocation run on a thread, seen by the invoker as a process: ``poll``
    gives the function's exit code once the call returned. A cloud function cannot be
    killed from outside; ``kill`` stops waiting for it (it ends at its own time limit, and
    what it still writes is what its replacement writes: the runtime is deterministic)."""

    LOST = -9

    def __init__(self, call: Callable[[], int], name: str) -> None:
        self._call = call
        self.code: int | None = None
        self.failure = ""
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, name=f"invoke-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.code = self._call()
        except Exception as err:  # noqa: BLE001 - the invoker decides what a failed call means
            self.failure = f"{type(err).__name__}: {err}"
            self.code = self.LOST

    def poll(self) -> int | None:
        if self._abandoned:
            return self.LOST
        return None if self._thread.is_alive() else self.code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(f"the invocation did not return within {timeout} s")
            self._thread.join(0.05)
        return self.poll()  # type: ignore[return-value]

    def kill(self) -> None:
        self._abandoned = True


class CloudDeployment(FunctionDeployment):
    """A deployment on a cloud function platform: ``train`` and ``infer`` as on the local
    backend (the platform enforces the tiers itself), its resources in ``ledger``. The
    invoker's own store client uses the deploying user's credentials ``(key id, secret,
    token)``; the functions use their role's."""

    emulate_tiers = False

    def __init__(self, compiled: Compiled, res: dict[str, Any], ledger: Ledger, clients: Any, workdir: Path,
                 credentials: tuple[str, str, str | None]) -> None:
        key, secret, token = credentials
        store = open_store(res["store_url"], aws_access_key_id=key, aws_secret_access_key=secret,
                           aws_session_token=token or None)
        super().__init__(compiled, res["store_url"], {}, RunKeys(res["run"]), workdir, store=store)
        self.resources = res
        self.ledger = ledger
        self.clients = clients
        self.record_dir = workdir.parent if workdir.name == "logs" else None

    def deleters(self) -> dict[str, Callable[[dict[str, str]], None]]:
        raise NotImplementedError(f"{type(self).__name__} must say how to delete each kind of resource")

    def invoke_function(self, function: str, payload: bytes) -> tuple[bytes, str | None, bytes]:
        """One synchronous invocation: (the response payload, the platform's error type or
        None, the log tail)."""
        raise NotImplementedError(f"{type(self).__name__} must say how to invoke a function")

    def launch(self, role: Role) -> ThreadInvocation:
        """Invokes the role's function synchronously on a thread."""
        function = function_name(self.resources["name"], role.kind, role.stage)
        log = self.workdir / f"{role.kind}-{role.worker}-a{role.attempt}.log"
        payload = json.dumps({"role": role.dumps()}).encode()

        def call() -> int:
            answer, error, logs = self.invoke_function(function, payload)
            log.write_bytes(logs + b"\n" + answer)
            if error:
                # the handler never raises; an error here is the runtime's own: lost, as a killed process is
                raise RuntimeError(f"{function} answered {error}: {answer[:2000].decode(errors='replace')}")
            return int(json.loads(answer)["exit"])

        return ThreadInvocation(call, role.worker)

    def teardown(self) -> list[str]:  # type: ignore[override]
        """Stops waiting for functions, deletes the run's objects, then every resource."""
        super().teardown()
        return remove(self.ledger, self.deleters(), self.record_dir)
