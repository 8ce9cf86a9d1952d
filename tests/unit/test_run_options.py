"""``flatpack run``'s options are declared once (flatpack/cli/run_options.py): every JobOptions
field has exactly one flag and every flag one field, the argparse groups are JobOptions's
groups, an option not given keeps JobOptions's default, and the values are converted as the
fields take them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from flatpack import cli
from flatpack.cli.parser import declared, option_strings, verb_parsers
from flatpack.cli.run_options import GROUP_TITLES, RUN_OPTIONS, job_values
from flatpack.errors import InputError
from flatpack.job_options import GROUPS, JobOptions, option_names

# the run verb's options that are not JobOptions's: what to train and where
VERB_LEVEL = {"-h", "--help", "--size", "--json", "--config"}


def _run_parser():
    return verb_parsers(cli.build_parser())["run"]


def test_every_job_option_has_exactly_one_flag_and_every_flag_one_field():
    fields = [(group, f.name) for group, cls in GROUPS.items() for f in dataclasses.fields(cls)]
    declared_fields = [(option.group, option.field) for option in RUN_OPTIONS]
    assert sorted(declared_fields) == sorted(fields)
    assert len(set(declared_fields)) == len(declared_fields) == len(option_names())
    flags = [option.flag for option in RUN_OPTIONS]
    assert len(set(flags)) == len(flags)
    # and the parser holds exactly the table's flags beside the verb's own
    assert option_strings(_run_parser()) - VERB_LEVEL == set(flags)


def test_the_argparse_groups_are_job_options_groups():
    assert list(GROUP_TITLES) == list(GROUPS)
    help_text = _run_parser().format_help()
    positions = [help_text.index(f"\n{title}:\n") for title in GROUP_TITLES.values()]
    assert positions == sorted(positions)
    batch_at = help_text.index("  --batch BATCH", positions[0])      # after the usage line
    micro_at = help_text.index("  --micro-batches", positions[0])
    assert positions[0] < batch_at < positions[1] < micro_at < positions[2]


def test_an_option_not_given_keeps_job_options_default():
    args = cli.parse_arguments(cli.build_parser(), ["run", "mlp"])
    assert job_values(args) == {}
    assert JobOptions.of(**job_values(args)) == JobOptions()
    run_flags = {option.dest for option in RUN_OPTIONS}
    assert not run_flags & set(vars(args))


def test_values_are_converted_as_the_fields_take_them():
    argv = ["run", "mlp", "--no-verify", "--no-shuffle", "--data", "shards/", "--replicas", "1,4", "--memory", "512",
            "--split-points", "a, b", "--optimizer-args", "weight_decay=0.1", "--out", "o", "--save", "w.safetensors",
            "--calibration", "c.json", "--batch", "16", "--schedule", "1f1b"]
    options = JobOptions.of(**job_values(cli.parse_arguments(cli.build_parser(), argv)))
    assert (options.output.verify, options.batches.shuffle, options.batches.data) == (False, False, "shards/")
    assert (options.plan.replicas, options.plan.memory_mb, options.plan.split_points) == ((1, 4), (512,), ("a", "b"))
    assert options.train.optimizer_args == {"weight_decay": 0.1} and options.train.schedule == "1f1b"
    assert (options.output.out, options.output.save, options.plan.calibration) == (Path("o"), Path("w.safetensors"),
                                                                                  Path("c.json"))
    assert options.batches.batch == 16


def test_a_config_file_sets_a_run_option_and_the_command_line_wins(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("batch = 64\nno-verify = true\nreplicas = [1, 2, 4]\n")
    args = cli.parse_arguments(cli.build_parser(), ["run", "mlp", "--config", str(config), "--batch", "8"])
    options = JobOptions.of(**job_values(args))
    assert (options.batches.batch, options.output.verify, options.plan.replicas) == (8, False, (1, 2, 4))


def test_a_flat_name_lands_in_its_group_and_an_unknown_one_is_refused():
    options = JobOptions.of(batch=8, micro_batches=2, eval_every=2, pick="fastest", save=Path("w.safetensors"))
    assert (options.batches.batch, options.train.micro_batches, options.evaluation.eval_every,
            options.plan.pick, options.output.save) == (8, 2, 2, "fastest", Path("w.safetensors"))
    assert options.with_changes(batch=4).batches.batch == 4 and options.batches.batch == 8
    with pytest.raises(InputError, match="did you mean micro_batches"):
        JobOptions.of(micro_batchs=2)


def test_train_settings_are_built_from_the_training_group():
    options = JobOptions.of(micro_batches=2, schedule="1f1b", precision="bf16", optimizer="sgd", lr=0.1, iterations=6)
    settings = options.train_settings(loss="mse", checkpoint_every=3, micro_batches=2)
    assert (settings.micro_batches, settings.schedule, settings.precision, settings.loss,
            settings.checkpoint_every, settings.threads) == (2, "1f1b", "bf16", "mse", 3, 1)
    assert settings.optimizer == options.optimizer_spec() and settings.optimizer.lr == 0.1
    assert options.train_settings(loss="mse", checkpoint_every=1, micro_batches=4).micro_batches == 4
    # unresolved: the backend takes the plan's (Plan.micro_batches_for, the one resolution)
    assert options.train_settings(loss="mse", checkpoint_every=1).micro_batches is None


def test_the_cost_model_choices_are_the_registry_s_and_a_typo_gets_a_did_you_mean(capsys):
    from flatpack.partitioner.cost.registry import models_pricing

    plan_parser = verb_parsers(cli.build_parser())["plan"]
    action = next(action for action in declared(plan_parser) if action.dest == "cost_model")
    assert action.choices == models_pricing("train", "container")
    with pytest.raises(SystemExit) as done:
        cli.main(["plan", "mlp", "--cost-model", "hydrozo"])
    assert done.value.code == 2 and "did you mean hydrozoa?" in capsys.readouterr().err


def test_deploy_s_targets_and_options_come_from_the_backends():
    from flatpack.backends import get_backend
    from flatpack.cli.cloud import cloud_options, deploy_targets

    assert deploy_targets() == ["alibaba-fc", "aws-lambda", "gpu-container"]
    assert cloud_options(get_backend("aws-lambda"), False) == ("name", "region", "bucket", "base_image", "lock")
    assert cloud_options(get_backend("alibaba-fc"), False) == ("name", "region", "bucket", "account", "namespace",
                                                               "role_arn", "base_image", "lock")
    assert cloud_options(get_backend("gpu-container"), True) == ("name", "image", "base_image", "lock", "backend")
