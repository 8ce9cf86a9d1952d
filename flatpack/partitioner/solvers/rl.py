"""rl: Gillis's reinforcement-learning partitioner (Gillis §IV-C), for
fork-join inference and for the training pipeline, with the cost model as simulator.

Two agents, each a two-layer network (Gillis Fig. 8), trained jointly:

* the **partitioner** reads the layers and samples u: where to cut (one Bernoulli per layer
  boundary) and how each group is parallelized — for inference whether a group is split over
  workers, for training the micro-batch count M (when the space offers several);
* the **placer** reads the groups u made and samples v given u: the memory tier of each stage
  (one tier for every function under Gillis), and the degree — for inference how many worker
  functions host a split group's partitions (an unsplit group runs on the master), for
  training the data-parallel degree (one for the pipeline, one per stage under PipeDream).

Reward, Gillis eq. 4 in milliseconds: R = B − C when the plan meets the SLO, T_max − L when it
misses it, and a large negative reward when a function overflows its memory: −10 times the
larger of B and the worst SLO miss seen, so that an overflow ranks below every plan that
fits (with a fixed penalty, a policy that misses the SLO by seconds learns to overflow). C is the
plan's cost as billed milliseconds of the platform's smallest tier (Gillis bills one memory
size; cost in MB·s divided by that size is its billed duration). B, the budget, is twice the
largest C seen, so that every plan meeting the SLO scores positive, as eq. 4 requires. For a
weighted goal (no SLO) C is the objective α₁·cost + α₂·time and every fitting plan "meets" it.

Training is REINFORCE (eqs. 5–6) with Adam: each update samples ``batch`` episodes (one plan
each) and weights each episode's log-probability by its reward's centered rank in the batch
(:func:`centered_ranks`: the batch is the baseline, and eq. 4's order, not its magnitudes,
drives the update), plus an entropy bonus so that the policy keeps exploring.
The solver returns the best plan it priced (the :class:`Incumbent`), never one that
overflows memory or misses the SLO; it is bounded by ``episodes``, ``time_limit_s`` and
``patience`` (episodes without a better plan). Under a seed it is deterministic whenever
the episode or patience bound, not the clock, ends the run.

Trained policies are saved (atomically) under the policy directory, keyed by the chain, the
platform, the search space and the goal, and a later solve of the same problem starts from
the saved policy (``warm_start``); without one, each goal of a front starts from the policy
the previous goal trained.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

import torch
from torch import nn

from flatpack.atomic import write_atomic
from flatpack.errors import InputError
from flatpack.ir.profile import CACHE_ENV
from flatpack.partitioner.objective import Evaluation
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers.base import CostSolver, Goal
from flatpack.partitioner.solvers.sampled import DecisionSpace, Incumbent, hill_climb, one_thread, positive

POLICY_SCHEMA = 1
POLICY_DIR_ENV = "FLATPACK_POLICY_DIR"
OOM_BUDGETS = 10.0          # an overflow scores −OOM_BUDGETS·max(B, worst SLO miss)
TRAINING_SHARE = 0.85       # of time_limit_s; the rest is for the polish
_POSITIONS = 3              # sine/cosine pairs that tell the layers apart by position


def default_policy_dir() -> Path:
    """``$FLATPACK_POLICY_DIR``, else ``policies`` beside the profile cache."""
    if os.environ.get(POLICY_DIR_ENV):
        return Path(os.environ[POLICY_DIR_ENV])
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / "policies"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flatpack" / "policies"


# --- what the agents read ----------------------------------------------------------------------


def layer_features(problem: Problem) -> torch.Tensor:
    """(L, F): per layer its compute, parameters, saved activations and output, each over its
    mean along the chain (so a stage's sum reads as its share in units of an average layer),
    then its position as sines and cosines."""
    count = len(problem.chain)
    if problem.profiled:
        mode = problem.workload.mode
        size = problem.workload.micro_batch_size if mode == "train" else float(problem.workload.batch)
        rows = []
        for index in range(count):
            profile = problem.layer_profile(index)
            compute = (profile.forward_s.at(size) + profile.backward_s.at(size) if mode == "train"
                       else profile.inference_line().at(size))
            rows.append([compute, profile.param_bytes, profile.saved_bytes.at(size), profile.output_bytes.at(size)])
    else:
        rows = [[layer.flops, layer.param_bytes, 0.0, layer.boundary_bytes] for layer in problem.chain]
    content = torch.tensor(rows, dtype=torch.float64)
    mean = content.mean(dim=0)
    content = torch.where(mean > 0, content / mean.clamp_min(1e-300), torch.zeros_like(content))
    where = torch.arange(count, dtype=torch.float64) / max(count, 1)
    angles = torch.stack([2 * math.pi * (2 ** k) * where for k in range(_POSITIONS)], dim=1)
    return torch.cat([content, torch.sin(angles), torch.cos(angles)], dim=1).float()


CONTENT = 4
FEATURES = CONTENT + 2 * _POSITIONS
# a stage: its layers' content sums, its length, start and end over L, whether it is split,
# and M over the largest M offered
STAGE_FEATURES = CONTENT + 5


class Partitioner(nn.Module):
    """Layers → where to cut, whether each group is split (inference), M (training)."""

    def __init__(self, hidden: int, micro_choices: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh())
        self.cut = nn.Linear(hidden, 1)
        self.split = nn.Linear(hidden, 2)
        self.micro = nn.Linear(hidden, micro_choices)


class Placer(nn.Module):
    """Groups → memory tier per stage (or one), degree per stage (or one)."""

    def __init__(self, hidden: int, tiers: int, degrees: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(STAGE_FEATURES, hidden), nn.Tanh())
        self.tier = nn.Linear(hidden, tiers)
        self.degree = nn.Linear(hidden, degrees)


def _categorical(logits: torch.Tensor, generator: torch.Generator,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples one choice per row (Gumbel-max, so the seeded generator decides); returns the
    choices, their log-probabilities and the rows' entropies."""
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    log_probs = torch.log_softmax(logits, dim=-1)
    uniform = torch.rand(logits.shape, generator=generator).clamp(1e-12, 1 - 1e-12)
    choice = torch.argmax(log_probs.detach() - torch.log(-torch.log(uniform)), dim=-1)
    chosen = log_probs.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    probs = log_probs.exp()
    entropy = -(probs * torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))).sum(-1)
    return choice, chosen, entropy


@dataclass(frozen=True)
class Decisions:
    """One sampled plan's choices with their log-probability and entropy (for the update)."""

    cuts: list[bool]
    tiers: list[int]
    degrees: list[int]
    micro_batches: int
    log_prob: torch.Tensor
    entropy: torch.Tensor


class Agent(nn.Module):
    """The partitioner and the placer over one problem's decision space."""

    def __init__(self, space: DecisionSpace, features: torch.Tensor, hidden: int) -> None:
        super().__init__()
        self.space = space
        self.features = features
        self.worker_degrees = tuple(d for d in space.all_degrees if d > 1) if space.mode == "infer" else ()
        degree_choices = self.worker_degrees if space.mode == "infer" else space.all_degrees
        self.degree_values = degree_choices or (1,)
        self.partitioner = Partitioner(hidden, len(space.micro_batches))
        self.placer = Placer(hidden, len(space.memory_mb), len(self.degree_values))

    def sample(self, generator: torch.Generator, greedy: bool = False) -> Decisions:
        """One episode's plan from the policy (``greedy``: the most likely choices)."""
        space = self.space
        hidden = self.partitioner.body(self.features)
        log_prob = torch.zeros(())
        entropy = torch.zeros(())
        # u: the partitioner's cuts
        cut_logit = self.partitioner.cut(hidden[:-1]).squeeze(-1)
        cut_p = torch.sigmoid(cut_logit)
        if greedy:
            cuts = cut_p.detach() > 0.5
        else:
            cuts = torch.rand(cut_p.shape, generator=generator) < cut_p.detach()
        log_prob = log_prob + torch.where(cuts, nn.functional.logsigmoid(cut_logit),
                                          nn.functional.logsigmoid(-cut_logit)).sum()
        entropy = entropy - (cut_p * nn.functional.logsigmoid(cut_logit)
                             + (1 - cut_p) * nn.functional.logsigmoid(-cut_logit)).sum()
        ends = [index for index, cut in enumerate(cuts.tolist()) if cut] + [space.num_layers - 1]
        starts = [0, *(end + 1 for end in ends[:-1])]
        # u: M for training
        micro_index = 0
        if space.mode == "train" and len(space.micro_batches) > 1:
            choice, chosen, spread = self._pick(self.partitioner.micro(hidden.mean(0)), generator, greedy)
            micro_index = int(choice)
            log_prob, entropy = log_prob + chosen, entropy + spread
        micro_batches = space.micro_batches[micro_index]
        # u: whether each fork-join group is split over workers
        split = [False] * len(ends)
        if space.mode == "infer" and self.worker_degrees:
            group_hidden = torch.stack([hidden[start:end + 1].mean(0) for start, end in zip(starts, ends)])
            choice, chosen, spread = self._pick(self.partitioner.split(group_hidden), generator, greedy)
            split = [bool(value) for value in choice.tolist()]
            log_prob, entropy = log_prob + chosen.sum(), entropy + spread.sum()
        # v: the placer, given the groups
        stage_hidden = self.placer.body(self._stage_features(starts, ends, split, micro_batches))
        tier_input = stage_hidden if space.tier_per_stage else stage_hidden.mean(0, keepdim=True)
        choice, chosen, spread = self._pick(self.placer.tier(tier_input), generator, greedy)
        tiers = [space.memory_mb[index] for index in choice.tolist()]
        log_prob, entropy = log_prob + chosen.sum(), entropy + spread.sum()
        degrees, chosen, spread = self._place_degrees(stage_hidden, split, micro_batches, generator, greedy)
        log_prob, entropy = log_prob + chosen, entropy + spread
        return Decisions(cuts.tolist(), tiers, degrees, micro_batches, log_prob, entropy)

    def _place_degrees(self, stage_hidden: torch.Tensor, split: list[bool], micro_batches: int,
                       generator: torch.Generator, greedy: bool) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """v's degrees: worker counts of the split groups (inference), replica degrees ≤ M
        (training); with their log-probability and entropy."""
        space = self.space
        if space.mode == "infer":
            if not any(split):
                return [1] * len(split), torch.zeros(()), torch.zeros(())
            rows = torch.tensor([index for index, value in enumerate(split) if value])
            choice, chosen, spread = self._pick(self.placer.degree(stage_hidden[rows]), generator, greedy)
            picked = iter(self.degree_values[index] for index in choice.tolist())
            return [next(picked) if value else 1 for value in split], chosen.sum(), spread.sum()
        allowed = torch.tensor([degree in space.degrees_for(micro_batches) for degree in self.degree_values])
        degree_input = stage_hidden if space.degree_per_stage else stage_hidden.mean(0, keepdim=True)
        logits = self.placer.degree(degree_input)
        choice, chosen, spread = self._pick(logits, generator, greedy, allowed.expand_as(logits))
        return [self.degree_values[index] for index in choice.tolist()], chosen.sum(), spread.sum()

    @staticmethod
    def _pick(logits: torch.Tensor, generator: torch.Generator, greedy: bool,
              mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not greedy:
            return _categorical(logits, generator, mask)
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        log_probs = torch.log_softmax(logits, dim=-1)
        choice = torch.argmax(log_probs, dim=-1)
        return choice, log_probs.gather(-1, choice.unsqueeze(-1)).squeeze(-1), torch.zeros(choice.shape)

    def _stage_features(self, starts: list[int], ends: list[int], split: list[bool],
                        micro_batches: int) -> torch.Tensor:
        count = self.space.num_layers
        largest_micro = max(self.space.micro_batches)
        rows = []
        for start, end, is_split in zip(starts, ends, split):
            content = self.features[start:end + 1, :CONTENT].sum(0)
            extra = torch.tensor([(end - start + 1) / count, start / count, (end + 1) / count, float(is_split),
                                  micro_batches / largest_micro])
            rows.append(torch.cat([content, extra]))
        return torch.stack(rows)


def centered_ranks(rewards: torch.Tensor) -> torch.Tensor:
    """Advantages as the rewards' ranks in the batch, centered and scaled to unit variance
    (ties share their mean rank). Eq. 4's values span orders of magnitude — an overflow scores
    −10·B, a plan that meets the SLO B − C — so a standardized reward lets the overflows
    drown the differences among fitting plans; ranks keep eq. 4's order and nothing else
    (the fitness shaping of evolution strategies)."""
    order = torch.argsort(torch.argsort(rewards)).double()
    ranks = torch.empty_like(order)
    for value in torch.unique(rewards):
        tied = rewards == value
        ranks[tied] = order[tied].mean()
    centered = ranks - ranks.mean()
    return (centered / centered.std().clamp_min(1e-12)).float()


# --- the solver --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rl(CostSolver):
    """REINFORCE over the partitioner and placer policies; see the module docstring.

    ``episodes``: plans sampled per goal at most; ``time_limit_s``: wall seconds for one
    ``solve`` (a front shares them among its goals); ``patience``: stop after this many
    episodes without a better plan; ``batch``: episodes per policy update; ``learning_rate``,
    ``hidden`` (units per network), ``entropy`` (the exploration bonus's weight): measured on
    16-layer chains against dp (benchmarks/learning_solvers.py); ``polish``: after training,
    hill-climb from the best plan over one-decision changes (the last 15% of the time);
    ``warm_start``: load and save the policy under ``policy_dir`` (default
    :func:`default_policy_dir`).
    """

    name: ClassVar[str] = "rl"
    exact: ClassVar[bool] = False
    episodes: int = 20000
    time_limit_s: float = 60.0
    patience: int = 5000
    batch: int = 16
    learning_rate: float = 0.003
    hidden: int = 32
    entropy: float = 0.1
    seed: int = 0
    polish: bool = True
    warm_start: bool = True
    policy_dir: str | None = None

    def __post_init__(self) -> None:
        for what in ("episodes", "time_limit_s", "patience", "batch", "learning_rate", "hidden"):
            positive(getattr(self, what), what, "rl")
        if self.entropy < 0:
            raise InputError(f"rl entropy must be >= 0, got {self.entropy!r}")

    def solve(self, problem: Problem, goal: Goal) -> Plan | None:
        return self.solve_all(problem, [goal])[0]

    def solve_all(self, problem: Problem, goals: Sequence[Goal]) -> list[Plan | None]:
        """Goal after goal, each with an even share of ``time_limit_s`` and the full
        ``episodes``; a goal with no saved policy starts from the previous goal's."""
        with one_thread():
            return self._solve_all(problem, goals)

    def _solve_all(self, problem: Problem, goals: Sequence[Goal]) -> list[Plan | None]:
        space = DecisionSpace.of(problem)
        features = layer_features(problem)
        shared: dict = {}
        previous: Agent | None = None
        results = []
        for index, goal in enumerate(goals):
            path = self._policy_path(problem, space, goal)
            agent, warm = self._agent(space, features, path, previous)
            incumbent = Incumbent(problem, goal, self.name, cache=shared)
            started = time.perf_counter()
            limit_s = self.time_limit_s / len(goals)
            training_deadline = started + (TRAINING_SHARE * limit_s if self.polish else limit_s)
            stopped, trained = self._train(agent, incumbent, goal, torch.Generator().manual_seed(self.seed + index),
                                           training_deadline)
            incumbent.price(self._to_plan(space, agent.sample(torch.Generator(), greedy=True)))
            self._save(path, agent)
            facts = {"episodes": trained, "stopped_by": stopped, "warm_start": warm, "seed": self.seed,
                     "policy": None if path is None else str(path)}
            if self.polish:
                learned = incumbent.best_score[0] if incumbent.best_score is not None else None
                start = incumbent.best or incumbent.fastest
                rounds = 0 if start is None else hill_climb(incumbent, space, start, started + limit_s)
                facts.update(rl_objective=learned, polish_rounds=rounds)
            results.append(incumbent.result(**facts))
            previous = agent
        return results

    # training

    def _train(self, agent: Agent, incumbent: Incumbent, goal: Goal, generator: torch.Generator,
               deadline: float) -> tuple[str, int]:
        optimizer = torch.optim.Adam(agent.parameters(), lr=self.learning_rate)
        budget = 0.0
        worst_miss = 0.0
        episodes = 0
        while True:
            if episodes >= self.episodes:
                return "episodes", episodes
            if time.perf_counter() >= deadline:
                return "time_limit_s", episodes
            if episodes - incumbent.best_at >= self.patience and incumbent.best is not None:
                return "patience", episodes
            size = min(self.batch, self.episodes - episodes)
            samples = [agent.sample(generator) for _ in range(size)]
            outcomes = [incumbent.price(self._to_plan(agent.space, decisions)) for decisions in samples]
            episodes += size
            costs = [self._cost(incumbent.problem, goal, outcome) for outcome in outcomes]
            budget = max([budget, *(2 * cost for cost in costs if cost is not None)])
            # fitting plans first: an overflow's reward depends on the worst miss among them
            fitting = [self._reward(goal, outcome, cost, budget) if outcome.fits else None
                       for outcome, cost in zip(outcomes, costs)]
            worst_miss = min([worst_miss, *(reward for reward in fitting if reward is not None)])
            rewards = torch.tensor([self._reward(goal, outcome, None, budget, worst_miss) if reward is None else reward
                                    for outcome, reward in zip(outcomes, fitting)], dtype=torch.float64)
            if size < 2 or float(rewards.std()) == 0.0:
                continue
            advantages = centered_ranks(rewards)
            log_probs = torch.stack([decisions.log_prob for decisions in samples])
            entropies = torch.stack([decisions.entropy for decisions in samples])
            loss = -(advantages * log_probs).mean() - self.entropy * entropies.mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    @staticmethod
    def _cost(problem: Problem, goal: Goal, evaluation: Evaluation) -> float | None:
        """C of eq. 4 for a plan that fits and meets the SLO, else None."""
        if not evaluation.fits:
            return None
        if goal.slo_s is None:
            return evaluation.objective(goal.weights)
        if evaluation.time_s > goal.slo_s:
            return None
        smallest_mb = min(tier.memory_mb for tier in problem.platform.tiers)
        return evaluation.cost_units / smallest_mb * 1e3

    @staticmethod
    def _reward(goal: Goal, evaluation: Evaluation, cost: float | None, budget: float,
                worst_miss: float = 0.0) -> float:
        """Gillis eq. 4 (see the module docstring); an overflow scores −OOM_BUDGETS times the
        larger of B and the worst SLO miss seen (``worst_miss`` ≤ 0), below every fitting plan."""
        if not evaluation.fits:
            return -OOM_BUDGETS * max(budget, -worst_miss, 1.0)
        if cost is None:
            assert goal.slo_s is not None
            return (goal.slo_s - evaluation.time_s) * 1e3
        return budget - cost

    def _to_plan(self, space: DecisionSpace, decisions: Decisions) -> Plan:
        return space.plan(decisions.cuts, decisions.tiers, decisions.degrees, decisions.micro_batches, self.name)

    # policies

    def _agent(self, space: DecisionSpace, features: torch.Tensor, path: Path | None,
               previous: Agent | None) -> tuple[Agent, bool]:
        """A fresh agent (seeded), the policy saved at ``path``, or a copy of the previous
        goal's agent."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            agent = Agent(space, features, self.hidden)
        if path is not None and path.exists():
            saved = torch.load(path, weights_only=True)
            if saved.get("schema") == POLICY_SCHEMA:
                agent.load_state_dict(saved["state"])
                return agent, True
        if previous is not None:
            agent.load_state_dict(copy.deepcopy(previous.state_dict()))
        return agent, False

    def _policy_path(self, problem: Problem, space: DecisionSpace, goal: Goal) -> Path | None:
        """Where this problem and goal's policy is kept; None without ``warm_start``."""
        if not self.warm_start:
            return None
        key = {
            "schema": POLICY_SCHEMA, "hidden": self.hidden, "goal": goal.describe(),
            "chain": [[layer.name, layer.param_bytes, layer.flops] for layer in problem.chain],
            "platform": problem.platform.name, "tiers": list(space.memory_mb), "mode": space.mode,
            "model": space.model, "micro_batches": list(space.micro_batches), "degrees": list(space.all_degrees),
            "batch": problem.workload.batch,
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
        return (Path(self.policy_dir) if self.policy_dir else default_policy_dir()) / f"rl-{digest}.pt"

    @staticmethod
    def _save(path: Path | None, agent: Agent) -> None:
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save({"schema": POLICY_SCHEMA, "state": agent.state_dict()}, buffer)
        write_atomic(path, buffer.getvalue())     # a concurrent compile never loads half a policy
