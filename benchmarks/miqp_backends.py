"""miqp's backend choice, measured: CP-SAT on the integer-scaled arc model with the bilinear
term kept as a product, against MIP solvers (SCIP, CBC, HiGHS through pywraplp) on the same
arc model in floating point with the product linearized (App. C technique 2 of
FuncPipe: w_a ≥ t_iter − T_ub·(1 − x_a), so that
t_iter·Q = κ·t_iter + Σ_a price_a·w_a).

Both get the same subproblem — the (M, d) of the exact optimum, the same arcs (after the same
incumbent pruning), the same valid inequalities, the exact optimum as a complete warm start
and as an objective bound — and the same time limit and thread count. Prints, per instance
and backend: status, seconds, the objective of the plan found relative to the exact optimum,
and the remaining gap. With --whole, then the whole solver (``Miqp``, every (M, d)) as a user
runs it, warm-started from dp, and cold.

Run: python benchmarks/miqp_backends.py [--layers 8 16 32] [--seeds 2] [--limit 60] [--whole]
     python benchmarks/miqp_backends.py --replicas 1 --reference miqp --cold   # (M, d) = (4, 1), cold
"""

from __future__ import annotations

import argparse
import math
import random
import time

from flatpack.ir.profile import HostInfo, LayerProfile, Linear
from flatpack.partitioner.objective import Weights, dollars_per_mb_s
from flatpack.partitioner.options import ProblemOptions
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import ChainLayer, Problem
from flatpack.partitioner.solvers import miqp
from flatpack.partitioner.solvers.base import Goal
from flatpack.partitioner.workload import Workload
from flatpack.units import MIB
from flatpack.platform.catalog import Platform, Tier

# Lambda-like: price proportional to memory; more memory, more CPU share and bandwidth
TIERS = [(128, 1, 20.0), (256, 1, 30.0), (512, 1, 40.0), (1024, 1, 50.0), (1536, 2, 60.0), (2048, 2, 70.0),
         (3072, 2, 80.0), (4096, 2, 90.0)]
MIP_BACKENDS = ("SCIP", "CBC", "HIGHS")


def instance(layers: int, seed: int, replicas: tuple[int, ...] = (1, 2, 4)) -> Problem:
    """A random chain of ``layers`` profiled layers on 8 tiers, batch 16 in 4 micro-batches,
    d ∈ {1, 2, 4}."""
    rng = random.Random(seed)
    profiles = []
    for index in range(layers):
        params = int(rng.uniform(0, 30) * MIB)
        forward = rng.uniform(0.005, 0.05)
        profiles.append(LayerProfile(
            name=f"l{index}", forward_s=Linear(forward), backward_s=Linear(rng.uniform(0.01, 0.1)),
            param_bytes=params, grad_bytes=params, buffer_bytes=0, saved_bytes=Linear(rng.uniform(0, 4) * MIB),
            output_bytes=Linear(rng.uniform(0.1, 4) * MIB), peak_bytes=Linear(0.0),
            optimizer_state_bytes={"sgd": 0, "sgd-momentum": params, "adam": 2 * params},
            inference_s=Linear(forward)))
    platform = Platform(
        name="synthetic-lambda", kind="serverless",
        tiers=tuple(Tier(memory, vcpus, bandwidth * MIB, memory / 1024 * 1.67e-5)
                    for memory, vcpus, bandwidth in TIERS),
        min_memory_mb=128, max_memory_mb=4096, storage_latency_s=0.01, price_per_request=2e-7,
        billing_granularity_s=0.001, timeout_s=None, base_memory_bytes=64 * MIB, overlap_slowdown=1.5)
    chain = tuple(ChainLayer(profile.name, profile.param_bytes, 0, 0, profile) for profile in profiles)
    host = HostInfo(device="cpu", threads=2, cpu="benchmark", torch_version="benchmark")
    return Problem(chain, platform, Workload("train", batch=16, micro_batches=4, optimizer="sgd-momentum"),
                   host=host, options=ProblemOptions(replicas=replicas), input_bytes=Linear(1.0 * MIB))


def exact(problem: Problem, goal: Goal, reference: str, limit: float) -> Plan:
    """The reference optimum: the DP solver's (registered as "dp"; its module while it
    lands), or miqp's own given ``limit`` seconds (must come back "optimal")."""
    if reference == "miqp":
        plan = miqp.Miqp(hint=None, time_limit_s=limit).solve(problem, goal)
        if plan is None or plan.predictions["status"] != "optimal":
            raise SystemExit(f"miqp did not prove its reference optimal in {limit:g} s; raise --limit")
        return plan

    try:
        from flatpack.partitioner.solvers.dp import Dp

        plan = Dp().solve(problem, goal)
    except Exception:  # noqa: BLE001 - the registry entry may not be importable yet
        from flatpack.partitioner.solvers import funcpipe_dp

        plan = funcpipe_dp.solve(problem, goal)
    if plan is None:
        raise SystemExit(f"dp found no plan for {goal.describe()}; these instances should all have one")
    return plan


def hinted_part(problem: Problem, goal: Goal, plan, cold: bool) -> tuple:
    unit = dollars_per_mb_s(problem.platform)
    part = next(part for part in miqp.subproblems(problem) if part.contains(plan, plan.micro_batches))
    objective = miqp._Objective.of(goal, part.replicas, unit)
    incumbent = None if cold else plan.predictions["objective"]
    part, scaling, _ = miqp._prepare(part, objective, incumbent, miqp.DEFAULT_SCALE_BITS)
    return part, objective, scaling, incumbent


def run_cp_sat(part, objective, scaling, incumbent, plan, limit: float, workers: int) -> dict:
    model = miqp._CpModel(part, objective, scaling, incumbent)
    if incumbent is not None:
        model.hint(part.path_of(plan))
    started = time.perf_counter()
    status, values = model.solve(limit, workers, 0)
    seconds = time.perf_counter() - started
    if values:  # the plan's own objective in floating point, not the rounded model's value
        exact_values = miqp.path_values(values["path"], part.per_replica)
        found = objective.value(exact_values.time, exact_values.price)
    else:
        found = math.nan
    bound = model.true_from_model(values["bound"] if values else model.bound or 0.0)
    return {"status": status, "seconds": seconds, "objective": found, "bound": bound}


def run_mip(backend: str, part, objective, incumbent, plan, limit: float, workers: int) -> dict:
    """The arc model in floating point, the product linearized per arc."""
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver(backend)
    if solver is None:
        return {"status": "unavailable", "seconds": math.nan, "objective": math.nan, "bound": math.nan}
    if backend == "SCIP":
        solver.SetNumThreads(workers)  # CBC's build here ignores (and complains about) the setting
    solver.SetTimeLimit(int(limit * 1000))
    count, lags, arcs = part.num_layers, part.per_replica - 1, part.arcs
    floors = miqp.time_floors(arcs, count)
    time_ub = max(miqp.path_values(part.path_of(plan), part.per_replica).time * 4, max(floors))
    x = [solver.BoolVar(f"x{a}") for a in range(len(arcs))]
    starting = [[a for a, arc in enumerate(arcs) if arc.start == i] for i in range(count)]
    ending = [[a for a, arc in enumerate(arcs) if arc.end == i] for i in range(count)]
    covering = [[a for a, arc in enumerate(arcs) if arc.start <= k <= arc.end] for k in range(count)]

    def total(indices, key):
        return solver.Sum([key(arcs[a]) * x[a] for a in indices])

    solver.Add(solver.Sum([x[a] for a in starting[0]]) == 1)
    for i in range(1, count):
        solver.Add(solver.Sum([x[a] for a in ending[i - 1]]) == solver.Sum([x[a] for a in starting[i]]))
    solver.Add(solver.Sum([x[a] for a in ending[count - 1]]) == 1)
    forward_lag = solver.NumVar(0, time_ub, "forward_lag")
    suffix_lag = [solver.NumVar(0, time_ub, f"suffix_lag{i}") for i in range(count)] + [0]
    stage_lag = [solver.NumVar(0, time_ub, f"stage_lag{k}") for k in range(count)]
    suffix_path = [solver.NumVar(0, time_ub, f"suffix_path{i}") for i in range(count)] + [0]
    done = solver.NumVar(0, time_ub, "done")
    t_iter = solver.NumVar(0, time_ub, "t_iter")
    for k in range(count):
        solver.Add(forward_lag >= total(covering[k], lambda arc: arc.forward_lag_s))
        solver.Add(suffix_lag[k] >= suffix_lag[k + 1])
        solver.Add(suffix_lag[k] >= total(starting[k], lambda arc: arc.lag_s))
        solver.Add(stage_lag[k] >= suffix_lag[k + 1])
        solver.Add(stage_lag[k] >= total(covering[k], lambda arc: arc.lag_own_s))
        solver.Add(suffix_path[k] == suffix_path[k + 1] + total(starting[k], lambda arc: arc.backward_path_s))
        solver.Add(done >= suffix_path[k + 1] + total(covering[k], lambda arc: arc.backward_own_s)
                   + lags * stage_lag[k])
        solver.Add(t_iter >= solver.Sum([floors[a] * x[a] for a in covering[k]]))
    solver.Add(t_iter == total(range(len(arcs)), lambda arc: arc.forward_path_s) + lags * forward_lag + done)
    if objective.product:
        # technique 2: w_a = t_iter·x_a, bounded from below only (the objective pushes it down)
        w = [solver.NumVar(0, time_ub, f"w{a}") for a in range(len(arcs))]
        for a in range(len(arcs)):
            solver.Add(w[a] >= t_iter - time_ub * (1 - x[a]))
            solver.Add(w[a] >= floors[a] * x[a])
        value = objective.factor * (objective.offset * t_iter + solver.Sum([arcs[a].price_per_s * w[a]
                                                                            for a in range(len(arcs))]))
    else:
        value = objective.factor * t_iter
    if incumbent is not None:
        solver.Add(value <= incumbent * (1 + 1e-9))
    solver.Minimize(value)
    chosen = {(arc.start, arc.end, arc.memory_mb) for arc in part.path_of(plan)}
    # pywraplp's HiGHS 1.12 wrapper segfaults on SetHint (ortools 9.15): HiGHS runs unhinted
    if backend != "HIGHS" and incumbent is not None:
        solver.SetHint(x, [1.0 if (arc.start, arc.end, arc.memory_mb) in chosen else 0.0 for arc in arcs])
    started = time.perf_counter()
    code = solver.Solve()
    seconds = time.perf_counter() - started
    status = {pywraplp.Solver.OPTIMAL: "optimal", pywraplp.Solver.FEASIBLE: "feasible",
              pywraplp.Solver.INFEASIBLE: "infeasible"}.get(code, "unknown")
    found = solver.Objective().Value() if status in ("optimal", "feasible") else math.nan
    return {"status": status, "seconds": seconds, "objective": found, "bound": solver.Objective().BestBound()}


def line(label: str, result: dict, optimum: float) -> str:
    relative = (result["objective"] - optimum) / optimum if result["objective"] == result["objective"] else math.nan
    gap = (optimum - result["bound"]) / optimum if result["bound"] == result["bound"] else math.nan
    return (f"  {label:<14} {result['status']:<11} {result['seconds']:7.2f} s   objective/optimum−1 "
            f"{relative:+.2e}   bound gap {max(gap, 0.0):.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="*", default=[8, 16, 32])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--limit", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--backends", nargs="*", default=["CP-SAT", *MIP_BACKENDS])
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 2, 4],
                        help="the degrees d allowed (one value: compare on that (M, d) subproblem)")
    parser.add_argument("--reference", choices=["dp", "miqp"], default="dp",
                        help="where the optimum (warm start and yardstick) comes from")
    parser.add_argument("--cold", action="store_true", help="no warm start and no incumbent bound")
    parser.add_argument("--whole", action="store_true",
                        help="also run the whole solver (every (M, d)), warm-started from dp and cold")
    args = parser.parse_args()
    goal = Goal(Weights(1.0, 2.0 ** 19))
    for layers in args.layers:
        for seed in range(1, args.seeds + 1):
            problem = instance(layers, seed, tuple(args.replicas))
            started = time.perf_counter()
            plan = exact(problem, goal, args.reference, 10 * args.limit)
            dp_s = time.perf_counter() - started
            optimum = plan.predictions["objective"]
            part, objective, scaling, incumbent = hinted_part(problem, goal, plan, args.cold)
            start = "cold: no hint, no bound" if args.cold else "warm: hint and bound"
            print(f"L={layers} seed={seed}: reference ({args.reference}) {dp_s:.2f} s, optimum {optimum:.6g}, "
                  f"{part.label()}, {len(part.arcs)} arcs, {start}")
            for backend in args.backends:
                if backend == "CP-SAT":
                    result = run_cp_sat(part, objective, scaling, incumbent, plan, args.limit, args.workers)
                else:
                    result = run_mip(backend, part, objective, incumbent, plan, args.limit, args.workers)
                print(line(backend, result, optimum), flush=True)
            if args.whole:
                for label, hint in (("miqp hint=dp", "dp"), ("miqp cold", None)):
                    solved = miqp.Miqp(time_limit_s=args.limit, workers=args.workers, hint=hint).solve(problem, goal)
                    if solved is None:
                        print(f"  {label:<14} no plan", flush=True)
                        continue
                    found = solved.predictions
                    print(f"  {label:<14} {found['status']:<11} {found['solve_s']:7.2f} s   objective/optimum−1 "
                          f"{(found['objective'] - optimum) / optimum:+.2e}   gap {found['gap']:.2%}   "
                          f"(warm start {found['hint_s']:.2f} s, models {found['build_s']:.2f} s, "
                          f"CP-SAT {found['search_s']:.2f} s over {found['subproblems']} subproblems)", flush=True)

if __name__ == "__main__":
    main()
