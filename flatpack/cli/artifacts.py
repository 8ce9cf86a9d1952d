"""The verbs of a compiled artifact: ``inspect`` (the layer chain), ``compile``, ``sign`` and
``check``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import flatpack
from flatpack import logs
from flatpack.cli.common import (compile_args, human_bytes, json_flag, json_or_file, load_factory, pipeline_for,
                                 report, solvers_help, targets_help, trust_args)
from flatpack.stage.integrity import INDEX_FILE, SIGNATURE_FILE
from flatpack.table import format_table, plural

LOG = logs.get("cli")


def _describe_values(values: list[dict]) -> str:
    parts = []
    for value in values:
        if value["kind"] == "tensor":
            shape = "×".join(str(s) for s in value["shape"]) or "scalar"
            parts.append(f"{value['name']}[{shape} {value['dtype']}]")
        else:
            parts.append(f"{value['name']}({value['type']})")
    return ", ".join(parts)


def chain_table(chain: dict, plan_ranges: list[tuple[int, int]] | None = None) -> str:
    """The chain as a text table: index, name, ops, params, boundary tensors and bytes."""
    stage_of = {}
    for stage, (start, end) in enumerate(plan_ranges or []):
        for index in range(start, end + 1):
            stage_of[index] = stage
    rows = [("#", "stage" if plan_ranges else "", "layer", "ops", "params", "boundary out", "bytes")]
    for layer in chain["layers"]:
        boundary = layer["boundary"]
        rows.append((str(layer["index"]), str(stage_of.get(layer["index"], "")), layer["name"][:44],
                     layer["ops"][:48], human_bytes(layer["param_bytes"]),
                     _describe_values(boundary["values"])[:80], human_bytes(boundary["bytes"])))
    lines = format_table(rows[0], rows[1:]).splitlines()
    inputs = chain["inputs"]
    lines.insert(0, f"frontend: {chain['frontend']}   layers: {len(chain['layers'])}   parameters: "
                    f"{human_bytes(chain['total_param_bytes'])}   inputs: {_describe_values(inputs['values'])}")
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    model, inputs = load_factory(args.model, args.size)
    compiled = flatpack.compile(model, inputs, passes=pipeline_for(args), stages=1)
    report(args, chain_table(compiled.chain), compiled.chain)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.partitioner.plan import Plan

    plan = None
    if args.plan is not None:
        # the bounded reader: a missing, non-regular, huge or malformed file is a PlanError naming it
        plan = Plan.load(args.plan)
    model, inputs = load_factory(args.model, args.size)
    compiled = flatpack.compile(model, inputs, passes=pipeline_for(args), stages=args.stages, solver=args.solver,
                                target=args.target, out_dir=args.out, calibration=args.calibration, plan=plan,
                                force=args.force)
    text = (f"{chain_table(compiled.chain, compiled.plan.ranges)}\n\n"
            f"wrote {plural(len(compiled.plan.stages), 'stage')} to {args.out}\ndigest {compiled.digest}\n"
            "  pin it where the artifact is used (flatpack check/resume --digest, flatpack.load(dir, digest=...)), "
            "or sign it: flatpack sign DIR --key KEY --name NAME --version N")
    report(args, text, {"out": args.out, "digest": compiled.digest, "stages": len(compiled.plan.stages),
                        "plan": compiled.plan.to_json(), "chain": compiled.chain})
    return 0


def cmd_sign(args: argparse.Namespace) -> int:
    """Signs an artifact's index and subject after checking every file against the index."""
    digest = flatpack.sign(args.dir, args.key, name=args.name, version=args.version, digest=args.digest)
    signature = Path(args.dir) / SIGNATURE_FILE
    report(args, f"signed {Path(args.dir) / INDEX_FILE} (digest {digest}) as {args.name} version {args.version} "
                 f"into {signature}",
           {"index": str(Path(args.dir) / INDEX_FILE), "digest": digest, "signature": str(signature),
            "name": args.name, "version": args.version})
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Verifies an artifact as ``flatpack.load`` does, without running any of it: it *is*
    ``flatpack.load`` (index, sizes, sha256, the signature and its subject, the vocabulary of
    ``flatpack.json``, its plan, every manifest and every safetensors framing), so a directory
    ``load`` would refuse fails here with the same ArtifactError (exit 2), and none of the
    stage code is imported."""
    compiled = flatpack.load(args.dir, digest=args.digest, verify_key=args.verify_key, name=args.name,
                             min_version=args.min_version, trust_file=args.trust_file)
    if compiled.trust == "directory":
        LOG.warning("the index itself was trusted only as far as this directory is: pass --digest (the digest "
                    "compile printed) or --verify-key to check it against something held elsewhere")
    files = len(compiled.index.files)
    signature = compiled.signature
    text = (f"{args.dir}: {plural(files, 'file')} {'matches' if files == 1 else 'match'} the index; "
            f"digest {compiled.digest}")
    if signature is not None and signature.name is not None:
        text += f"\nsigned as {signature.name} version {signature.version} at {signature.signed_at} ({signature.key})"
    elif signature is not None:
        text += f"\nsigned with a v1 signature, which names no artifact or version ({signature.key})"
    if signature is not None and args.name is None:
        LOG.warning("no name was required (--name), so any artifact signed by this key would pass here too, e.g. "
                    "another model or an older build copied over this directory; pass --name (and --min-version "
                    "or --trust-file) to refuse those")
    report(args, text, {"dir": args.dir, "files": files, "digest": compiled.digest, "trust": compiled.trust,
                        "signature": None if signature is None else signature.to_json()})
    return 0


def _add_inspect(subparsers: Any) -> None:
    parser = subparsers.add_parser("inspect", help="print the layer chain of a model")
    compile_args(parser)
    json_or_file(parser, "inspect", "the chain")
    parser.set_defaults(run=cmd_inspect)


def _add_check(subparsers: Any) -> None:
    parser = subparsers.add_parser("check", help="verify a compiled artifact (index, every file, signature) without "
                                                 "running it")
    parser.add_argument("dir", metavar="DIR", help="the directory `flatpack compile --out` wrote")
    trust_args(parser)
    json_flag(parser, "check")
    parser.set_defaults(run=cmd_check)


def _add_compile(subparsers: Any) -> None:
    parser = subparsers.add_parser("compile", help="compile a model into stage artifacts")
    compile_args(parser)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--solver", default=None,
                        help=f"a registered solver ({solvers_help()}; default balanced), options in braces: "
                             "'rl{episodes=2000}'")
    parser.add_argument("--target", default="local", help=f"the platform to compile for: {targets_help()}")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--calibration", default=None, metavar="FILE",
                        help="what was measured inside the target (flatpack calibrate / profile --target); "
                             "the plan records its digest")
    parser.add_argument("--plan", default=None, metavar="PLAN.json",
                        help="compile with this plan (e.g. a compiled artifact's plan.json) instead of "
                             "solving; refused when it was made for another graph, target, calibration or "
                             "flatpack version")
    parser.add_argument("--force", action="store_true",
                        help="--plan: use the plan even when it was made for something else (a warning)")
    json_flag(parser, "compile")
    parser.set_defaults(run=cmd_compile)


def _add_sign(subparsers: Any) -> None:
    parser = subparsers.add_parser("sign", help="sign a compiled artifact's index (for teams that build and deploy "
                                                "on different machines)")
    parser.add_argument("dir", metavar="DIR", help="the directory `flatpack compile --out` wrote")
    parser.add_argument("--key", required=True, help="an Ed25519 private key file (PEM: openssl genpkey "
                                                     "-algorithm ed25519 -out key.pem), or env:NAME for "
                                                     "HMAC-SHA256 with the key in environment variable NAME")
    parser.add_argument("--name", required=True, help="the artifact's name, which verifiers require with "
                                                      "--name: 1-64 of a-z 0-9 . _ -, e.g. bert-prod")
    parser.add_argument("--version", type=int, required=True, metavar="N",
                        help="the build's version, a positive integer that goes up with each build "
                             "(verifiers refuse older ones with --min-version or --trust-file)")
    parser.add_argument("--digest", default=None, help="refuse to sign unless the index has this digest")
    json_flag(parser, "sign")
    parser.set_defaults(run=cmd_sign)


# each verb's parser, added to the command's subparsers (flatpack.cli.build_parser orders them)
VERBS = {"inspect": _add_inspect, "compile": _add_compile, "sign": _add_sign, "check": _add_check}
