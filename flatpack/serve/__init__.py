"""``flatpack serve``: a compiled model behind an HTTP endpoint (docs/architecture.md, issue 40).

``app`` (the Starlette routes), ``service`` (the state behind them and the blue/green switch),
``batcher`` (dynamic batching inside the SLO), ``pool`` (a warm, digest-pinned version and its
replicas), ``scaling`` (the replicas following the requests in flight), ``replan`` (the plan
re-chosen when the batch sizes move), ``tensors`` (request bodies checked against the model's
inputs), ``metrics``, ``openapi``, ``settings``, ``server`` (uvicorn, signals) and ``command``
(the CLI verb).

This package is callable: ``flatpack.serve(model, ...)`` runs :func:`serve`. A package and a
function cannot both be ``flatpack.serve``, so the package's module object answers the call
(its class is a callable ``ModuleType``); ``flatpack.serve.server`` and the other modules
import as usual. Nothing heavy is imported here: the CLI's verb module and
``import flatpack`` stay free of torch and uvicorn until a server starts.
"""

from __future__ import annotations

import sys
import types
from typing import Any


def serve(model: Any, example_inputs: Any = None, *, slo_ms: float, **options: Any) -> None:
    """Serves ``model`` (a Compiled, an artifact directory, or an ``nn.Module`` with its
    ``example_inputs``) until SIGTERM; see :func:`flatpack.serve.server.serve` for the options."""
    from flatpack.serve.server import serve as run_server   # start-up time: the server's libraries load here

    run_server(model, example_inputs, slo_ms=slo_ms, **options)


class _CallableModule(types.ModuleType):
    def __call__(self, model: Any, example_inputs: Any = None, *, slo_ms: float, **options: Any) -> None:
        serve(model, example_inputs, slo_ms=slo_ms, **options)


sys.modules[__name__].__class__ = _CallableModule
