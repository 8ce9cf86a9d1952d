"""The first hour of a new user (issue 41): a TOML config with numbers and arrays for the
comma-list options, one config file for every verb, --config and the exit codes in every
verb's help, "did you mean" for misspelt options and verbs, a --help that does not import
torch, counts in the singular, and refused runs that check their arguments first and leave
no directory behind."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from flatpack import cli
from flatpack.cli import build_parser, main


def _parse(tmp_path, text: str, *argv: str):
    config = tmp_path / "u.toml"
    config.write_text(text)
    return cli.parse_arguments(build_parser(), [*argv, "--config", str(config)])


@pytest.mark.parametrize("text, verb, wanted", [
    ("batch = 16\nmicro-batches = 2\n", "plan", (16, "2", None)),
    ("micro-batches = [2, 4]\nreplicas = [1, 2]\n", "plan", (64, "2,4", "1,2")),
    ("replicas = 2\nmemory = [512, 1024]\n", "plan", (64, None, "2")),
])
def test_toml_numbers_and_arrays_work_for_the_comma_list_options(tmp_path, text, verb, wanted):
    args = _parse(tmp_path, text, verb, "mlp")
    assert (args.batch, args.micro_batches, args.replicas) == wanted


def test_the_plan_workload_takes_a_config_integer(tmp_path):
    args = _parse(tmp_path, "batch = 16\nmicro-batches = 2\nmemory = [512, 1024]\n", "plan", "mlp")
    from flatpack.cli.planning import _plan_workload

    workload, options = _plan_workload(args)
    assert workload.micro_batches == 2 and options.memory_mb == (512, 1024)


@pytest.mark.parametrize("text, words", [
    ("micro-batches = {a = 1}\n", "'micro-batches' takes text, a number or an array"),
    ("replicas = [true]\n", "'replicas' takes text, a number or an array"),
    ("replicas = []\n", "'replicas' takes text, a number or an array"),
])
def test_a_wrongly_typed_list_option_is_a_clean_error_naming_file_and_key(tmp_path, capsys, text, words):
    config = tmp_path / "u.toml"
    config.write_text(text)
    assert main(["plan", "mlp", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert words in err and str(config) in err and "Traceback" not in err


def test_the_help_example_config_is_valid_for_every_verb_that_takes_it(tmp_path):
    help_text = " ".join(build_parser().format_help().split())
    assert "batch = 64, micro-batches = 8, replicas = [1, 2]" in help_text
    for verb in ("run", "plan", "deploy"):
        extra = ["--target", "aws-lambda", "--out", str(tmp_path / "o")] if verb == "deploy" else []
        args = _parse(tmp_path, "batch = 64\nmicro-batches = 8\nreplicas = [1, 2]\n", verb, "mlp", *extra)
        assert args.batch == 64 and str(args.micro_batches) == "8" and args.replicas == "1,2"


def test_a_runs_config_given_to_plan_skips_the_other_verbs_keys(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="flatpack"):
        args = _parse(tmp_path, 'batch = 16\niterations = 3\nschedule = "1f1b"\n', "plan", "mlp")
    assert args.batch == 16 and not hasattr(args, "iterations")
    skipped = [record.getMessage() for record in caplog.records if "skipped" in record.getMessage()]
    assert len(skipped) == 1 and "iterations, schedule" in skipped[0] and "flatpack plan" in skipped[0]


def test_a_key_that_is_no_verbs_option_is_still_refused(tmp_path, capsys):
    config = tmp_path / "u.toml"
    config.write_text("micro-batchs = 2\n")
    assert main(["plan", "mlp", "--config", str(config)]) == 2
    assert "did you mean micro-batches" in capsys.readouterr().err


def _verbs() -> dict:
    return cli.verb_parsers(build_parser())


def test_every_verbs_help_lists_config_and_the_exit_codes(capsys):
    verbs = _verbs()
    assert len(verbs) >= 13
    for verb in verbs:
        with pytest.raises(SystemExit) as done:
            main([verb, "--help"])
        printed = " ".join(capsys.readouterr().out.split())
        assert done.value.code == 0
        assert "--config FILE.toml" in printed and "options given on the command line win" in printed, verb
        assert "exit codes: 0 success; 1 a run failed" in printed and "2 bad input" in printed, verb
        assert "128+N stopped by signal N" in printed, verb


def test_config_after_the_verb_still_gives_defaults(tmp_path):
    config = tmp_path / "u.toml"
    config.write_text("batch = 8\n")
    args = cli.parse_arguments(build_parser(), ["plan", "--config", str(config), "mlp"])
    assert args.batch == 8


@pytest.mark.parametrize("argv, words", [
    (["plan", "mlp", "--micro-batchs", "2"], "flatpack plan: error: unrecognized option --micro-batchs; did you mean "
                                            "--micro-batches?"),
    (["plan", "mlp", "--micro-batchs=2"], "did you mean --micro-batches?"),
    (["run", "mlp", "--iteratons", "2"], "did you mean --iterations?"),
    (["plna", "mlp"], "flatpack: error: unknown verb 'plna'; did you mean plan?"),
    (["plan", "mlp", "--mode", "trian"], "invalid choice: 'trian' (choose from 'train', 'infer'); did you mean train?"),
])
def test_a_misspelt_option_or_verb_gets_a_did_you_mean_on_one_line(capsys, argv, words):
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_an_option_with_no_close_match_is_still_named(capsys):
    with pytest.raises(SystemExit) as done:
        main(["inspect", "mlp", "--zzzzzz"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "unrecognized option --zzzzzz" in err and "did you mean" not in err


def test_building_the_parser_does_not_import_torch():
    import subprocess
    import sys

    code = ("import flatpack.cli, sys\nflatpack.cli.build_parser()\n"
            "for verb in ('plan', 'run', 'demo'):\n"
            "    try:\n        flatpack.cli.main([verb, '--help'])\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stderr.strip().splitlines()[-1] == "False"


def test_version_answers_without_building_the_verbs_parsers(capsys):
    """`flatpack --version` prints what argparse's --version action would, and imports no verb
    module (start-up time: the done-when's 0.3 s)."""
    import subprocess
    import sys

    with pytest.raises(SystemExit) as fast:
        main(["--version"])
    printed = capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert fast.value.code == done.value.code == 0 and capsys.readouterr().out == printed
    assert printed.startswith("flatpack ")
    code = ("import sys\nfrom flatpack.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(name for name in sys.modules if name.startswith(('flatpack.cli.', 'flatpack.serve', "
            "'torch'))), file=sys.stderr)")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert ran.stdout == printed
    assert ran.stderr.strip().splitlines()[-1] == "['flatpack.cli.common', 'flatpack.cli.parser']"


FACTORY = '''
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), (torch.randn(4, 8),)
'''


def test_a_count_of_one_reads_in_the_singular(tmp_path, capsys):
    factory = tmp_path / "my_model.py"
    factory.write_text(FACTORY)
    assert main(["compile", f"{factory}:build", "--stages", "1", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "wrote 1 stage to" in out and "1 stages" not in out


def test_demo_checks_the_model_before_the_host_calibration(tmp_path, capsys, monkeypatch):
    from flatpack.backends import target_calibration

    def calibrate(*args, **kwargs):
        raise AssertionError("the host calibration ran before the model was checked")

    monkeypatch.setattr(target_calibration, "measure_local_calibration", calibrate)
    monkeypatch.setattr(target_calibration, "find_local_calibration", calibrate)
    out = tmp_path / "demo"
    assert main(["demo", "--model", "resnet999", "--calibration", "measure", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'resnet999'" in err and "did you mean" in err
    assert not out.exists()


def test_the_first_demo_runs_uncalibrated_and_names_the_command_that_calibrates(tmp_path, monkeypatch):
    """With no calibration of this host cached, `flatpack demo` (--calibration auto) measures
    none (minutes, longer than the demo): it predicts uncalibrated and says how to calibrate;
    with one cached it predicts with it; `--calibration measure` measures now."""
    from flatpack.backends import target_calibration
    from flatpack.cli.training import DEMO_TIERS, MEASURE_HINT, _demo_calibration

    monkeypatch.setenv("FLATPACK_CACHE_DIR", str(tmp_path))
    measured: list[tuple[int, ...]] = []

    def measure(tiers, report=None):
        measured.append(tuple(tiers))
        path = target_calibration.local_calibration_path(tiers)
        path.write_text("{}")
        return path

    monkeypatch.setattr(target_calibration, "measure_local_calibration", measure)
    assert _demo_calibration("auto") is None and not measured
    assert "flatpack demo --calibration measure" in MEASURE_HINT
    cached = _demo_calibration("measure")
    assert measured == [DEMO_TIERS] and cached == target_calibration.local_calibration_path(DEMO_TIERS)
    monkeypatch.setattr(target_calibration, "find_local_calibration", lambda tiers, report=None: cached)
    assert _demo_calibration("auto") == cached and len(measured) == 1


def test_every_prediction_says_whether_it_is_calibrated():
    """The report's first prediction says what the cost model rests on: the catalog's figures
    (and the command that measures the target), or the calibration file and when it was measured."""
    import dataclasses

    from flatpack.job import prediction_basis
    from flatpack.platform.calibration import Calibration, TargetInfo, TierCalibration
    from flatpack.platform.catalog import get_platform

    platform = get_platform("local")
    uncalibrated = prediction_basis(_Problem(platform, None))
    assert uncalibrated.startswith("uncalibrated") and "flatpack calibrate --target local" in uncalibrated
    calibration = Calibration("local", (), {512: TierCalibration(compute_ratio={"conv": 3.0})},
                              target=TargetInfo("local", "2026-11-29T00:00:00+00:00", "cpu", "0"))
    calibrated = prediction_basis(dataclasses.replace(_Problem(platform, None), calibration=calibration))
    assert calibrated.startswith("calibrated") and "2026-11-29" in calibrated


@dataclasses.dataclass(frozen=True)
class _Problem:
    """What prediction_basis reads of a partitioning problem."""

    platform: object
    calibration: object


def test_a_refused_run_leaves_no_run_directory_behind(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLATPACK_CACHE_DIR", str(tmp_path / "cache"))
    factory = tmp_path / "my_model.py"
    factory.write_text(FACTORY)
    out = tmp_path / "run"
    assert main(["run", f"{factory}:build", "--stages", "9", "--out", str(out), "--batch", "8",
                 "--micro-batches", "2", "--iterations", "2"]) == 2
    assert "cannot cut a chain" in capsys.readouterr().err
    assert not out.exists()
    # a directory the user made stays, with what was in it
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["run", f"{factory}:build", "--stages", "9", "--out", str(out), "--batch", "8",
                 "--micro-batches", "2", "--iterations", "2"]) == 2
    assert (out / "notes.txt").read_text() == "mine"


def test_teardown_of_a_dry_run_says_nothing_was_created(tmp_path, capsys):
    (tmp_path / "commands.sh").write_text("#!/usr/bin/env bash\n")
    assert main(["teardown", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "dry run" in out and "nothing to remove" in out


def test_a_shard_the_model_cannot_take_is_refused_naming_the_shard_before_anything_starts(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    shards = tmp_path / "shards"
    shards.mkdir()
    save_file({"x": torch.randn(16, 4, 16, 16), "target": torch.randint(0, 10, (16,))},
              str(shards / "part-0.safetensors"))
    out = tmp_path / "run"
    assert main(["run", "tiny-resnet", "--data", str(shards), "--batch", "8", "--micro-batches", "2",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "part-0.safetensors" in err and "channels" in err and "x (rows, 4, 16, 16)" in err
    assert "Traceback" not in err and not out.exists()


def test_a_profile_warning_is_one_logger_line_in_the_command_lines_words(caplog, capsys):
    """Issue 41: the same ProfileWarning on nearly every command, as a Python source line and
    in Python terms (ProfileOptions(batch_sizes=...)) that run and demo users cannot act on."""
    from types import SimpleNamespace

    from flatpack.cli import warnings_through_the_logger
    from flatpack.profiler import _warn_flat_slopes

    flat = SimpleNamespace(slopes_trusted=False, layers=[], flat_slopes=("layer 1 (2:linear): backward",),
                           batch_sizes=(2, 4, 8))
    with caplog.at_level(logging.WARNING, logger="flatpack"), warnings_through_the_logger():
        for _ in range(3):
            _warn_flat_slopes(flat)   # type: ignore[arg-type]
    said = [record.getMessage() for record in caplog.records if "did not grow" in record.getMessage()]
    assert len(said) == 1
    assert "--batch" in said[0] and "ProfileOptions" not in said[0] and "flat_slopes" not in said[0]
    assert "warnings.warn" not in capsys.readouterr().err
