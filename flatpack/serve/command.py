"""``flatpack serve MODEL|ARTIFACT_DIR [--digest D] --target local|ray [--address A] --slo-ms S [--port P]``: the
verb's parser and its run. Imports nothing heavy at import time (the CLI's start-up)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flatpack.serve.settings import (DEFAULT_IDLE_S, DEFAULT_MAX_BATCH, DEFAULT_MAX_BODY_BYTES,
                                     DEFAULT_MAX_REQUEST_SAMPLES, DEFAULT_MIN_REPLICAS, DEFAULT_REPLAN_SOLVER, TARGETS)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="serve a model over HTTP with dynamic batching inside an SLO (POST /v1/predict, /metrics, "
                      "/readyz, /openapi.json); SIGTERM drains")
    parser.add_argument("model", metavar="MODEL|ARTIFACT_DIR",
                        help="a directory written by flatpack compile, or a model (path/to/file.py:factory, "
                             "package.module:factory, a built-in example or a zoo model), compiled for inference")
    parser.add_argument("--digest", default=None, help="serve the artifact only if its index has this sha256")
    parser.add_argument("--target", default="local", choices=TARGETS,
                        help="where the functions run: processes on this machine, or tasks on a Ray cluster")
    parser.add_argument("--address", default=None,
                        help="the Ray cluster of --target ray: auto (default: the one `ray start` runs here, or "
                             "$RAY_ADDRESS), HOST:PORT, ray://HOST:10001, or local (a one-node cluster started here)")
    parser.add_argument("--slo-ms", type=float, required=True, help="the latency bound per request, milliseconds")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (the log says which)")
    parser.add_argument("--size", default="tiny", choices=["tiny", "full"], help="size of a zoo model")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--max-request-samples", type=int, default=DEFAULT_MAX_REQUEST_SAMPLES)
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
    parser.add_argument("--min-replicas", type=int, default=DEFAULT_MIN_REPLICAS,
                        help="fork-join groups kept warm however idle the server is (default 1: no request pays a "
                             "cold start after a quiet spell)")
    parser.add_argument("--max-replicas", type=int, default=None,
                        help="the most fork-join groups the pool scales up to with the requests in flight (default: "
                             "as many as the target's CPUs hold, CPUs // functions per group: more only contend)")
    parser.add_argument("--idle-s", type=float, default=DEFAULT_IDLE_S,
                        help="seconds the pool must want fewer groups before one is removed (default 60: Knative's "
                             "stable window; a load's pauses do not tear a group down to cold-start it again)")
    parser.add_argument("--replan-solver", default=DEFAULT_REPLAN_SOLVER,
                        help="the solver that plans a model compiled here for the batches served and re-chooses the "
                             "plan when their sizes move (default dp: exact, Gillis's fork-join model)")
    parser.add_argument("--no-replan", dest="replan", action="store_false",
                        help="keep the plan the model was compiled with (an artifact directory always does)")
    parser.add_argument("--token-file", default=None,
                        help="the admin bearer token for POST /admin/version (default: $FLATPACK_ADMIN_TOKEN; "
                             "neither: the endpoint is off)")
    parser.set_defaults(run=run)
    return parser


VERBS = {"serve": add_parser}


def run(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.serve.server import resolve, serve_with
    from flatpack.serve.settings import ServeSettings, read_admin_token

    settings = ServeSettings(slo_s=args.slo_ms / 1e3, target=args.target, address=args.address, host=args.host,
                             port=args.port, max_body_bytes=args.max_body_bytes,
                             max_request_samples=args.max_request_samples, max_batch=args.max_batch,
                             admin_token=read_admin_token(args.token_file), min_replicas=args.min_replicas,
                             max_replicas=args.max_replicas, idle_s=args.idle_s, replan=args.replan,
                             replan_solver=args.replan_solver)

    def compiled() -> Any:
        if Path(args.model).is_dir():
            return resolve(args.model, digest=args.digest, settings=settings)
        model, inputs = _build_model(args.model, args.size)
        return resolve(model, inputs, digest=args.digest, settings=settings)

    serve_with(settings, compiled)
    return 0


def _build_model(spec: str, size: str) -> tuple:
    # start-up time: a verb imports what it runs
    from flatpack import models

    return models.load(spec, size)
