"""``flatpack run`` trains a model with dropout on, and its verdict compares the run exactly:
the reference runs the compiled stages seeded as the workers seed each stage's forward
(``reference.StageSeeds``), so it draws the run's masks."""

from __future__ import annotations

import re
from pathlib import Path

from flatpack.cli import main

MODEL = f"{Path(__file__).with_name('dropout_model.py')}:mlp_with_dropout"


def run(tmp_path: Path, capsys, *extra: str) -> str:
    assert main(["run", MODEL, "--stages", "2", "--replicas", "2", "--batch", "16", "--micro-batches", "4",
                 "--iterations", "3", "--optimizer", "adam", "--out", str(tmp_path / "run"), *extra]) == 0
    return capsys.readouterr().out


def test_a_model_with_dropout_on_trained_in_2_stages_of_2_replicas_is_equivalent(tmp_path, capsys):
    printed = run(tmp_path, capsys)
    assert "passed: equivalent (2 stages, replicas 2,2, 4 micro-batches, 3 iterations" in printed, printed[-3000:]
    assert "dropout on (p > 0 in 2 modules): the reference ran the compiled stages seeded" in printed
    # the weights are held to Adam's step bound, not to a looser one: dropout did not widen it
    assert re.search(r"ok +weights: max [0-9.e+-]+ .*\(bound 2·lr·Σc_t", printed), printed[-3000:]


def test_the_asynchronous_schedule_with_dropout_on_is_equivalent(tmp_path, capsys):
    printed = run(tmp_path, capsys, "--schedule", "1f1b-async", "--replicas", "1")
    assert "passed: equivalent (2 stages, replicas 1,1, 4 micro-batches, 3 iterations" in printed, printed[-3000:]
    assert "dropout on (p > 0 in 2 modules)" in printed
