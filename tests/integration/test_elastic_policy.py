"""``flatpack run --elastic auto`` and ``train(elastic=ElasticPolicy(...))``
(``backends.elastic_policy``): on a deliberately mis-sized first plan the policy changes the
replica degrees, logs each decision with its predicted and measured effect, and the run ends
with the weights of a run that follows the same plans fixed in advance (``--replan`` with
the sequence forced)."""

from __future__ import annotations

import json

import pytest
import torch

import flatpack
from flatpack import cli
from flatpack.analysis.refit import Replan
from flatpack.backends import local
from flatpack.backends.elastic_policy import ElasticPolicy
from flatpack.backends.replan import ReplanPolicy
from flatpack.errors import InputError
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.workload import Workload
from tests.integration.test_local_training import BATCH, batches, compiled_with, make_model, run_and_compare

pytestmark = pytest.mark.slow

MICRO_BATCHES, EPOCH, ITERATIONS = 4, 4, 20
# 2 fixed stages × 2 replicas of a model whose sync costs more than its compute: the policy
# may go down to 1 replica and up to 4; in dollars (2 workers instead of 4) the model prices
# 1 replica some 50-75 % cheaper, where its error on this run, once re-fitted, is a few tens
# of percent on a loaded host (the first boundary weighs the compile-time model's, 80-90 % off)
RUN = ["run", "mlp", "--stages", "2", "--replicas", "2", "--micro-batches", str(MICRO_BATCHES), "--iterations",
       str(ITERATIONS), "--epoch-iterations", str(EPOCH)]
ELASTIC = ["--elastic", "auto", "--elastic-objective", "dollars", "--elastic-replicas", f"1,{MICRO_BATCHES}"]


def _weights(path) -> dict[str, torch.Tensor]:
    return flatpack.load_state_dict(path)


def test_elastic_auto_changes_replicas_and_ends_as_the_same_plans_fixed_in_advance(tmp_path, capsys, monkeypatch):
    elastic_dir, fixed_dir = tmp_path / "elastic", tmp_path / "fixed"
    code = cli.main([*RUN, *ELASTIC, "--out", str(elastic_dir)])
    out = capsys.readouterr().out
    assert code == 0, out
    decisions = json.loads((elastic_dir / "events.json").read_text())["decisions"]
    assert len(decisions) == ITERATIONS // EPOCH - 1
    changed = [d for d in decisions if d["changed"]]
    assert any(d["degrees_before"] != d["degrees_after"] for d in changed), out
    # fixed cuts (--stages): the policy changes degrees only
    assert all(Plan.from_json(d["new_plan"]).ranges == Plan.from_json(d["old_plan"]).ranges for d in decisions)
    for decision in changed:
        # predicted, then measured on the epoch after
        assert decision["new_predicted_dollars"] < decision["old_predicted_dollars"]
        assert decision["saving"] > decision["model_error"] and decision["measured_after_s"] is not None
        assert f"measured {decision['measured_before_s'] * 1000:.1f} ms before, " \
               f"{decision['measured_after_s'] * 1000:.1f} ms after" in out
    assert "more than the model's own error on this run" in out
    assert "equivalence with single-process training: passed" in out

    # the same plans, fixed in advance: --replan with each boundary's plan forced
    sequence = iter(decisions)

    def fixed(self, compiled, events):
        decision = next(sequence)
        new = Plan.from_json(decision["new_plan"]) if decision["changed"] else compiled.plan
        return Replan(compiled.plan, new, 1.0, 0.5 if decision["changed"] else 1.0, 1.0, None)  # type: ignore[arg-type]

    monkeypatch.setattr(ReplanPolicy, "proposal", fixed)
    code = cli.main([*RUN, "--replan", "--out", str(fixed_dir)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert next(sequence, None) is None
    elastic, replanned = _weights(elastic_dir / "trained.safetensors"), _weights(fixed_dir / "trained.safetensors")
    assert elastic.keys() == replanned.keys()
    for name, value in elastic.items():
        assert torch.equal(value, replanned[name]), name


def test_a_policy_that_may_change_the_cuts_ends_where_single_process_training_ends(s3_server):
    """Python's ElasticPolicy with the cuts free: whatever it decides on this host, each
    decision is its rule's (changed exactly when the saving beat the run's error) and the run
    ends with the single-process reference's weights and losses."""
    decided = []
    policy = ElasticPolicy(objective="dollars", on_decision=decided.append)
    result = run_and_compare(s3_server, _profiled([2, 2]), batches(12), 12, "adam", micro_batches=MICRO_BATCHES,
                             epoch_iterations=EPOCH, elastic=policy)
    assert decided == result.decisions and len(result.decisions) == 2
    for decision in result.decisions:
        assert decision.changed == (decision.saving > decision.model_error)
        assert decision.measured_after_s is not None
    assert [s.iteration for s in result.switches] == [d.iteration for d in result.decisions if d.changed]


def _profiled(replicas: list[int]) -> flatpack.Compiled:
    plan = compiled_with(make_model(), [(0, 50), (50, 100)], replicas, MICRO_BATCHES, memory_mb=1024).plan
    return flatpack.compile(make_model(), (torch.randn(BATCH, 8),), plan=plan, profile=True,
                            workload=Workload(batch=BATCH, micro_batches=MICRO_BATCHES, optimizer="adam"))


@pytest.mark.parametrize(("replicas", "options", "cause"), [
    ([2, 2], {"schedule": "1f1b-async"}, "1f1b-async"),
    ([1, 1], {"replan": True}, "give one of them"),
    ([1, 1], {"epoch_iterations": 2}, "at least 3"),
    ([2, 2], {"elastic": ElasticPolicy(max_replicas=1)}, "outside the elastic policy"),
])
def test_elastic_policy_refusals_name_cause_and_fix(s3_server, replicas, options, cause):
    compiled = _profiled(replicas)
    options = {"elastic": ElasticPolicy(), "epoch_iterations": 3, **options}
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        with pytest.raises(InputError, match=cause):
            deployment.train(batches(6), iterations=6, micro_batches=MICRO_BATCHES, **options)
        assert deployment.calls() == []    # refused before launch


def test_an_artifact_read_back_cannot_be_scaled_by_a_policy(s3_server, tmp_path):
    loaded = flatpack.load(_profiled([1, 1]).save(tmp_path / "compiled"))
    with local.deploy(loaded, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        with pytest.raises(InputError, match="flatpack.load"):
            deployment.train(batches(6), iterations=6, micro_batches=MICRO_BATCHES, epoch_iterations=3,
                             elastic=ElasticPolicy())
