"""A worker refuses a stage whose files in the store changed after deploy.

The digest reaches each function in its invocation (``Role.digest``), never through the
store, so rewriting the stage's files, its manifest and the store's index together does not
help: the run fails at once with ``ArtifactRefused`` naming the stage and the file, and the
hostile stage code never runs (the sentinel never appears).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from flatpack.backends import local
from flatpack.errors import ArtifactRefused
from flatpack.runtime.function import load_module
from flatpack.runtime.function import Role
from flatpack.stage.artifact import stage_manifest
from flatpack.stage.integrity import Index
from tests.security.conftest import BATCH, hostile_stage_source


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=generator), torch.randint(0, 4, (BATCH,), generator=generator))
            for _ in range(count)]


def _tamper_in_store(deployment, sentinel, *, rewrite_index: bool) -> str:
    """Replaces stage 0's code in the store with code that creates the sentinel, fixes the
    manifest's hash, and optionally rewrites the store's index to match. Returns the key."""
    store, keys = deployment.store, deployment.keys
    source_key, manifest_key = keys.artifact(0, "stage.py"), keys.artifact(0, "manifest.json")
    source = hostile_stage_source(store.get(source_key).decode(), sentinel).encode()
    manifest_json = json.loads(store.get(manifest_key))
    manifest_json["files"]["stage.py"] = {"sha256": hashlib.sha256(source).hexdigest(), "bytes": len(source)}
    manifest_bytes = (json.dumps(manifest_json, indent=2) + "\n").encode()
    store.put(source_key, source)
    store.put(manifest_key, manifest_bytes)
    if rewrite_index:
        index = json.loads(store.get(keys.artifact_index()))
        index["files"]["stage_000/stage.py"] = {"bytes": len(source), "sha256": hashlib.sha256(source).hexdigest()}
        index["files"]["stage_000/manifest.json"] = {"bytes": len(manifest_bytes),
                                                     "sha256": hashlib.sha256(manifest_bytes).hexdigest()}
        store.put(keys.artifact_index(), (json.dumps(index, sort_keys=True, separators=(",", ":")) + "\n").encode())
    return source_key


@pytest.mark.parametrize("rewrite_index", [False, True], ids=["files", "files-and-index"])
def test_worker_refuses_a_stage_changed_in_the_store_after_deploy(s3_server, compiled, sentinel, rewrite_index):
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        _tamper_in_store(deployment, sentinel, rewrite_index=rewrite_index)
        with pytest.raises(ArtifactRefused) as caught:
            deployment.train(batches(1), iterations=1, optimizer={"name": "sgd", "lr": 0.1})
    message = str(caught.value)
    assert "refused its stage artifact" in message
    if rewrite_index:
        # a rewritten index fails every stage's digest check: whichever function reports first
        assert "flatpack.index.json" in message, message
    else:
        assert "stage 0" in message and "stage_000/" in message, message
    assert not sentinel.exists(), "the tampered stage's code ran in a worker"


def test_load_module_checks_the_invocation_digest_not_the_store(s3_server, compiled, sentinel):
    """The function side alone: an empty digest and a wrong one are refused before any stage
    code runs; the right one loads."""
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        store, keys = deployment.store, deployment.keys
        assert Index.parse(store.get(keys.artifact_index()), "store").digest == compiled.digest
        with pytest.raises(Exception, match="carries no artifact digest"):
            load_module(store, keys, 0, "")
        with pytest.raises(Exception, match="expected digest"):
            load_module(store, keys, 0, "0" * 64)
        assert stage_manifest(load_module(store, keys, 1, compiled.digest)).stage == 1
        _tamper_in_store(deployment, sentinel, rewrite_index=False)
        with pytest.raises(Exception, match="stage_000/(stage.py|manifest.json)"):
            load_module(store, keys, 0, compiled.digest)
    assert not sentinel.exists()


def test_the_digest_travels_in_the_role():
    role = Role("run/spec", 0, 0, 0, 1, digest="ab" * 32)
    assert Role.loads(role.dumps()).digest == "ab" * 32


def test_deploy_refuses_a_digest_that_is_not_the_artifacts(compiled, tmp_path):
    from flatpack.backends import gpu_container

    with pytest.raises(Exception, match="expected digest"):
        local.deploy(compiled, store_url="s3://unused/", digest="cd" * 32)
    with pytest.raises(Exception, match="expected digest"):
        gpu_container.deploy(compiled, backend="gloo", workdir=tmp_path / "ranks", digest="cd" * 32)
    assert not (tmp_path / "ranks").exists()


def test_a_gpu_container_rank_checks_its_stage_against_the_context_index(compiled, sentinel, tmp_path):
    """What a rank loads (``distributed.run_rank``): the stage from the context's ``stages/``,
    verified against ``stages/flatpack.index.json`` and the digest it was started with."""
    from flatpack.backends.gpu_container import stage_files
    from flatpack.stage.artifact import load_stage
    from flatpack.errors import ArtifactError
    from flatpack.runtime.distributed import stage_path

    for name, data in stage_files(compiled).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    assert stage_manifest(load_stage(stage_path(tmp_path, 1), digest=compiled.digest)).stage == 1
    source = stage_path(tmp_path, 0) / "stage.py"
    source.write_text(hostile_stage_source(source.read_text(), sentinel))
    with pytest.raises(ArtifactError, match="stage_000/stage.py"):
        load_stage(stage_path(tmp_path, 0), digest=compiled.digest)
    assert not sentinel.exists()


def test_a_gpu_container_build_context_is_checked_against_its_index(compiled):
    from flatpack.backends import gpu_container
    from flatpack.errors import ArtifactError

    files = gpu_container.package(compiled, backend="gloo", batch=BATCH)
    gpu_container.check_package(files)
    files["stages/stage_000/stage.py"] += b"\nimport os\n"
    with pytest.raises(ArtifactError, match="stages/stage_000/stage.py has .* flatpack.index.json"):
        gpu_container.check_package(files)


def test_an_inference_function_refuses_a_stage_changed_in_the_store(s3_server, compiled, sentinel):
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        _tamper_in_store(deployment, sentinel, rewrite_index=False)
        with pytest.raises(ArtifactRefused, match="refused its stage artifact.*stage_000/"):
            deployment.infer(torch.randn(BATCH, 8), wait_timeout_s=60)
    assert not sentinel.exists()


def test_a_function_checks_the_stages_baked_into_its_image(compiled, sentinel, tmp_path, monkeypatch):
    """The cloud functions' path: the stages baked under ``$FLATPACK_ARTIFACTS`` (the image
    holds no index yet), the index read from the store and checked against the role's digest."""
    from flatpack.stage.artifact import serialize
    from flatpack.runtime.keys import RunKeys
    from flatpack.runtime.store import FileStore
    from flatpack.runtime.function import ARTIFACTS_ENV

    baked = tmp_path / "image" / "artifacts"
    for artifact in compiled.artifacts:
        for name, data in serialize(artifact).items():
            (baked / f"stage_{artifact.index:03d}").mkdir(parents=True, exist_ok=True)
            (baked / f"stage_{artifact.index:03d}" / name).write_bytes(data)
    store, keys = FileStore(tmp_path / "store"), RunKeys("run-baked")
    store.put(keys.artifact_index(), compiled.index.raw)
    monkeypatch.setenv(ARTIFACTS_ENV, str(baked))
    assert stage_manifest(load_module(store, keys, 1, compiled.digest)).stage == 1
    source = baked / "stage_000" / "stage.py"
    source.write_text(hostile_stage_source(source.read_text(), sentinel))
    with pytest.raises(Exception, match=f"{baked}/stage_000/stage.py"):
        load_module(store, keys, 0, compiled.digest)
    # an index in the store rewritten to match is no help: the digest comes from the role
    files = {**compiled.files(), "stage_000/stage.py": source.read_bytes()}
    store.put(keys.artifact_index(), Index.build(files).raw)
    with pytest.raises(Exception, match="expected digest"):
        load_module(store, keys, 0, compiled.digest)
    assert not sentinel.exists()
