"""The verbs that measure: ``profile`` (every layer's time and memory, here or inside a
target) and ``calibrate`` (a target's compute speed, store, links and collectives)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import flatpack
from flatpack import logs
from flatpack.cli.common import (RAY_ADDRESS_HELP, compile_args, connect_ray, human_bytes, ints, json_flag,
                                 json_or_file, load_factory, pipeline_for, positive_ints, report, targets_help)
from flatpack.errors import FlatpackError, InputError
from flatpack.table import format_table

LOG = logs.get("cli")


def profile_table(profile: Any) -> str:
    """Per layer: forward and backward milliseconds at batch 1 and per extra sample, the
    serving (no-grad) forward at batch 1, and the bytes a stage holds for it."""
    # start-up time: a verb imports what it runs
    from flatpack.ir.profile import stage_saved_bytes

    rows = [("#", "layer", "fwd ms", "+/sample", "bwd ms", "+/sample", "serve ms", "params", "saved/sample",
             "out/sample", "peak @1")]
    for index, layer in enumerate(profile.layers):
        rows.append((str(index), layer.name[:40], f"{layer.forward_s.at(1) * 1e3:.3f}",
                     f"{layer.forward_s.per_sample * 1e3:.3f}", f"{layer.backward_s.at(1) * 1e3:.3f}",
                     f"{layer.backward_s.per_sample * 1e3:.3f}", f"{layer.inference_line().at(1) * 1e3:.3f}",
                     human_bytes(layer.param_bytes),
                     human_bytes(layer.saved_bytes.per_sample), human_bytes(layer.output_bytes.per_sample),
                     human_bytes(layer.peak_bytes.at(1))))
    lines = format_table(rows[0], rows[1:]).splitlines()
    host = profile.host
    source = "cache hit" if profile.cache_hit else f"measured in {profile.wall_s:.1f} s"
    lines.insert(0, f"profile: {source}   host: {host.cpu}, {host.threads} threads, torch {host.torch_version}   "
                    f"batch sizes: {', '.join(map(str, profile.batch_sizes))}   repeats: {profile.repeats}")
    layers = profile.layers
    lines.append(f"whole model as one stage, per sample: fwd+bwd "
                 f"{sum(layer.forward_s.per_sample + layer.backward_s.per_sample for layer in layers) * 1e3:.3f} ms "
                 f"(+{sum(layer.forward_s.fixed + layer.backward_s.fixed for layer in layers) * 1e3:.3f} ms per "
                 "micro-batch), "
                 f"saved activations {human_bytes(stage_saved_bytes(layers, 1))} at batch 1, "
                 f"parameters {human_bytes(sum(layer.param_bytes for layer in layers))}")
    lines.extend(f"note: {note}" for note in profile.notes)
    return "\n".join(lines)


def cmd_profile(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.profiler import ProfileOptions

    model, inputs = load_factory(args.model, args.size)
    if args.target:
        # start-up time: a verb imports what it runs
        from flatpack.backends.profiling import profile_command

        return profile_command(model, inputs, target=args.target,
                               tiers=positive_ints(args.tiers, "--tiers") if args.tiers else None,
                               batch_sizes=positive_ints(args.batch_sizes), repeats=args.repeats,
                               passes=pipeline_for(args), out=args.out, parallel=args.parallel,
                               timeout_s=args.timeout, emulate=args.emulate, region=args.region,
                               show=lambda text, document: report(args, text, document))
    options = ProfileOptions(batch_sizes=tuple(positive_ints(args.batch_sizes)), repeats=args.repeats,
                             max_seconds=args.max_seconds, use_cache=not args.no_cache,
                             progress=logs.progress_enabled())
    compiled = flatpack.compile(model, inputs, passes=pipeline_for(args), stages=1, profile=options)
    profile = compiled.profile
    if profile is None:  # compile profiles whenever given ProfileOptions
        raise FlatpackError(f"{type(model).__name__} was compiled without a profile, so there is nothing to report")
    report(args, profile_table(profile), profile.to_json)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.backends.target_calibration import calibrate_target, calibration_summary
    from flatpack.platform.catalog import get_platform

    path = Path(args.out) if args.out is not None else Path("calibration.json")
    if get_platform(args.target).kind == "container":
        calibration = _calibrate_container(args, path)
        report(args, f"{calibration_summary(calibration)}\n"
                     f"digest {calibration.digest[:16]} (plans made with --calibration {path} record it)",
               calibration.to_json)
        return 0
    given = [flag for flag, value in (("--ranks", args.ranks), ("--backend", args.backend), ("--device", args.device),
                                      ("--from-probe", args.from_probe)) if value is not None]
    if given:
        raise InputError(f"{' and '.join(given)} choose the ranks of a GPU-container calibration; {args.target}'s "
                         "functions talk through the store. Leave them out, or use --target gpu-container")
    connect_ray(args)
    calibration = calibrate_target(args.target, tiers=ints(args.tiers, "--tiers") if args.tiers else None, out=path,
                                   emulate=args.emulate, region=args.region, round_trips=args.round_trips,
                                   probe_bytes=int(args.probe_mb * (1 << 20)), timeout_s=args.timeout,
                                   report=LOG.info, task_iterations=args.probe_iterations)
    report(args, f"{calibration_summary(calibration)}\n"
                 f"digest {calibration.digest[:16]} (plans made with --calibration {path} record it)",
           calibration.to_json)
    return 0


def _calibrate_container(args: argparse.Namespace, path: Path) -> Any:
    """``flatpack calibrate`` on a container platform: the ranks' link and all-reduce, measured
    here or read from the probe's result measured in a cluster (``--from-probe``)."""
    # start-up time: a verb imports what it runs
    from flatpack.backends.collective_calibration import (DEFAULT_RANKS, calibrate_collective,
                                                          calibration_from_probe)

    given = [flag for flag, value in (("--emulate", args.emulate), ("--region", args.region)) if value]
    if given:
        raise InputError(f"{' and '.join(given)} place calibration functions; {args.target} is measured by ranks "
                         "on this machine. Leave them out")
    tiers = ints(args.tiers, "--tiers") if args.tiers else None
    if args.from_probe is not None:
        local = [flag for flag, value in (("--ranks", args.ranks), ("--backend", args.backend),
                                          ("--device", args.device)) if value is not None]
        if local:
            raise InputError(f"{' and '.join(local)} choose ranks to start here, and --from-probe reads what ranks "
                             "measured elsewhere: give one or the other")
        return calibration_from_probe(args.from_probe, args.target, tiers=tiers, out=path, report=LOG.info)
    return calibrate_collective(args.target, tiers=tiers, out=path,
                                ranks=DEFAULT_RANKS if args.ranks is None else args.ranks, backend=args.backend,
                                device=args.device, timeout_s=args.timeout, report=LOG.info)



def _add_profile(subparsers: Any) -> None:
    parser = subparsers.add_parser("profile", help="measure every layer's time and memory on this host, or "
                                                    "(--target) on every memory tier inside a target")
    compile_args(parser)
    parser.add_argument("--batch-sizes", default="1,2,4", help="micro-batch sizes to fit a·batch+b over")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per layer and size (median)")
    parser.add_argument("--max-seconds", type=float, default=None, help="time budget for measuring")
    parser.add_argument("--no-cache", action="store_true", help="measure again even if cached")
    json_or_file(parser, "profile", "the profile (with --target: the calibration)")
    parser.add_argument("--target", default=None,
                        help=f"profile inside this target ({targets_help()}): a profiler function per memory tier; "
                             "writes the calibration file plans for the target use")
    parser.add_argument("--tiers", default=None, help="--target: memory tiers in MB (default the target's)")
    parser.add_argument("--out", default=None, help="--target: the calibration file "
                        "(default calibration-<target>.json)")
    parser.add_argument("--emulate", action="store_true", help="--target: run the target's tiers as local "
                        "functions, each held to its tier's CPU share, instead of deploying")
    parser.add_argument("--parallel", type=int, default=1, help="--target: functions at a time")
    parser.add_argument("--region", default=None,
                        help="--target: the cloud region of the profiler functions (default: AWS_REGION, "
                             "AWS_DEFAULT_REGION or the boto3 profile's; ALIBABA_CLOUD_REGION_ID), "
                             "e.g. --region eu-west-1")
    parser.add_argument("--timeout", type=float, default=900.0, help="--target: seconds per function")
    parser.set_defaults(run=cmd_profile)


def _add_calibrate(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="measure a target (any model): compute speed against this host, store latency "
                          "distribution, bandwidth, invoke latency, optimizer step; writes calibration.json",
        description="Deploys a calibration function to the target, one per memory tier (locally: processes held to "
                    "each tier's CPU share and link), then two small probe pipelines per tier (each worker task's "
                    "seconds beyond the cost model, and FuncPipe's beta), and writes what it measured to a "
                    "versioned calibration file that compile, plan and run take with --calibration.")
    parser.add_argument("--target", required=True, help=f"platform to measure: {targets_help()}")
    parser.add_argument("--address", default=None, help=RAY_ADDRESS_HELP)
    parser.add_argument("--tiers", default=None, metavar="MB[,MB...]",
                        help="memory tiers to measure (default: the target's)")
    parser.add_argument("--out", default=None, help="the calibration file (default calibration.json)")
    parser.add_argument("--emulate", action="store_true",
                        help="run the target's tiers as local functions instead of deploying")
    parser.add_argument("--region", default=None, help="the cloud region of the calibration functions")
    parser.add_argument("--round-trips", type=int, default=60,
                        help="small puts and gets per tier for the latency distribution (default 60)")
    parser.add_argument("--probe-mb", type=float, default=4.0,
                        help="MB moved each way per tier to measure bandwidth (default 4)")
    parser.add_argument("--probe-iterations", type=int, default=8,
                        help="iterations of each probe pipeline that measures the task terms (default 8; "
                             "the first 2 are not measured), and one more timed request of each serving "
                             "probe; 0: no probes")
    parser.add_argument("--ranks", type=int, default=None,
                        help="gpu-container: ranks that time messages, and all-reduces among 2 to this many "
                             "(default 4)")
    parser.add_argument("--backend", default=None, choices=["gloo", "nccl"],
                        help="gpu-container: the ranks' collective backend (default: nccl with a GPU per "
                             "rank, else gloo)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="gpu-container: where the ranks' tensors live (default cuda with a GPU)")
    parser.add_argument("--from-probe", default=None, metavar="PROBE_JSON",
                        help="gpu-container: fit what the probe measured in a cluster (torchrun ... -m "
                             "flatpack.runtime.collective_probe --out PROBE_JSON; the image ships it) "
                             "instead of starting ranks here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per function (gpu-container: "
                        "for all the ranks)")
    json_flag(parser, "calibrate")
    parser.set_defaults(run=cmd_calibrate)


# each verb's parser, added to the command's subparsers (flatpack.cli.build_parser orders them)
VERBS = {"profile": _add_profile, "calibrate": _add_calibrate}
