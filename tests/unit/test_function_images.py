"""Container images for the function targets and the checks that run before any cloud API
call: build contexts are sound (checked statically: no Docker engine here), images are
shared while small, tags follow content, names and tiers are checked, and the ledger rolls
back newest first and says what it could not remove."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch import nn

import flatpack
from flatpack.backends import cloud, images
from flatpack.backends.lock import committed_lock
from flatpack.errors import DeployError, InputError
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.platform.catalog import BASE_IMAGES


def compiled_model(memory_mb: int | None = 512, stages: int = 3) -> flatpack.Compiled:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(6)))
    base = flatpack.compile(model, (torch.randn(4, 32),), stages=stages)
    plan = Plan(tuple(StagePlan(start, end, memory_mb, 1) for start, end in base.plan.ranges), base.plan.num_layers)
    return flatpack.compile(model, (torch.randn(4, 32),), plan=plan)


@pytest.mark.parametrize("target", ["aws-lambda", "alibaba-fc"])
def test_contexts_are_sound_and_shared_while_small(target):
    compiled = compiled_model()
    [image] = images.function_images(compiled, target)
    assert image.stages == (0, 1, 2)
    assert images.check_context(image.files) == []
    for stage in range(3):
        assert f"artifacts/stage_{stage:03d}/weights.safetensors" in image.files
    assert "flatpack/runtime/worker.py" in image.files and "flatpack/runtime/handler.py" in image.files
    requirements = image.files["requirements.txt"].decode()
    assert requirements == committed_lock("function")            # hashed: pip --require-hashes installs it
    assert f"{images.TORCH_REQUIREMENT}+cpu" in requirements.split() and images.TORCH_INDEX in requirements
    dockerfile = image.files["Dockerfile"].decode()
    base = BASE_IMAGES[target]
    assert f"FROM {base.name}@sha256:" in dockerfile and base.observed in dockerfile
    assert f"RUN {images.PIP_INSTALL} -r" in dockerfile
    # everything is installed and copied as root, then the image drops to an unprivileged user
    instructions = [line.split()[0] for line in dockerfile.splitlines() if line and not line.startswith("#")]
    assert instructions.index("USER") > max(i for i, word in enumerate(instructions) if word in ("RUN", "COPY"))
    assert "USER 10001:10001" in dockerfile and "--chown" not in dockerfile
    assert f"RUN chmod -R go-w {images.FLAVORS[target].task_root}" in dockerfile   # whatever the context's modes
    if target == "alibaba-fc":
        assert 'CMD ["python", "-m", "flatpack.runtime.fc_server"]' in dockerfile and "EXPOSE 9000" in dockerfile
    else:
        assert 'CMD ["handler.handler"]' in dockerfile
    assert image.estimated_bytes > images.runtime_dependency_bytes() > 100 * images.MIB   # torch is in it


def test_images_bake_the_artifact_index():
    """Every image holds the whole artifact's index beside its stages, byte for byte the one
    whose sha256 is compiled.digest, and each baked stage file matches its entry."""
    from flatpack.stage.integrity import INDEX_FILE, Index

    compiled = compiled_model()
    for image in images.function_images(compiled, "aws-lambda", share_below_bytes=1):
        raw = image.files[f"artifacts/{INDEX_FILE}"]
        assert raw == compiled.index.raw
        index = Index.parse(raw, INDEX_FILE)
        assert index.digest == compiled.digest
        for path, data in image.files.items():
            if path.startswith("artifacts/stage_"):
                index.check(path.removeprefix("artifacts/"), data, path)


def test_large_stages_get_an_image_each_and_tags_follow_content():
    compiled = compiled_model()
    separate = images.function_images(compiled, "aws-lambda", share_below_bytes=1)
    assert [image.stages for image in separate] == [(0,), (1,), (2,)]
    assert len({image.tag for image in separate}) == 3
    assert [image.tag for image in images.function_images(compiled, "aws-lambda", share_below_bytes=1)] == \
        [image.tag for image in separate]
    assert all(not any(path.startswith("artifacts/stage_001") for path in image.files)
               for image in separate if image.stages != (1,))


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda files: files.pop("handler.py"), "COPY handler.py: the context has no such file"),
    (lambda files: files.update(Dockerfile=re.sub(rb"@sha256:[0-9a-f]{64}", b"", files["Dockerfile"])),
     "is not pinned by digest"),
    (lambda files: files.update(Dockerfile=files["Dockerfile"].replace(b"USER 10001:10001", b"USER root")),
     "final USER is 'root'"),
    (lambda files: files.update(Dockerfile=files["Dockerfile"].replace(b"USER 10001:10001\n", b"")),
     "sets no USER"),
    (lambda files: files.update(Dockerfile=files["Dockerfile"].replace(b" --require-hashes", b"")),
     "pip installs without --require-hashes"),
    (lambda files: files.update(
        Dockerfile=files["Dockerfile"].replace(b"COPY handler.py", b"COPY --chown=10001 handler.py")),
     "files must stay root's"),
    (lambda files: files.update({"requirements.txt": b"torch==2.13.0+cpu\n"}), "has no --hash"),
    (lambda files: files.update({"handler.py": b"x = 1\n"}), "defines no handler"),
    (lambda files: files.update({"flatpack/broken.py": b"def (:\n"}), "flatpack/broken.py does not compile"),
    (lambda files: files.update({"requirements.txt": b"torch\n"}), "does not pin torch==2.13.0"),
])
def test_check_context_finds_what_would_break_the_build(edit, problem):
    [image] = images.function_images(compiled_model(), "aws-lambda")
    files = dict(image.files)
    edit(files)
    assert any(problem in found for found in images.check_context(files))


def test_a_shipped_file_broken_after_a_sound_check_is_caught():
    """The compile check is cached by each file's bytes: the same path with other bytes is
    compiled again."""
    [image] = images.function_images(compiled_model(), "aws-lambda")
    files = dict(image.files)
    assert images.check_context(files) == []
    files["flatpack/runtime/worker.py"] = files["flatpack/runtime/worker.py"] + b"\ndef (:\n"
    assert any("flatpack/runtime/worker.py does not compile" in found for found in images.check_context(files))


def test_a_tag_only_base_image_is_refused_saying_how_to_get_its_digest():
    with pytest.raises(InputError, match=r"is a tag, not a digest.*docker buildx imagetools inspect python:3.12-slim"):
        images.function_images(compiled_model(), "alibaba-fc", base="python:3.12-slim")
    with pytest.raises(InputError, match="is not a sha256 digest"):
        images.function_images(compiled_model(), "alibaba-fc", base="python:3.12-slim@sha256:abc")
    digest = "sha256:" + "ab" * 32
    [image] = images.function_images(compiled_model(), "alibaba-fc", base=f"python:3.12-slim@{digest}")
    assert f"FROM python:3.12-slim@{digest}" in image.files["Dockerfile"].decode()
    assert images.check_context(image.files) == []


def test_an_unhashed_lock_is_refused_before_anything_is_written():
    with pytest.raises(InputError, match=r"(?s)not hash-locked.*numpy==2.0 has no --hash.*python -m "
                                         r"flatpack.backends.lock"):
        images.function_images(compiled_model(), "aws-lambda", lock="numpy==2.0\n")


def test_the_recorded_base_images_are_digests_with_a_date_and_source():
    for base in BASE_IMAGES.values():
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", base.digest) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", base.observed)
        assert "github.com/" in base.source and base.user.split(":")[0] not in ("0", "root")


def test_an_image_over_the_limit_is_refused_naming_the_stage(monkeypatch):
    monkeypatch.setattr(images, "runtime_dependency_bytes", lambda: 10 * images.GIB)
    with pytest.raises(InputError, match=r"stage\(s\) 0, 1, 2 would be about 10\.\d\d GB .* over aws-lambda's 10 GB"):
        images.function_images(compiled_model(), "aws-lambda")


def test_tiers_outside_the_platform_are_refused():
    with pytest.raises(InputError, match="stage 0 has no memory tier"):
        cloud.check_tiers(compiled_model(memory_mb=None), "aws-lambda")
    cloud.check_tiers(compiled_model(memory_mb=10240), "aws-lambda")
    with pytest.raises(InputError, match="asks for 16384 MB, but aws-lambda functions have 128-10240 MB"):
        cloud.check_tiers(compiled_model(memory_mb=16384), "aws-lambda")
    cloud.check_tiers(compiled_model(memory_mb=16384), "alibaba-fc")


@pytest.mark.parametrize("name", ["ab", "My-Bucket", "under_score", "-start", "end-", "a.b", "logs.example.com",
                                  "192.168.1.2", "xn--bucket", "bucket-s3alias", "x" * 64])
def test_invalid_bucket_names_are_refused(name):
    with pytest.raises(InputError, match=f"bucket name '{name}' is not valid"):
        cloud.check_bucket_name(name)


@pytest.mark.parametrize("name", ["abc", "fp-vgg16-1a2b3c-123456789012", "x" * 63])
def test_valid_bucket_names_pass(name):
    cloud.check_bucket_name(name)


@pytest.mark.parametrize("name", ["My_Model", "fp", "9lives", "double--hyphen", "trailing-", "x" * 41])
def test_invalid_deployment_names_are_refused(name):
    with pytest.raises(InputError, match=f"deployment name '{name}' is not valid"):
        cloud.check_name(name)


def test_generated_deployment_names_are_valid():
    name = cloud.deployment_name(compiled_model())
    cloud.check_name(name)
    assert name.startswith("fp-sequential-")


def test_the_ledger_rolls_back_newest_first_and_keeps_what_it_could_not_remove(tmp_path):
    ledger = cloud.Ledger("aws-lambda", "fp-x", "us-east-1")
    for kind, name in [("repository", "r"), ("bucket", "b"), ("role", "x"), ("function", "f")]:
        ledger.add(kind, name)
    order = []

    def delete(entry):
        order.append(entry["name"])
        if entry["kind"] == "role":
            raise RuntimeError("AccessDenied")

    error = cloud.rollback(ledger, {kind: delete for kind in ("repository", "bucket", "role", "function")},
                           RuntimeError("boom"), "deploying fp-x")
    assert order == ["f", "x", "b", "r"]
    assert isinstance(error, DeployError)
    assert "deploying fp-x failed: boom" in str(error) and "Could NOT remove: role x (AccessDenied)" in str(error)
    assert error.rolled_back == ("function f", "bucket b", "repository r")
    assert ledger.created == [{"kind": "role", "name": "x"}]
    ledger.save(tmp_path)
    assert cloud.Ledger.load(tmp_path).created == [{"kind": "role", "name": "x"}]


def test_lifecycle_rules_expire_only_intermediate_tensors():
    prefixes = {rule["Filter"]["Prefix"] for rule in cloud.lifecycle_rules("run-1")}
    assert prefixes == {f"run-1/{kind}/" for kind in cloud.INTERMEDIATE_KINDS}
    assert not any(kind in ("ckpt", "progress", "timeline", "status") for kind in cloud.INTERMEDIATE_KINDS)


def test_the_fc_container_server_wraps_the_handler(monkeypatch):
    import json
    import threading
    import urllib.error
    import urllib.request

    from flatpack.runtime import fc_server

    monkeypatch.setattr(fc_server, "handle", lambda event: {"exit": 0, "echo": event})
    server = fc_server.make_server("127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        request = urllib.request.Request(f"{url}/invoke", data=json.dumps({"role": "r"}).encode(), method="POST")
        assert json.loads(urllib.request.urlopen(request, timeout=10).read()) == {"exit": 0, "echo": {"role": "r"}}

        def failing(event):
            raise ValueError("no role")

        monkeypatch.setattr(fc_server, "handle", failing)
        with pytest.raises(urllib.error.HTTPError) as failure:
            urllib.request.urlopen(urllib.request.Request(f"{url}/invoke", data=b"{}", method="POST"), timeout=10)
        assert failure.value.code == 500
        assert json.loads(failure.value.read())["errorType"] == "ValueError"
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(urllib.request.Request(f"{url}/other", data=b"{}", method="POST"), timeout=10)
    finally:
        server.shutdown()


def test_the_default_push_builds_for_x86_64_then_pushes(tmp_path, monkeypatch):
    """No Docker engine here: a `docker` on PATH that records its arguments stands in."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    images.docker_build_and_push(tmp_path, "registry.example.com/repo:tag", "--provenance=false")
    assert calls.read_text().splitlines() == [
        f"build --platform linux/amd64 --provenance=false -t registry.example.com/repo:tag {tmp_path}",
        "push registry.example.com/repo:tag"]
