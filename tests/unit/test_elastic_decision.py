"""The elastic policy's decision rule (``backends.elastic_policy``): a plan is changed only
when its predicted saving, by the policy's objective, exceeds the model's own error on the
run; degrees stay within the policy's floor and ceiling and at most the micro-batches; each
decision says what it predicted and, after the next epoch, what it measured, and is marked on
the timeline (Gantt chart and Chrome trace)."""

from __future__ import annotations

import json

import pytest

from flatpack.backends.elastic_policy import (ElasticDecision, ElasticPolicy, EpochMeasure, Priced, run_error,
                                              with_degree)
from flatpack.errors import InputError
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.runtime.timeline import Event, Mark

MICRO_BATCHES = 4


def plan(*degrees: int) -> Plan:
    """Two stages of a 4-layer chain at ``degrees`` (one degree: every stage)."""
    pairs = degrees if len(degrees) == 2 else degrees * 2
    return Plan((StagePlan(0, 1, 1024, pairs[0]), StagePlan(2, 3, 1024, pairs[1])), 4)


def priced(degree: int, seconds: float, dollars: float) -> Priced:
    return Priced(plan(degree), seconds, dollars)


CURRENT = priced(2, 1.0, 4.0)


def test_a_saving_above_the_models_error_changes_the_plan_and_one_within_it_keeps_it():
    faster = priced(1, 0.7, 1.4)      # 30 % faster
    changed = ElasticPolicy().decide(CURRENT, [faster], error=0.2, micro_batches=MICRO_BATCHES)
    assert changed.changed and changed.chosen == faster and changed.saving == pytest.approx(0.3)
    assert "more than the model's own error on this run (20.0%)" in changed.reason
    kept = ElasticPolicy().decide(CURRENT, [faster], error=0.35, micro_batches=MICRO_BATCHES)
    assert not kept.changed and kept.chosen == CURRENT and kept.best_other == faster
    assert "predicted 30.0% faster, within the model's own error on this run (35.0%)" in kept.reason


def test_the_objective_decides_between_faster_and_cheaper():
    faster_dearer = priced(4, 0.5, 8.0)    # 50 % faster, twice the dollars
    slower_cheaper = priced(1, 1.2, 1.2)   # 20 % slower, 70 % cheaper
    options = [faster_dearer, slower_cheaper]
    by_time = ElasticPolicy("time").decide(CURRENT, options, error=0.1, micro_batches=MICRO_BATCHES)
    by_dollars = ElasticPolicy("dollars").decide(CURRENT, options, error=0.1, micro_batches=MICRO_BATCHES)
    assert by_time.chosen == faster_dearer and by_time.saving == pytest.approx(0.5)
    assert by_dollars.chosen == slower_cheaper and by_dollars.saving == pytest.approx(0.7)
    assert "cheaper" in by_dollars.reason


def test_degrees_stay_within_the_floor_the_ceiling_and_the_micro_batches():
    options = [priced(1, 0.2, 0.2), priced(3, 0.3, 0.9), priced(4, 0.1, 0.4)]
    bounded = ElasticPolicy(min_replicas=2, max_replicas=3)
    assert bounded.decide(CURRENT, options, error=0.0, micro_batches=MICRO_BATCHES).chosen == options[1]
    # no ceiling given: the micro-batches are one (4 replicas cannot share 3 micro-batches)
    assert ElasticPolicy(min_replicas=2).decide(CURRENT, options, error=0.0, micro_batches=3).chosen == options[1]
    assert ElasticPolicy().ceiling(3) == 3 and ElasticPolicy(max_replicas=8).ceiling(4) == 4
    assert list(ElasticPolicy(min_replicas=2).degrees(MICRO_BATCHES)) == [2, 3, 4]
    alone = ElasticPolicy(min_replicas=2, max_replicas=2).decide(CURRENT, options, error=0.0,
                                                                 micro_batches=MICRO_BATCHES)
    assert not alone.changed and alone.best_other is None and "within 2..2" in alone.reason


def test_a_plan_the_model_prices_no_better_is_kept_and_a_tie_takes_fewer_workers():
    slower = priced(1, 1.5, 1.5)
    kept = ElasticPolicy().decide(CURRENT, [slower], error=0.0, micro_batches=MICRO_BATCHES)
    assert not kept.changed and kept.saving == pytest.approx(-0.5) and "still the fastest" in kept.reason
    tie = ElasticPolicy().decide(CURRENT, [priced(3, 0.5, 1.5), priced(1, 0.5, 0.5)], error=0.0,
                                 micro_batches=MICRO_BATCHES)
    assert tie.chosen.plan == plan(1)


def test_the_models_error_is_the_refitted_predictions_once_one_was_measured():
    compile_time = EpochMeasure(predicted_s=0.1, measured_s=0.4, refitted=False)     # 75 % off
    assert run_error([compile_time]) == pytest.approx(0.75)
    refitted = [EpochMeasure(0.4, 0.5, True), EpochMeasure(0.5, 0.5, True)]          # 20 % and 0 % off
    assert run_error([compile_time, *refitted]) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        run_error([])


@pytest.mark.parametrize(("options", "words"), [
    ({"objective": "speed"}, "one of time, dollars"),
    ({"min_replicas": 0}, "at least 1"),
    ({"min_replicas": 3, "max_replicas": 2}, "at least min_replicas"),
])
def test_a_bad_policy_is_refused_naming_the_field(options, words):
    with pytest.raises(InputError, match=words):
        ElasticPolicy(**options)


def test_with_degree_keeps_the_cuts_and_tiers():
    assert with_degree(plan(1), 3) == plan(3) and with_degree(plan(1, 2), 2).ranges == plan(1).ranges


def decision(changed: bool, measured_after: float | None = 0.3) -> ElasticDecision:
    new = plan(1) if changed else plan(2)
    return ElasticDecision(7, "dollars", plan(2), new, 0.4, 0.25, 4e-5, 1.2e-5, 0.7 if changed else 0.05, 0.1,
                           "the reason", 0.4,
                           "run-x-plan1", measured_after, at=100.5)


def test_a_decision_says_what_it_predicted_and_then_measured():
    changed = decision(True)
    text = changed.describe()
    assert "after iteration 7: changed [layers 0-1 × 2 | layers 2-3 × 2] to [layers 0-1 × 1 | layers 2-3 × 1]" in text
    assert "predicted 400.0 -> 250.0 ms" in text and "measured 400.0 ms before, 300.0 ms after" in text
    document = json.loads(json.dumps(changed.to_json()))
    assert document["degrees_before"] == [2, 2] and document["degrees_after"] == [1, 1] and document["changed"]
    assert document["measured_after_dollars"] == pytest.approx(0.3 * 1.2e-5 / 0.25)
    assert "not measured yet" in decision(False, None).describe() and not decision(False).changed
    assert decision(False).mark().label == "elastic after 7: kept ×(2, 2), 5% ≤ 10% error"


def test_decisions_are_marked_on_the_gantt_chart_and_the_chrome_trace(tmp_path):
    from flatpack.analysis import chrome_trace

    events = [Event(0, 0, 0, "forward", 100.0, 100.5, micro_batch=0), Event(0, 0, 1, "forward", 101.0, 101.5,
                                                                            micro_batch=0)]
    assert decision(True).mark().label == "elastic after 7: ×(2, 2) -> ×(1, 1), 70% > 10% error"
    marks = [decision(True).mark(), Mark(101.2, "re-planned after 0: ×1 | ×1")]
    document = json.loads(chrome_trace.write(events, tmp_path / "timeline.json", marks=marks).read_text())
    instants = [e for e in document["traceEvents"] if e["ph"] == "i"]
    assert [(e["ts"], e["name"]) for e in instants] == [(500000.0, marks[0].label), (1200000.0, marks[1].label)]
    pytest.importorskip("matplotlib")
    from flatpack.analysis import gantt

    drawn = gantt.figure(events, marks=marks)
    labels = [text.get_text().strip() for text in drawn.axes[0].texts]
    assert marks[0].label in labels and marks[1].label in labels
    assert gantt.plot(events, tmp_path / "timeline.png", marks=marks).stat().st_size > 0
