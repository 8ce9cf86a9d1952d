"""``--json`` on every verb that reports (one JSON document on stdout instead of the text
report, diagnostics on stderr) and ``-v``/``-q`` (the flatpack logger's level on stderr).
run, demo and deploy --json: tests/integration/test_demo.py and test_deploy_cli.py."""

from __future__ import annotations

import json

import pytest

import flatpack
from flatpack.backends.cloud import Ledger
from flatpack.cli import build_parser, main
from flatpack.cli.parser import option_strings, verb_parsers
from flatpack.rundir import RunDirectory, RunRecord

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


def json_of(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)      # stdout holds the document alone


def test_inspect_compile_sign_and_check_print_json(factory, tmp_path, capsys, monkeypatch):
    chain = json_of(capsys, "inspect", factory, "--json")
    assert [layer["boundary"]["bytes"] for layer in chain["layers"]] == [128, 128, 32]
    out = tmp_path / "out"
    compiled = json_of(capsys, "compile", factory, "--stages", "3", "--out", str(out), "--json")
    assert compiled["digest"] == flatpack.load(out).digest and compiled["stages"] == 3
    assert len(compiled["plan"]["stages"]) == 3 and len(compiled["chain"]["layers"]) == 3
    monkeypatch.setenv("FLATPACK_TEST_KEY", "a-test-key-of-32-characters-long")
    signed = json_of(capsys, "sign", str(out), "--key", "env:FLATPACK_TEST_KEY", "--name", "mlp", "--version", "1",
                     "--json")
    assert signed["digest"] == compiled["digest"] and signed["signature"].startswith(str(out))
    checked = json_of(capsys, "check", str(out), "--digest", compiled["digest"], "--json")
    assert checked["digest"] == compiled["digest"] and checked["files"] > 3 and checked["trust"] != "directory"


def test_profile_and_plan_print_json_and_keep_their_file_variant(factory, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLATPACK_CACHE_DIR", str(tmp_path / "cache"))
    profile = json_of(capsys, "profile", factory, "--batch-sizes", "1,2", "--repeats", "1", "--json")
    assert len(profile["layers"]) == 3
    # --json FILE: the text report on stdout, the document in FILE, "wrote FILE" a diagnostic
    assert main(["profile", factory, "--batch-sizes", "1,2", "--repeats", "1", "--json", str(tmp_path / "p.json")]) == 0
    captured = capsys.readouterr()
    assert "profile: cache hit" in captured.out and f"wrote {tmp_path / 'p.json'}" in captured.err
    assert json.loads((tmp_path / "p.json").read_text()) == profile
    plan = json_of(capsys, "plan", factory, "--batch-sizes", "1,2", "--repeats", "1", "--replicas", "1",
                   "--memory", "1024", "--json")
    assert plan["plans"] and plan["model"] == factory


def test_platforms_resume_and_teardown_print_json(tmp_path, capsys):
    (platform,) = json_of(capsys, "platforms", "--json", "local")
    assert platform["name"] == "local"
    run = RunDirectory(tmp_path / "run")
    run.root.mkdir()
    run.write(RunRecord(run="run-x", loss="mse", iterations=2, state="done"))
    resumed = json_of(capsys, "resume", str(run.root), "--json")
    assert resumed == {"run_dir": str(run.root), "state": "done", "resumed_after": None, "iterations": 0,
                       "final_loss": None, "trained_path": str(run.trained_path)}
    Ledger(target="aws-lambda", name="fp-none", region="us-east-1").save(tmp_path / "deployed")
    torn = json_of(capsys, "teardown", str(tmp_path / "deployed"), "--json")
    assert torn == {"name": "fp-none", "target": "aws-lambda", "region": "us-east-1", "removed": []}


def test_every_verb_that_reports_takes_json():
    parser = build_parser()
    verbs = verb_parsers(parser)
    reporting = {"inspect", "compile", "sign", "check", "profile", "plan", "platforms", "run", "resume", "deploy",
                 "teardown", "demo", "calibrate"}
    missing = [verb for verb in reporting & set(verbs)
               if "--json" not in option_strings(verbs[verb])]
    assert missing == []


def test_verbosity_sets_what_reaches_stderr_wherever_it_is_given(factory, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLATPACK_CACHE_DIR", str(tmp_path / "cache"))
    profile = ["profile", factory, "--batch-sizes", "1,2", "--repeats", "1", "--json", str(tmp_path / "p.json")]
    assert main(profile) == 0
    default = capsys.readouterr().err
    assert "wrote" in default and "[flatpack." not in default           # INFO, no debug lines
    assert main([*profile, "-v"]) == 0                                   # after the verb
    verbose = capsys.readouterr().err
    assert "[flatpack.profiler] profile of 3 layers loaded from cache" in verbose
    assert main(["-q", *profile]) == 0                                   # before it
    # nothing but a warning, which -q keeps (a flat-slope profile warning, when the host's noise makes one)
    assert all(line.startswith("flatpack: warning:") for line in capsys.readouterr().err.splitlines())
    # warnings stay with -q
    out = tmp_path / "out"
    assert main(["compile", factory, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["check", str(out), "--quiet"]) == 0
    assert "flatpack: warning: the index itself was trusted only as far as this directory" in capsys.readouterr().err


def test_help_documents_verbosity_and_json(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "-v, --verbose" in text and "-q, --quiet" in text
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    assert "--json" in capsys.readouterr().out
