"""What the user wants the plan to do: train or serve, at which batch, with which optimizer
and synchronization, under which objective."""

from __future__ import annotations

from dataclasses import dataclass

from flatpack.errors import InputError
from flatpack.ir.profile import OPTIMIZERS
from flatpack.schedules import DEFAULT_SCHEDULE, Schedule
from flatpack.schedules import get as schedule_named
from flatpack.stage.settings import PRECISIONS, SYNC_METHODS

MODES = ("train", "infer")
# per stage, keep activations for the backward or recompute them there: "never" keeps them
# in every stage, "auto" lets the solver choose per stage
RECOMPUTE = ("never", "auto")
DEFAULT_TRAIN_MICRO_BATCHES = 4


@dataclass(frozen=True)
class Workload:
    """``batch`` is the global batch of one training iteration or of one inference request.
    ``micro_batches`` is FuncPipe's M: the global batch is cut into M micro-batches, and with
    d data-parallel replicas each replica pipelines µ = M/d of them (FuncPipe §3.4.1). Left
    out, it is the largest divisor of the batch up to 4 for training and 1 for inference; it
    must divide the batch (a micro-batch holds whole samples).
    ``sync`` picks the gradient synchronization model: FuncPipe's pipelined scatter-reduce
    (eq. 2) or LambdaML's three-phase scatter-reduce (eq. 1). ``slo_s`` is a latency bound
    (per iteration for training, per request for inference) for the SLO solvers.
    ``precision`` "bf16" or "fp16": boundary tensors cross in bfloat16 or float16, half the
    bytes of the float32 profile (``Problem.boundary_bytes``). ``recompute``: see RECOMPUTE; the solvers that
    choose tiers treat "recompute this stage" as one more option per stage. ``schedule``: the
    pipeline schedule a training run takes (a registered name, ``flatpack.schedules``), which
    the cost model must predict (``CostModel.predicts``)."""

    mode: str = "train"
    batch: int = 64
    micro_batches: int | None = None
    optimizer: str = "sgd-momentum"
    sync: str = "pipelined"
    slo_s: float | None = None
    precision: str = "fp32"
    recompute: str = "never"
    schedule: str = DEFAULT_SCHEDULE
    # bytes of optimizer state per byte of trainable parameters, derived from the optimizer a
    # run names (runtime.optim.OptimizerSpec.state_factor: AdamW 2, SGD with momentum 1, plain
    # SGD 0); None: the state the profile measured for ``optimizer``
    optimizer_state_factor: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"workload mode {self.mode!r} is not one of {', '.join(MODES)}")
        if not isinstance(self.batch, int) or isinstance(self.batch, bool) or self.batch <= 0:
            raise InputError(f"batch size must be a positive integer, got {self.batch!r}")
        if self.micro_batches is None:
            # frozen: the default depends on the other fields, so it is set once here
            object.__setattr__(self, "micro_batches", max(divisors_up_to(self.batch, DEFAULT_TRAIN_MICRO_BATCHES))
                               if self.mode == "train" else 1)
        if not isinstance(self.micro_batches, int) or isinstance(self.micro_batches, bool) or self.micro_batches <= 0:
            raise InputError(f"micro_batches must be a positive integer, got {self.micro_batches!r}")
        if self.micro_batches > self.batch:
            raise InputError(f"{self.micro_batches} micro-batches cannot split a batch of {self.batch}; "
                             f"use at most {self.batch}")
        check_divides(self.batch, self.micro_batches)
        if self.optimizer not in OPTIMIZERS:
            raise InputError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.sync not in SYNC_METHODS:
            raise InputError(f"sync method {self.sync!r} is not one of {', '.join(SYNC_METHODS)}")
        if self.precision not in PRECISIONS:
            raise InputError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.recompute not in RECOMPUTE:
            raise InputError(f"recompute {self.recompute!r} is not one of {', '.join(RECOMPUTE)}: never keeps every "
                             "stage's activations, auto lets the solver choose per stage")
        schedule_named(self.schedule)     # an unknown name is refused, listing the registered ones
        if self.optimizer_state_factor is not None and not self.optimizer_state_factor >= 0:
            raise InputError(f"optimizer_state_factor must be >= 0 bytes per parameter byte, got "
                             f"{self.optimizer_state_factor!r}")
        if self.slo_s is not None and not self.slo_s > 0:
            raise InputError(f"an SLO must be a positive number of seconds, got {self.slo_s!r}")

    @property
    def schedule_object(self) -> Schedule:
        """The registered schedule ``schedule`` names."""
        return schedule_named(self.schedule)

    @property
    def recompute_choices(self) -> tuple[bool, ...]:
        """The per-stage recompute flags a solver may choose from."""
        return (False, True) if self.recompute == "auto" else (False,)

    @property
    def boundary_scale(self) -> float:
        """Bytes of a boundary tensor on the wire relative to the float32 profile."""
        return 1.0 if self.precision == "fp32" else 0.5

    @property
    def micro_batch_count(self) -> int:
        """M: ``micro_batches`` as given, or the default ``__post_init__`` derived from the
        batch (never None once constructed, which the field's type cannot say)."""
        if self.micro_batches is None:
            raise AssertionError("Workload.__post_init__ sets micro_batches")
        return self.micro_batches

    @property
    def micro_batch_size(self) -> float:
        """Samples per micro-batch: the global batch over M (FuncPipe's micro-batch size)."""
        return self.batch / self.micro_batch_count

    def micro_batches_per_replica(self, replicas: int) -> float:
        """FuncPipe's µ = M/d."""
        return self.micro_batch_count / replicas


def divisors_up_to(batch: int, limit: int) -> list[int]:
    return [count for count in range(1, min(batch, limit) + 1) if batch % count == 0]


def check_divides(batch: int, micro_batches: int) -> None:
    """A micro-batch holds whole samples: M must divide the batch. The error names the
    nearest counts that do."""
    if batch % micro_batches == 0:
        return
    divisors = divisors_up_to(batch, batch)
    below = max(count for count in divisors if count < micro_batches)
    above = min((count for count in divisors if count > micro_batches), default=None)
    nearest = f"micro_batches={below}" + (f" or {above}" if above is not None else "")
    raise InputError(f"{micro_batches} micro-batches cannot split a batch of {batch} into whole samples; use "
                     f"{nearest} (micro-batches of {batch // below}"
                     + (f" or {batch // above}" if above is not None else "") + " samples), or a batch that "
                     f"{micro_batches} divides, such as {batch - batch % micro_batches + micro_batches}")
