"""``flatpack.compile`` as users call it: first the checks that need the backends (which sit
above the compiler in the layering, docs/architecture.md), then :func:`flatpack.compiler.compile`.

A workload the target's backend cannot run (``backends.protocol``: inference, or stages that
recompute their activations, where the backend lacks that capability) is refused here, before
the model is traced, naming the targets that can (``tests/unit/test_backend_protocol.py``).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from torch import nn

from flatpack import compiler
from flatpack.backends import check_workload
from flatpack.compiler import Compiled
from flatpack.ir.passes import Pass
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.solvers import Solver
from flatpack.partitioner.workload import Workload
from flatpack.profiler import ProfileOptions


def compile(model: nn.Module, example_inputs: Any = (), *, target: str = "local",
            solver: str | Solver | None = None, stages: int | None = None,
            passes: str | Sequence[Pass | str] | None = None, out_dir: str | os.PathLike | None = None,
            example_kwargs: dict | None = None, plan: Plan | None = None,
            profile: bool | ProfileOptions = False, workload: Workload | None = None,
            calibration: Any = None, force: bool = False, measured: str | os.PathLike | None = None,
            **options: Any) -> Compiled:
    # the parameters are compiler.compile's, written out so that tools and readers see them
    # (tests/unit/test_api.py checks the two signatures are equal); the docstring
    # is its too, set below
    if workload is not None:
        # before tracing: a plan the target's backend cannot run is refused now, not at deploy
        check_workload(target, workload.mode, workload.recompute)
    return compiler.compile(model, example_inputs, target=target, solver=solver, stages=stages, passes=passes,
                            out_dir=out_dir, example_kwargs=example_kwargs, plan=plan, profile=profile,
                            workload=workload, calibration=calibration, force=force, measured=measured, **options)


compile.__doc__ = compiler.compile.__doc__
