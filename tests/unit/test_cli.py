"""The command line: inspect, profile, platforms, compile, demo."""

from __future__ import annotations

import json

import pytest

import flatpack
from flatpack.cli import main

FACTORY = '''
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, (torch.randn(4, 8),)
'''


@pytest.fixture
def factory(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(FACTORY)
    return f"{path}:build"


def test_inspect_prints_the_chain_and_writes_json(factory, tmp_path, capsys):
    assert main(["inspect", factory, "--json", str(tmp_path / "chain.json")]) == 0
    printed = capsys.readouterr().out
    assert "frontend: fx   layers: 3" in printed
    assert "linear, relu" in printed and "4×8 float32" in printed
    chain = json.loads((tmp_path / "chain.json").read_text())
    assert [layer["boundary"]["bytes"] for layer in chain["layers"]] == [128, 128, 32]


def test_compile_writes_stage_directories(factory, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compile", factory, "--stages", "3", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["flatpack.index.json", "flatpack.json", "plan.json",
                                                      "stage_000", "stage_001", "stage_002"]
    printed = capsys.readouterr().out
    assert "wrote 3 stages" in printed
    digest = flatpack.load(out).digest
    assert f"digest {digest}" in printed
    assert main(["check", str(out), "--digest", digest]) == 0
    assert main(["check", str(out), "--digest", "0" * 64]) == 2
    assert "expected digest" in capsys.readouterr().err


def test_errors_are_one_line_with_exit_code_2(factory, tmp_path, capsys):
    assert main(["compile", factory, "--stages", "9", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert any(line.startswith("flatpack: error: cannot cut a chain of 3 layers into 9 stages")
               for line in err.splitlines())
    assert main(["inspect", "no_such_file.py:build"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_profile_prints_every_layer_and_reports_the_cache_hit(factory, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLATPACK_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "profile.json"
    assert main(["profile", factory, "--batch-sizes", "1,2", "--repeats", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "measured in" in printed and printed.count(":linear") == 3
    assert len(json.loads(out.read_text())["layers"]) == 3
    assert main(["profile", factory, "--batch-sizes", "1,2", "--repeats", "1"]) == 0
    assert "profile: cache hit" in capsys.readouterr().out


def test_profile_refuses_bad_batch_sizes(factory, capsys):
    assert main(["profile", factory, "--batch-sizes", "0,2"]) == 2
    assert "positive integers" in capsys.readouterr().err


def test_platforms_lists_the_catalog_and_refuses_unknown_names(capsys):
    assert main(["platforms"]) == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in ("aws-lambda", "alibaba-fc", "gpu-container", "local"))
    assert main(["platforms", "--json", "aws-lambda"]) == 0
    (lambda_json,) = json.loads(capsys.readouterr().out)
    assert lambda_json["max_memory_mb"] == 10240 and lambda_json["sources"]
    assert main(["platforms", "nope"]) == 2
    assert "known platforms" in capsys.readouterr().err


def test_zoo_models_use_their_own_pipeline_unless_passes_are_given():
    from flatpack.cli import build_parser, pipeline_for
    from flatpack.zoo import ZOO

    parse = build_parser().parse_args
    assert pipeline_for(parse(["inspect", "amoebanet-d18"])) == ZOO["amoebanet-d18"].passes
    assert pipeline_for(parse(["inspect", "amoebanet-d18", "--passes", "fuse-elementwise"])) == "fuse-elementwise"
    assert pipeline_for(parse(["inspect", "vgg11"])) is None


def test_inspect_builds_a_zoo_model(capsys):
    assert main(["inspect", "alexnet"]) == 0
    assert "features:conv2d" in capsys.readouterr().out


def test_version_and_the_exit_codes_are_in_the_help(capsys):
    from flatpack.version import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"flatpack {__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    printed = capsys.readouterr().out
    assert "exit codes: 0 success; 1 a run failed" in printed and "2 bad input" in printed and "--config" in printed


def test_a_config_file_gives_the_verbs_defaults_and_the_command_line_wins(tmp_path):
    from flatpack import cli

    config = tmp_path / "run.toml"
    config.write_text('batch = 64\nmicro-batches = 8\nreplicas = [1, 2]\nschedule = "1f1b"\nno_verify = true\n')
    args = cli.parse_arguments(cli.build_parser(), ["run", "mlp", "--config", str(config), "--batch", "32"])
    settings = (args.batch, args.micro_batches, args.replicas, args.schedule, args.no_verify)
    assert settings == (32, 8, "1,2", "1f1b", True)


@pytest.mark.parametrize("text, words", [
    ("micro-batchs = 8", "did you mean micro-batches"),
    ("batch = 6.5", "'batch' takes a whole number"),
    ('schedule = "gpipe"', "must be one of sync, 1f1b"),
    ('no-verify = "yes"', "is a switch"),
    ("batch = ", "is not valid TOML"),
])
def test_a_bad_config_file_exits_2_naming_the_key(text, words, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(text + "\n")
    assert main(["run", "mlp", "--config", str(config)]) == 2
    assert words in capsys.readouterr().err


def test_a_run_that_fails_exits_1_and_bad_input_exits_2(monkeypatch, capsys):
    from flatpack.cli import training
    from flatpack.errors import FunctionOutOfMemory, InputError

    def out_of_memory(args):
        raise FunctionOutOfMemory("stage 0 replica 0 ran out of memory", stage=0, replica=0, peak_bytes=2,
                                  limit_bytes=1)

    monkeypatch.setattr(training, "cmd_run", out_of_memory)
    assert main(["run", "mlp"]) == 1
    assert "flatpack: error: run failed: stage 0 replica 0 ran out of memory" in capsys.readouterr().err
    monkeypatch.setattr(training, "cmd_run", lambda args: (_ for _ in ()).throw(InputError("--batch must be positive")))
    assert main(["run", "mlp"]) == 2
    assert "flatpack: error: --batch must be positive" in capsys.readouterr().err
