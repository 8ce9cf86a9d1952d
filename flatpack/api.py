"""``flatpack.compile`` as users call it: first the checks that need the backends (which sit
above the compiler in the layering, docs/architecture.md), then :func:`flatpack.compiler.compile`.

A workload the target's backend cannot run (``backends.protocol``: inference, or stages that
recompute their activations, where the backend lacks that capability) is refused here, before
the model is traced, naming the targets that can (``tests/unit/test_backend_protocol.py``).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from flatpack import compiler
from flatpack.backends import check_workload
from flatpack.compiler import Compiled
from flatpack.partitioner.workload import Workload


@functools.wraps(compiler.compile)
def compile(model: nn.Module, example_inputs: Any = (), *, target: str = "local", workload: Workload | None = None,
            **options: Any) -> Compiled:
    if workload is not None:
        # before tracing: a plan the target's backend cannot run is refused now, not at deploy
        check_workload(target, workload.mode, workload.recompute)
    return compiler.compile(model, example_inputs, target=target, workload=workload, **options)
