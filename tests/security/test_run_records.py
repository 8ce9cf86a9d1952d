"""A run directory is data, never instructions (docs/security.md, "A run directory is data").

Someone who can write a run directory (another user on a shared host, a tampered copy)
controls ``run.json``, ``batches.safetensors`` and what the record points at. Each attack here
was reproduced against flatpack before these guarantees, and each is now refused cleanly or
has no effect: a resume message never offers the record's factory as a command, ``compiled``
stays inside the run directory, data changed since the run started is refused naming what
changed (``--accept-changed-data`` accepts it with a warning), ``train_options.faults`` never
reaches the workers, hostile values in ``run.json``, plans and calibrations are flatpack errors
naming the file and the field, and the run's files are private (0700/0600)."""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
from safetensors.torch import save_file

import flatpack
from flatpack.backends import local
from flatpack.cli import main
from flatpack.data import ShardDirectory, batches_from_record, make_batches
from flatpack.errors import ArtifactError, InputError, PlanError
from flatpack.job import JobOptions, _data_record, resume_training, run_training
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.platform.calibration import Calibration, TierCalibration
from flatpack.rundir import RUN_FILE, RunDirectory, RunRecord
from flatpack.ir.profile import Linear
from tests.security.conftest import BATCH, make_model
from tests.unit.test_target_calibration import target_calibration

DEEP = 200_000     # nesting that made json's parser (and code walking the result) recurse
HOSTILE_VALUES: tuple[Any, ...] = (None, True, -1, 0, 1e308, 10**20, 10**400, "x", [], {}, [[[]]],
                                   {"a": {"b": 1}})


class Reached(Exception):
    """Raised in place of deploying: the resume got past every check of the record."""


@pytest.fixture
def no_deploy(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Reached
    monkeypatch.setattr(local, "deploy", refuse)


def write_shards(directory: Path, shards: int = 3, rows: int = 8, seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for index in range(shards):
        save_file({"x": torch.randn(rows, 8, generator=generator),
                   "target": torch.randint(0, 4, (rows,), generator=generator)},
                  str(directory / f"shard_{index:03d}.safetensors"))
    return directory


def hand_made_run(root: Path, compiled: flatpack.Compiled, *, shards: Path | None = None,
                  **changes: Any) -> RunDirectory:
    """The run directory `flatpack run` leaves before its first iteration (what a resume then
    trains from the start), made without training: the artifact, an empty store, the data
    (shards by reference, else a batches file) and run.json with the data's fingerprint."""
    directory = RunDirectory(root)
    directory.create()
    compiled.save(directory.compiled)
    directory.store.mkdir()
    if shards is not None:
        source = ShardDirectory(shards)
        batches = make_batches(source, make_model(), (torch.randn(BATCH, 8),), batch=BATCH, shuffle=False,
                               drop_last=True)
        options = JobOptions.of(batch=BATCH, epochs=1, iterations=2, shuffle=False, seed=0, drop_last=True,
                                data=str(shards))
        data, fingerprint = _data_record(batches, options), source.fingerprint()
    else:
        data = None
        fingerprint = directory.save_batches([(torch.randn(BATCH, 8), torch.randint(0, 4, (BATCH,)))
                                              for _ in range(2)])
    record = RunRecord(run="run-test", loss="cross_entropy", iterations=2, data=data, fingerprint=fingerprint,
                       train_options={"optimizer": "sgd", "micro_batches": 1, "threads": 1, "checkpoint_every": 1})
    directory.write(RunRecord(**{**record.__dict__, **changes}))
    return directory


def edit_record(directory: RunDirectory, **fields: Any) -> None:
    """What an attacker does: rewrites run.json by hand."""
    document = json.loads(directory.record_path.read_text())
    document.update(fields)
    directory.record_path.write_text(json.dumps(document))


def resume(directory: RunDirectory, **options: Any) -> Any:
    return resume_training(directory.root, stream=io.StringIO(), **options)


# -- 1. a message never offers the record's factory as a command ------------------------------

def factory_data(spec: str) -> dict[str, Any]:
    """A record's data naming the dataset factory ``spec`` (what an attacker writes into run.json)."""
    return {"source": {"kind": "factory", "spec": spec}, "batch": BATCH, "epochs": 1, "iterations": 2,
            "shuffle": False, "seed": 0, "drop_last": True, "layout": None}


def test_resume_of_a_factory_run_never_prints_the_recorded_factory(compiled, tmp_path, capsys):
    directory = hand_made_run(tmp_path / "run", compiled)
    attacker = tmp_path / "attacker"
    edit_record(directory, data=factory_data(f"{attacker / 'evil.py'}:make"))
    with pytest.raises(InputError) as refused:
        resume(directory)
    assert "evil" not in str(refused.value) and str(attacker) not in str(refused.value)
    assert "--data MODULE:FACTORY" in str(refused.value)
    # the command line says the same, and nothing in its output is the attacker's path
    assert main(["resume", str(directory.root)]) == 2
    printed = capsys.readouterr()
    assert "evil" not in printed.out + printed.err and "MODULE:FACTORY" in printed.err
    # naming another factory is refused without importing it, and without echoing the record
    mine = tmp_path / "mine.py"
    mine.write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\ndef make():\n    return []\n")
    with pytest.raises(InputError, match="not the factory this run recorded") as other:
        resume(directory, data=f"{mine}:make")
    assert "evil" not in str(other.value) and not (tmp_path / "imported").exists()


# -- 2. compiled stays inside the run directory ----------------------------------------------

@pytest.mark.parametrize("name", ["../outside", "ABSOLUTE", "compiled/../../outside", "a/b", "", ".."])
def test_compiled_outside_the_run_directory_is_refused_naming_the_field(compiled, tmp_path, name):
    directory = hand_made_run(tmp_path / "run", compiled)
    compiled.save(tmp_path / "outside")
    if name == "ABSOLUTE":     # the absolute path of a real artifact outside the run directory
        name = str(tmp_path / "outside")
    edit_record(directory, compiled=name)
    with pytest.raises(InputError, match=f"{RUN_FILE}: compiled .*inside the run directory"):
        directory.read()
    with pytest.raises(InputError, match="compiled"):
        resume(directory)


def test_compiled_as_a_link_out_of_the_run_directory_is_refused(compiled, tmp_path):
    directory = hand_made_run(tmp_path / "run", compiled)
    compiled.save(tmp_path / "outside")
    (directory.root / "compiled-run-x").symlink_to(tmp_path / "outside")
    edit_record(directory, compiled="compiled-run-x")
    with pytest.raises(InputError, match=f"{RUN_FILE}: compiled 'compiled-run-x' is a symbolic link"):
        resume(directory)


# -- 3. the data a run trained on is fingerprinted; resume refuses changed data --------------

def test_a_shard_changed_with_the_same_shapes_is_refused_naming_it_and_accepted_with_the_flag(
        compiled, tmp_path, no_deploy, caplog):
    shards = write_shards(tmp_path / "shards")
    directory = hand_made_run(tmp_path / "run", compiled, shards=shards)
    assert set((directory.read().fingerprint or {})["files"]) == {f"shard_{i:03d}.safetensors" for i in range(3)}
    with pytest.raises(Reached):          # unchanged data: every check passes
        resume(directory)
    write_shards(tmp_path / "other", seed=1)
    shutil.copy(tmp_path / "other" / "shard_001.safetensors", shards / "shard_001.safetensors")
    with pytest.raises(InputError, match="data changed since it started: 'shard_001.safetensors' changed content "
                                         r"\(sha256 .*--accept-changed-data"):
        resume(directory)
    with caplog.at_level(logging.WARNING, logger="flatpack"), pytest.raises(Reached):
        resume(directory, accept_changed_data=True)
    assert "'shard_001.safetensors' changed content" in caplog.text and "--accept-changed-data" in caplog.text


def test_a_shard_added_removed_or_resized_is_refused_naming_it(compiled, tmp_path, no_deploy):
    shards = write_shards(tmp_path / "shards")
    directory = hand_made_run(tmp_path / "run", compiled, shards=shards)
    shutil.copy(shards / "shard_000.safetensors", shards / "shard_009.safetensors")
    with pytest.raises(InputError, match="'shard_009.safetensors' was added"):
        resume(directory)
    (shards / "shard_009.safetensors").unlink()
    (shards / "shard_002.safetensors").unlink()
    with pytest.raises(InputError, match="'shard_002.safetensors' was removed"):
        resume(directory)
    write_shards(tmp_path / "bigger", rows=12)
    shutil.copy(tmp_path / "bigger" / "shard_002.safetensors", shards / "shard_002.safetensors")
    with pytest.raises(InputError, match=r"'shard_002.safetensors' changed size \(\d+ bytes, now \d+\)"):
        resume(directory)


def test_a_data_path_changed_in_run_json_is_refused(compiled, tmp_path, no_deploy):
    directory = hand_made_run(tmp_path / "run", compiled, shards=write_shards(tmp_path / "shards"))
    record = json.loads(directory.record_path.read_text())
    record["data"]["source"]["path"] = str(write_shards(tmp_path / "elsewhere", seed=7))
    directory.record_path.write_text(json.dumps(record))
    with pytest.raises(InputError, match="changed content"):
        resume(directory)


def test_a_replaced_batches_file_with_the_same_shapes_is_refused(compiled, tmp_path, no_deploy):
    directory = hand_made_run(tmp_path / "run", compiled)
    with pytest.raises(Reached):
        resume(directory)
    save_file({"b000000/x000": torch.randn(BATCH, 8), "b000000/y": torch.randint(0, 4, (BATCH,)),
               "b000001/x000": torch.randn(BATCH, 8), "b000001/y": torch.randint(0, 4, (BATCH,))},
              str(directory.batches_path))
    with pytest.raises(InputError, match="'batches.safetensors' changed content"):
        resume(directory)


def test_a_record_without_a_fingerprint_resumes_with_one_warning(compiled, tmp_path, no_deploy, caplog):
    directory = hand_made_run(tmp_path / "run", compiled, fingerprint=None)
    with caplog.at_level(logging.WARNING, logger="flatpack"), pytest.raises(Reached):
        resume(directory)
    assert caplog.text.count("cannot check that the data is what the run trained on") == 1


# -- 4. test-only knobs are never read from a record -----------------------------------------

def test_test_only_train_options_are_dropped_from_a_record(compiled, tmp_path, caplog):
    directory = hand_made_run(tmp_path / "run", compiled)
    options = json.loads(directory.record_path.read_text())["train_options"]
    edit_record(directory, train_options={**options, "faults": [{"stage": 0, "iteration": 0, "action": "sleep",
                                                                 "seconds": 1e9}],
                                          "store_faults": {"error_rate": 1.0}, "time_limit_s": 0.001,
                                          "timeout_s": 1e9})
    with caplog.at_level(logging.WARNING, logger="flatpack"):
        record = directory.read()
    assert record.train_options == options
    assert "ignoring train_options faults, store_faults, time_limit_s, timeout_s" in caplog.text
    edit_record(directory, train_options={**options, "exec": "rm -rf /"})
    with pytest.raises(InputError, match="train_options has unknown field 'exec'"):
        directory.read()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real `flatpack run` of the smallest model, two iterations, one stage."""
    out = tmp_path_factory.mktemp("finished") / "run"
    options = JobOptions.of(batch=BATCH, micro_batches=1, iterations=2, stages=1, replicas=(1,), verify=False,
                         out=out, optimizer="sgd")
    run_training(make_model(), (torch.randn(BATCH, 8),), options, stream=io.StringIO())
    return out


def test_faults_written_into_run_json_have_no_effect_on_a_resume(finished_run, tmp_path):
    """A record asking every attempt of stage 0 to fail (it would fail the run for good)
    resumes and trains normally: the workers never see the faults."""
    root = tmp_path / "run"
    shutil.copytree(finished_run, root)
    directory = RunDirectory(root)
    document = json.loads(directory.record_path.read_text())
    document["state"] = "running"
    document["train_options"]["faults"] = [{"stage": 0, "iteration": iteration, "attempt": attempt,
                                            "action": "raise"} for iteration in range(2) for attempt in range(8)]
    directory.record_path.write_text(json.dumps(document))
    directory.store.mkdir()
    result = resume(directory)
    assert result.state == "done" and result.iterations == 2
    assert directory.read().state == "done"


# -- 5. hostile values are flatpack errors naming the file and the field ---------------------

def leaves(document: Any, path: tuple = ()) -> Iterator[tuple]:
    """The path of every value in a JSON document, containers included."""
    yield path
    if isinstance(document, dict):
        for key, value in document.items():
            yield from leaves(value, (*path, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            yield from leaves(value, (*path, index))


def replaced(document: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    changed = copy.deepcopy(document)
    holder = changed
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    return changed


def every_mutation(document: Any) -> Iterator[tuple[tuple, Any]]:
    for path in list(leaves(document)):
        for value in HOSTILE_VALUES:
            yield path, replaced(document, path, value)


def test_every_hostile_value_in_run_json_is_a_clean_error(compiled, tmp_path):
    directory = hand_made_run(tmp_path / "run", compiled, shards=write_shards(tmp_path / "shards"))
    document = json.loads(directory.record_path.read_text())
    for path, mutated in every_mutation(document):
        directory.record_path.write_text(json.dumps(mutated))
        try:
            record = directory.read()
        except InputError as err:
            assert str(directory.record_path) in str(err), (path, err)
            continue
        except Exception as err:  # noqa: BLE001 - the assertion names the traceback a hostile value caused
            pytest.fail(f"run.json with {path} = {mutated!r:.100} raised {type(err).__name__}: {err}")
        assert isinstance(record, RunRecord)


def test_a_synthetic_run_keeps_what_draws_its_batches_not_a_copy(finished_run):
    directory = RunDirectory(finished_run)
    record = directory.read()
    assert record.data is not None and record.data["source"]["kind"] == "synthetic"
    assert not directory.batches_path.exists()
    assert record.fingerprint == batches_from_record(record.data).source.fingerprint()


def test_every_hostile_value_in_a_synthetic_data_record_is_a_clean_error(finished_run, tmp_path):
    """Every leaf of a synthetic run's data record replaced by a hostile value: reading the
    record and drawing a batch from it (what resume does) is a flatpack error naming the
    field, or it draws batches; never a traceback from inside torch."""
    directory = RunDirectory(tmp_path / "run")
    shutil.copytree(finished_run, directory.root)
    document = json.loads(directory.record_path.read_text())
    for path, mutated in every_mutation(document["data"]):
        directory.record_path.write_text(json.dumps({**document, "data": mutated}))
        try:
            record = directory.read()
            if record.data is not None:
                batches_from_record(record.data)(0)
        except InputError:
            continue
        except Exception as err:  # noqa: BLE001 - the assertion names the traceback a hostile value caused
            pytest.fail(f"run.json with data{path} = {mutated!r:.200} raised {type(err).__name__}: {err}")


@pytest.mark.parametrize("text, field", [
    ('{"run": "r", "loss": "mse", "iterations": NaN, "version": 1}', "NaN"),
    ('{"run": "r", "loss": "mse", "iterations": 1e9, "version": 1}', "iterations"),
    ('{"run": "r", "loss": "mse", "iterations": true, "version": 1}', "iterations"),
    ('{"run": "r", "loss": "mse", "iterations": -3, "version": 1}', "iterations"),
    ('{"run": "../../etc", "loss": "mse", "iterations": 2, "version": 1}', "run"),
    ('{"run": "r", "loss": "mse", "iterations": 2, "version": 1, "target": "ray://elsewhere:10001"}', "target"),
    ('{"run": "r", "loss": "mse", "iterations": 2, "version": 1, "state": "hacked"}', "state"),
    ('{"run": "r", "loss": "mse", "iterations": 2, "version": 1, "train_options": {"threads": 1e9}}', "threads"),
    ('{"run": "r", "loss": "mse", "iterations": 2, "version": 1, "train_options": {"micro_batches": 2.5}}',
     "micro_batches"),
    ('{"run": "r", "loss": "mse", "iterations": 2, "version": 1, "run": "s"}', "twice"),
    ('[' * DEEP + ']' * DEEP, "levels deep"),
    ('{"run": ' + '{"a": ' * DEEP + '1' + '}' * DEEP + '}', "levels deep"),
])
def test_hostile_run_json_is_refused_naming_the_file_and_field(tmp_path, text, field):
    (tmp_path / RUN_FILE).write_text(text)
    with pytest.raises(InputError, match=field) as refused:
        RunDirectory(tmp_path).read()
    assert RUN_FILE in str(refused.value)


def plan_document() -> dict[str, Any]:
    plan = Plan((StagePlan(0, 1, 1024, 2), StagePlan(2, 4, 2048, 1, recompute=True, split="batch")), 5, "dp",
                {"iteration_s": 0.5}, micro_batches=4)
    return json.loads(plan.dumps())


def test_every_hostile_value_in_a_plan_is_a_plan_error(tmp_path):
    for path, mutated in every_mutation(plan_document()):
        try:
            Plan.loads(json.dumps(mutated))
        except PlanError:
            continue
        except Exception as err:  # noqa: BLE001 - the assertion names the traceback a hostile value caused
            pytest.fail(f"a plan with {path} = {mutated!r:.100} raised {type(err).__name__}: {err}")


@pytest.mark.parametrize("field, value, message", [
    ("memory_mb", "NaN", "not valid JSON: NaN"),
    ("replicas", "100000", "replicas is 100000; it must be at least 1 and at most 1,024"),
    ("replicas", "true", "replicas must be a whole number"),
    ("replicas", "-2", "at least 1"),
    ("memory_mb", "1e300", "memory_mb is 1e.300; it must be at least 1 and at most 1,048,576"),
    ("memory_mb", "512.5", "memory_mb must be a whole number"),
])
def test_a_hostile_stage_in_a_plan_file_is_refused_naming_the_field(tmp_path, field, value, message):
    document = plan_document()
    text = json.dumps(document).replace(f'"{field}": {document["stages"][0][field]}', f'"{field}": {value}', 1)
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(PlanError, match=message) as refused:
        Plan.load(tmp_path / "plan.json")
    assert "plan.json" in str(refused.value)


def test_a_plan_with_nan_tiers_or_micro_batches_is_never_compiled(compiled, tmp_path):
    """The attack: a plan (JSON's NaN, or built in Python) compiled into an artifact."""
    model = make_model()
    document = plan_document()
    document["micro_batches"] = float("nan")
    (tmp_path / "plan.json").write_text(json.dumps(document))       # json writes NaN
    with pytest.raises(PlanError, match="NaN"):
        Plan.load(tmp_path / "plan.json")
    (tmp_path / "deep.json").write_text("[" * DEEP + "]" * DEEP)
    with pytest.raises(PlanError, match="levels deep"):
        Plan.load(tmp_path / "deep.json")
    last, layers = compiled.plan.num_layers - 1, compiled.plan.num_layers
    for plan in (Plan((StagePlan(0, last, float("nan")),), layers),  # type: ignore[arg-type]
                 Plan((StagePlan(0, last, 1024, 100_000),), layers),
                 Plan((StagePlan(0, last),), layers, micro_batches=float("nan"))):  # type: ignore[arg-type]
        with pytest.raises(PlanError, match="memory_mb|replicas|micro_batches"):
            flatpack.compile(model, (torch.randn(BATCH, 8),), plan=plan, out_dir=tmp_path / "never")
        assert not (tmp_path / "never").exists()


def layered_calibration() -> Calibration:
    return target_calibration(platform="local", layer_names=("a", "b"), tiers={512: TierCalibration(
        forward_s=(Linear(1e-3, 1e-4),) * 2, backward_s=(Linear(2e-3, 1e-4),) * 2, bandwidth_bytes_s=1e8,
        compute_ratio={"matmul": 2.0}, task_overhead_s={2: {"forward": 0.01}})},
        collective={"ranks": 2, "backend": "gloo", "device": "cpu", "device_name": "cpu", "sizes_bytes": [1, 2],
                    "point_to_point_s": [1e-4, 2e-4], "all_reduce_s": {"2": [1e-4, 2e-4]}, "latency_s": 1e-4,
                    "bandwidth_bytes_s": 1e9, "alpha_s_per_byte": 1e-9, "beta_s": 1e-5, "per_call_s": 1e-5,
                    "copy_s_per_byte": 1e-10, "ring_error": 0.1})


def test_every_hostile_value_in_a_calibration_is_an_input_error(tmp_path):
    path = layered_calibration().save(tmp_path / "calibration.json")
    document = json.loads(path.read_text())
    Calibration.load(path)
    for where, mutated in every_mutation(document):
        path.write_text(json.dumps(mutated))
        try:
            Calibration.load(path)
        except InputError as err:
            assert "calibration" in str(err), (where, err)
        except Exception as err:  # noqa: BLE001 - the assertion names the traceback a hostile value caused
            pytest.fail(f"a calibration with {where} = {mutated!r:.100} raised {type(err).__name__}: {err}")


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(host_cores=1e9), "host_cores must be a whole number of cores"),
    (lambda d: d["tiers"].update({"²": d["tiers"]["512"]}), "tier key '²' is not a memory size"),
    (lambda d: d["tiers"]["512"].update(bandwidth_bytes_s=1e308), "bandwidth_bytes_s is 1e.308, above"),
    (lambda d: d.update(layers=[[[[]]]]), "layers"),
])
def test_a_hostile_calibration_is_refused_naming_the_file_and_field(tmp_path, change, message):
    path = layered_calibration().save(tmp_path / "calibration.json")
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))
    with pytest.raises(InputError, match=message) as refused:
        Calibration.load(path)
    assert "calibration.json" in str(refused.value)
    path.write_text('{"format": ' + "[" * DEEP + "]" * DEEP + "}")
    with pytest.raises(InputError, match="levels deep"):
        Calibration.load(path)


# -- 6. private by default -------------------------------------------------------------------

def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_run_directory_and_its_files_are_private(finished_run):
    assert mode(finished_run) == 0o700
    for name in (RUN_FILE, "trained.safetensors"):
        assert mode(finished_run / name) == 0o600, name
    artifact = [path for path in (finished_run / "compiled").rglob("*")]
    assert artifact and all(mode(path) == (0o700 if path.is_dir() else 0o600) for path in artifact), \
        {str(path): oct(mode(path)) for path in artifact}
    assert mode(finished_run / "compiled") == 0o700


def test_run_records_and_batches_are_written_private_whatever_the_umask(compiled, tmp_path):
    previous = os.umask(0o022)
    try:
        directory = hand_made_run(tmp_path / "run", compiled)
        directory.write(directory.read())
    finally:
        os.umask(previous)
    assert mode(directory.root) == 0o700
    assert mode(directory.record_path) == 0o600 and mode(directory.batches_path) == 0o600


# -- 7. a gpu-container rank refuses an empty digest -----------------------------------------

@pytest.mark.parametrize("digest", ["", None])
def test_a_gpu_container_rank_without_a_digest_refuses_to_load_its_stage(compiled, tmp_path, monkeypatch, capsys,
                                                                         digest):
    from flatpack.backends import gpu_container
    from flatpack.runtime import distributed

    files = gpu_container.package(compiled, backend="gloo", batch=BATCH)
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    run = distributed.DistributedRun.loads(files[distributed.RUN_FILE])
    loaded = []
    monkeypatch.setattr(distributed, "load_stage", lambda *args, **kwargs: loaded.append(args))
    with pytest.raises(ArtifactError, match="no artifact digest .*FLATPACK_DIGEST is empty or unset"):
        distributed.run_rank(run, tmp_path, tmp_path / "out", data_dir=None, rank=0, local_rank=0, digest=digest)
    assert not loaded
    # the entry point: FLATPACK_DIGEST="" is not "no check"
    monkeypatch.setenv(distributed.DIGEST_ENV, "")
    monkeypatch.setenv("RANK", "0")
    assert distributed.main(["--context", str(tmp_path), "--out", str(tmp_path / "out"), "--synthetic"]) == 1
    assert not loaded and "ArtifactError: this rank was started with no artifact digest" in capsys.readouterr().err



def test_a_call_record_in_the_store_cannot_inject_faults_into_a_resume():
    """The store under RUN/store is files too: a call record holds training settings only, so
    a run control written into one by hand (faults, a 1e9 s timeout) makes it a StoreError,
    and resume passes the recorded settings whole, with no control but its own."""
    from flatpack.backends.functions import CallRecord, FunctionDeployment
    from flatpack.errors import StoreError
    from flatpack.runtime.optim import OptimizerSpec
    from flatpack.runtime.settings import RunControls, TrainSettings

    settings = TrainSettings(optimizer=OptimizerSpec.of("sgd"), loss="mse", micro_batches=2)
    record = CallRecord(0, 4, None, 0, settings)
    asked: list[tuple[TrainSettings, RunControls]] = []
    fake = SimpleNamespace(calls=lambda: [CallRecord.loads(record.dumps())], consistent_checkpoint=lambda: 1,
                           train=lambda batches, settings, controls: asked.append((settings, controls)))
    FunctionDeployment.resume(fake, [None] * 4)  # type: ignore[arg-type]
    assert asked == [(settings, RunControls(iterations=2, batch_offset=2))]
    hostile = json.loads(record.dumps())
    hostile["settings"].update({"faults": [{"action": "raise"}], "timeout_s": 1e9})
    for raw in (b"[" * DEEP + b"]" * DEEP, b'{"settings": 1}', b'{"settings": {}, "exec": 1}', b"NaN",
                json.dumps(hostile).encode(), b'{"settings": {"loss": "rm -rf"}}'):
        with pytest.raises(StoreError, match="call record"):
            CallRecord.loads(raw)


def test_s3_shards_are_fingerprinted_by_size_and_etag_from_the_listing(s3_server, tmp_path, monkeypatch):
    """An s3:// prefix's fingerprint: each shard key's size and ETag, nothing downloaded; a
    shard re-uploaded with other values (same shapes) shows as changed content, naming it."""
    from flatpack.data import S3Shards
    from flatpack.rundir import fingerprint_changes

    for name, value in s3_server.env().items():      # the standard AWS variables name the credentials
        monkeypatch.setenv(name, value)
    shards = write_shards(tmp_path / "shards")
    prefix = f"fingerprint-{tmp_path.name}/"
    with s3_server.store(prefix=prefix) as store:
        for path in sorted(shards.iterdir()):
            store.put(path.name, path.read_bytes())
        source = S3Shards(f"s3://{s3_server.bucket}/{prefix}", s3_server.endpoint_url)
        before = source.fingerprint()
        assert set(before["files"]) == {f"{prefix}{path.name}" for path in shards.iterdir()}
        assert all(entry["etag"] and entry["size"] > 0 for entry in before["files"].values())
        write_shards(tmp_path / "other", seed=3)
        store.put("shard_001.safetensors", (tmp_path / "other" / "shard_001.safetensors").read_bytes())
        after = S3Shards(f"s3://{s3_server.bucket}/{prefix}", s3_server.endpoint_url).fingerprint()
    with s3_server.store() as root:
        root.delete_prefix(prefix)
    (change,) = fingerprint_changes(before, after)
    assert change.startswith(f"'{prefix}shard_001.safetensors' changed content (etag "), change


def test_resume_runs_the_functions_where_run_json_says_and_takes_no_address_from_it(compiled, tmp_path, no_deploy,
                                                                                     monkeypatch):
    """A run started with --target ray resumes on Ray without --target; the cluster is the
    one --address names, else Ray's "auto": never an address read from the record."""
    from flatpack.backends import ray as ray_backend

    asked: list[Any] = []

    def on_ray(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("address"))
        raise Reached
    monkeypatch.setattr(ray_backend, "deploy", on_ray)
    directory = hand_made_run(tmp_path / "run", compiled, target="ray")
    assert directory.read().target == "ray"
    with pytest.raises(Reached):
        resume(directory)
    with pytest.raises(Reached):
        resume(directory, address="ray://head:10001")
    assert asked == [None, "ray://head:10001"]
    with pytest.raises(Reached):             # --target local finishes it here: local.deploy (no_deploy)
        resume(directory, target="local")
    assert len(asked) == 2


def test_a_record_naming_a_target_run_never_trains_on_is_refused_naming_run_json(compiled, tmp_path, no_deploy):
    directory = hand_made_run(tmp_path / "run", compiled, target="aws-lambda")
    with pytest.raises(InputError, match=r"run\.json: target is 'aws-lambda'.*--target local or --target ray"):
        resume(directory)
    with pytest.raises(Reached):        # the user's --target decides
        resume(directory, target="local")
