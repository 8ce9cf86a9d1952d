"""The learning solvers against the exact optimum: ``rl`` (Gillis §IV-C REINFORCE, with and
without its local-search polish) and ``bayes`` (CherryPick-style GP + EI) at equal wall-time
budgets, on zoo models, each goal's optimum given by ``dp`` (exact).

    python benchmarks/learning_solvers.py                      # the table in BENCHMARKS.md
    python benchmarks/learning_solvers.py --quick              # one model of each kind, one seed
    python benchmarks/learning_solvers.py --budget 30 --seeds 0,1,2,3,4

Problems (full-size zoo models, traced, profiled once and cached by the profiler):

* inference (Gillis §V-C): VGG-11, VGG-16 and WRN-50-4 serving one request on aws-lambda,
  fork-join over up to 8 workers; chains coarsened by time to at most ``--infer-layers``;
  two SLOs per model, as Gillis's restrictive and loose T_max: ``--slos`` times the fastest
  plan's latency (dp's time-only optimum);
* training (FuncPipe §5): BERT-Large and AmoebaNet-D36 at global batch 64 in M = 16
  micro-batches, d ∈ {1, 2, 4, 8, 16}, FuncPipe's 8 Lambda tiers, chains coarsened to
  ``--train-layers``; goals FuncPipe's weight pairs (1, 2¹⁶) and (1, 2²²), and the cheapest
  plan within 1.5× the fastest iteration.

Per (problem, goal): dp's own solve seconds; per (problem, goal, solver), over ``--seeds``
(each solve in a forked child, killed at 3 × budget + 60 s): the median gap of the goal's
objective to the exact optimum (SLO goals: dollars; weighted goals: α₁·MB·s + α₂·s), how many
runs returned a plan that fits and meets the SLO, the median solve seconds, the median plans
priced, and the plan's allocated memory (Σ tier × degree over stages) over the exact plan's —
FuncPipe's "BO over-provisions memory".
A solver that returns no plan has no gap; its run counts as a miss.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # ``python benchmarks/learning_solvers.py`` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.solvers import BATCH, MICRO_BATCHES, TIMED_OUT, base_chain, in_child, problem_at

INFER_MODELS = ("vgg11", "vgg16", "wrn50-4")
TRAIN_MODELS = ("bert-large", "amoebanet-d36")
TRAIN_WEIGHTS = ((1.0, 2.0 ** 16), (1.0, 2.0 ** 22))
TRAIN_SLO = 1.5


@dataclasses.dataclass
class Case:
    model: str
    mode: str
    layers: int
    problem: Any
    goal: Any
    optimum: Any          # dp's plan
    label: str
    exact_s: float        # dp's solve seconds


def exact_case(model: str, mode: str, problem, goal, label: str) -> Case:
    from flatpack.partitioner.solvers.dp import Dp

    started = time.perf_counter()
    optimum = Dp().solve(problem, goal)
    return Case(model, mode, len(problem.chain), problem, goal, optimum, label, time.perf_counter() - started)


def fastest_s(problem, fastest_goal) -> float:
    """dp's fastest plan's predicted seconds: the scale the SLOs are set on."""
    from flatpack.partitioner.solvers.dp import Dp

    plan = Dp().solve(problem, fastest_goal)
    if plan is None:
        raise SystemExit(f"dp found no plan for {len(problem.chain)} layers: no SLO can be set on it")
    return plan.predictions["time_s"]


def cases(args, infer_profile, train_profile) -> list[Case]:
    from flatpack.partitioner.objective import Weights
    from flatpack.partitioner.solvers.base import Goal
    from flatpack.partitioner.workload import Workload

    found = []
    fastest_goal = Goal(Weights(0.0, 1.0))
    for name in args.infer_models:
        base = base_chain(name, 1, infer_profile)
        problem = problem_at(base, args.infer_layers, infer_profile, Workload("infer", batch=1), max_workers=8)
        fastest = fastest_s(problem, fastest_goal)
        print(f"{name}: {base.layers} layers → {len(problem.chain)}; fastest request {fastest * 1e3:.0f} ms",
              flush=True)
        for factor in args.slos:
            slo_s = factor * fastest
            label = f"SLO {factor:g}× = {slo_s * 1e3:.0f} ms"
            found.append(exact_case(name, "infer", problem, Goal(slo_s=slo_s), label))
    for name in args.train_models:
        base = base_chain(name, BATCH // MICRO_BATCHES, train_profile)
        problem = problem_at(base, args.train_layers, train_profile)  # solvers.py's training space
        fastest = fastest_s(problem, fastest_goal)
        print(f"{name}: {base.layers} layers → {len(problem.chain)}; fastest iteration {fastest:.2f} s", flush=True)
        goals = [(Goal(Weights(*pair)), f"weights {Weights(*pair).label()}") for pair in TRAIN_WEIGHTS]
        goals.append((Goal(slo_s=TRAIN_SLO * fastest), f"SLO {TRAIN_SLO:g}× = {TRAIN_SLO * fastest:.2f} s"))
        for goal, label in goals:
            found.append(exact_case(name, "train", problem, goal, label))
    return found


def solver_for(name: str, budget_s: float, seed: int):
    from flatpack.partitioner.solvers.bayes import Bayes
    from flatpack.partitioner.solvers.rl import Rl

    if name == "rl":
        return Rl(episodes=10 ** 9, patience=10 ** 9, time_limit_s=budget_s, seed=seed, warm_start=False)
    if name == "rl-pure":
        return Rl(episodes=10 ** 9, patience=10 ** 9, time_limit_s=budget_s, seed=seed, warm_start=False,
                  polish=False)
    if name == "bayes":
        return Bayes(evaluations=10 ** 6, time_limit_s=budget_s, seed=seed)
    raise ValueError(f"unknown solver {name!r}")


def objective(case: Case, plan) -> float | None:
    """The goal's primary score of ``plan`` (None: it misses the SLO or overflows)."""
    from flatpack.partitioner.objective import evaluate

    evaluation = evaluate(case.problem, plan)
    if not evaluation.fits:
        return None
    score = case.goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)
    return None if score is None else score[0]


def allocated_mb(plan) -> float:
    return sum(stage.memory_mb * stage.replicas for stage in plan.stages)


def run_one(case: Case, solver_name: str, seed: int, budget_s: float) -> dict:
    solver = solver_for(solver_name, budget_s, seed)
    started = time.perf_counter()
    plan = solver.solve(case.problem, case.goal)
    seconds = time.perf_counter() - started
    if plan is None:
        return {"plan": None, "seconds": seconds}
    return {"plan": plan, "seconds": seconds, "score": objective(case, plan), "priced": plan.predictions["samples"]}


def summarize(case: Case, solver_name: str, runs: list[dict]) -> dict:
    best = objective(case, case.optimum)
    ok = [run for run in runs if isinstance(run, dict) and run.get("score") is not None]
    gaps = [(run["score"] / best - 1) * 100 for run in ok]
    return {
        "gap": statistics.median(gaps) if gaps else None,
        "worst": max(gaps) if gaps else None,
        "met": f"{len(ok)}/{len(runs)}",
        "seconds": statistics.median(run["seconds"] for run in ok) if ok else None,
        "priced": statistics.median(run["priced"] for run in ok) if ok else None,
        "memory": (statistics.median(allocated_mb(run["plan"]) for run in ok) / allocated_mb(case.optimum)
                   if ok else None),
    }


def fmt(value, pattern: str) -> str:
    return "—" if value is None else format(value, pattern)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--infer-models", default=",".join(INFER_MODELS))
    parser.add_argument("--train-models", default=",".join(TRAIN_MODELS))
    parser.add_argument("--infer-layers", type=int, default=24)
    parser.add_argument("--train-layers", type=int, default=16)
    parser.add_argument("--slos", default="1.2,2", help="inference SLOs as multiples of the fastest latency")
    parser.add_argument("--solvers", default="rl,rl-pure,bayes")
    parser.add_argument("--budget", type=float, default=20.0, help="wall seconds per solve (time_limit_s)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--quick", action="store_true", help="vgg11 and bert-large, one seed, 10 s")
    parser.add_argument("--profile-batches", default="1,2", help="inference profile batch sizes")
    parser.add_argument("--train-profile-batches", default="2,4", help="training profile micro-batch sizes")
    args = parser.parse_args(argv)
    split = lambda text: [item.strip() for item in text.split(",") if item.strip()]  # noqa: E731
    args.infer_models, args.train_models, args.solvers = split(args.infer_models), split(args.train_models), \
        split(args.solvers)
    args.slos = [float(value) for value in split(args.slos)]
    seeds = [int(value) for value in split(args.seeds)]
    if args.quick:
        args.infer_models, args.train_models, seeds, args.budget = args.infer_models[:1], args.train_models[:1], \
            seeds[:1], 10.0

    import torch
    from flatpack.profiler import ProfileOptions

    print(f"host: {os.cpu_count()} cores, torch {torch.__version__}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; budget {args.budget:g} s per solve, seeds {seeds}")
    infer_profile = ProfileOptions(batch_sizes=tuple(int(b) for b in split(args.profile_batches)), repeats=1,
                                   progress=False)
    train_profile = ProfileOptions(batch_sizes=tuple(int(b) for b in split(args.train_profile_batches)), repeats=1,
                                   progress=False)
    found = cases(args, infer_profile, train_profile)
    import flatpack.partitioner.solvers.bayes  # imported once, before the children fork
    import flatpack.partitioner.solvers.rl  # noqa: F401

    header = "model | mode | L | goal | solver | median gap % | worst gap % | met SLO/fit | median s | plans priced " \
             "| memory / exact"
    print("\n" + header + "\n" + " | ".join("---" for _ in header.split(" | ")), flush=True)
    for case in found:
        print(f"{case.model} | {case.mode} | {case.layers} | {case.label} | dp (exact) | 0.0 | 0.0 | 1/1 | "
              f"{case.exact_s:.2f} | — | 1.00", flush=True)
        for solver_name in args.solvers:
            runs = []
            for seed in seeds:
                result = in_child(lambda: run_one(case, solver_name, seed, args.budget), 3 * args.budget + 60)
                if result == TIMED_OUT or (isinstance(result, tuple) and result[0] == "error"):
                    print(f"  {case.model} {case.label} {solver_name} seed {seed}: {result}", flush=True)
                    result = {"plan": None, "seconds": None}
                runs.append(result)
            row = summarize(case, solver_name, runs)
            print(f"{case.model} | {case.mode} | {case.layers} | {case.label} | {solver_name} | "
                  f"{fmt(row['gap'], '.1f')} | {fmt(row['worst'], '.1f')} | {row['met']} | "
                  f"{fmt(row['seconds'], '.1f')} | "
                  f"{fmt(row['priced'], ',.0f')} | {fmt(row['memory'], '.2f')}", flush=True)
    print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")



if __name__ == "__main__":
    main()
