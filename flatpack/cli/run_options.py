"""The options of ``flatpack run``, declared once: :data:`RUN_OPTIONS` is the table from which
the run verb's argparse groups are built (:func:`add_run_options`) and the parsed values are
mapped onto :class:`flatpack.job_options.JobOptions`'s fields (:func:`job_values`).
``tests/unit/test_run_options.py`` checks that every JobOptions field has exactly one flag here
and every flag one field.

The defaults are JobOptions's own: an option not given (on the command line or in a
``--config`` file) is absent from the parsed arguments (``argparse.SUPPRESS``), so JobOptions
fills it in. Nothing here imports torch: ``flatpack run --help`` builds this parser."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flatpack import schedules
from flatpack.backends import RUN_TARGETS
from flatpack.cli.common import RAY_ADDRESS_HELP, ints, names, split_points_help, stages_help
from flatpack.partitioner.solvers import PICKS
from flatpack.partitioner.workload import RECOMPUTE
from flatpack.runtime.elastic import OBJECTIVES
from flatpack.stage.settings import NON_FINITE, PRECISIONS, SYNC_METHODS

# JobOptions's groups (flatpack.job_options.GROUPS) as `flatpack run --help` titles them
GROUP_TITLES = {"batches": "data", "train": "training", "evaluation": "held-out evaluation", "plan": "plan",
                "output": "output"}
_SOLVER_HELP = ("the solver that cuts the model and chooses tiers and replicas: dp (the default) or another "
                "registered one (see flatpack plan --help), options in braces, e.g. 'rl{episodes=2000}'")


def _negated(given: bool) -> bool:
    """A --no-X switch's value as field X."""
    return not given


def _keywords(flag: str) -> Callable[[str], dict[str, Any]]:
    """``K=V,...`` as the keyword options it names (Python literals)."""
    def parse(text: str) -> dict[str, Any]:
        # start-up time: the optimizers' module loads torch
        from flatpack.runtime.optim import parse_options

        return parse_options(text, flag)
    return parse


def _ints(flag: str) -> Callable[[str], tuple[int, ...] | None]:
    """A comma list of integers (empty: none)."""
    return lambda text: ints(text, flag) if text else None


@dataclass(frozen=True)
class RunOption:
    """One option of ``flatpack run``: its flag, the JobOptions group and field it sets (by
    default the flag's name), how the parsed value becomes the field's (``value``), and what
    argparse is told of it."""

    flag: str
    group: str
    field: str
    value: Callable[[Any], Any] | None
    arguments: dict[str, Any]        # what argparse is told of it (type, choices, metavar, help, ...)

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


def Option(flag: str, group: str, *, field: str | None = None, value: Callable[[Any], Any] | None = None,
           **argparse_options: Any) -> RunOption:
    """A row of :data:`RUN_OPTIONS`: the field defaults to the flag's name."""
    return RunOption(flag, group, field or flag.removeprefix("--").replace("-", "_"), value, argparse_options)


RUN_OPTIONS: tuple[RunOption, ...] = (
    Option('--batch', 'batches', type=int, help='samples per iteration, the global batch (default 32)'),
    Option('--iterations', 'batches', type=int, help='global batches to train (default 4 on synthetic data; with '
                "--data, --epochs full passes; past an epoch's end the data starts again, reshuffled)"),
    Option('--data', 'batches', metavar='SOURCE', help='the training data: a directory of shards (*.safetensors, '
                "*.pt saved with torch.save, *.npz) holding the inputs by the model's argument names and the "
                "target as 'target' (a HuggingFace model may take 'labels' instead), an s3://bucket/prefix of such "
                'shards, or package.module:factory / file.py:factory returning a torch Dataset or IterableDataset. '
                'e.g. --data shards/'),
    Option('--store-endpoint', 'batches', metavar='URL', help='the S3 endpoint of an s3:// --data (default AWS), '
                'e.g. http://127.0.0.1:8333; credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a '
                'profile'),
    Option('--epochs', 'batches', type=int, help='full passes over --data (default 1)'),
    Option('--no-shuffle', 'batches', field='shuffle', value=_negated, action='store_true', help='read --data in '
                'order (default: shard and sample order shuffled per epoch, seeded by --seed)'),
    Option('--drop-last', 'batches', action='store_true', help="drop an epoch's final partial batch (without it, "
                'data whose size --batch does not divide is refused: every batch is cut into the same '
                'micro-batches)'),
    Option('--seed', 'batches', type=int, help="seeds the shuffling, the synthetic data and the initial weights' "
                'copy (default 0)'),
    Option('--micro-batches', 'train', type=int, help='micro-batches each batch is cut into (default 4)'),
    Option('--loss', 'train', help="auto (default: the model output's 'loss' when it has one, as a HuggingFace "
                'model given labels; else cross-entropy for (batch, classes) outputs, mse otherwise), '
                'cross-entropy or mse; any other loss: make the model return it. e.g. --loss cross-entropy'),
    Option('--optimizer', 'train', help='any torch.optim optimizer by name: adam (default), adamw, sgd (momentum '
                '0.9 unless --optimizer-args says otherwise), rmsprop, ...'),
    Option('--optimizer-args', 'train', value=_keywords('--optimizer-args'), metavar='K=V[,K=V...]', help='the '
                "optimizer's keyword options as Python literals, e.g. lr=3e-4,weight_decay=0.01,betas=(0.9,0.95)"),
    Option('--lr', 'train', type=float, help='the learning rate (or lr= in --optimizer-args)'),
    Option('--no-decay-bias-norm', 'train', action='store_true', help='no weight decay for biases and '
                'normalization weights (parameters of fewer than 2 dimensions): a second parameter group with '
                'weight_decay=0'),
    Option('--schedule-lr', 'train', metavar='NAME', help='a learning-rate schedule stepped once per optimizer '
                'step: cosine, linear, step, exponential, polynomial, onecycle, or a torch.optim.lr_scheduler '
                'class; cosine and linear run to the end of the run unless --schedule-args says otherwise'),
    Option('--schedule-args', 'train', value=_keywords('--schedule-args'), metavar='K=V[,K=V...]', help='the '
                "schedule's keyword options, e.g. step_size=10,gamma=0.5"),
    Option('--warmup', 'train', type=int, metavar='STEPS', help='linear warm-up from lr/(STEPS+1) over STEPS '
                'optimizer steps before the schedule'),
    Option('--clip-grad-norm', 'train', type=float, metavar='MAX', help='scale the gradients so that their global '
                'norm over every stage is at most MAX, as torch.nn.utils.clip_grad_norm_ on the whole model'),
    Option('--accumulate', 'train', type=int, metavar='K', help='step the optimizer every K iterations on their '
                'summed gradients: a K times larger effective batch in the memory of one'),
    Option('--schedule', 'train', choices=schedules.names(), help='the pipeline schedule: ' + '; '.join(
                f'{name}: {schedules.get(name).description}' for name in schedules.names())
                + ' (an asynchronous one drains the pipeline at the end of each call)'),
    Option('--vertical-sync', 'train', action='store_true', help='with --schedule 1f1b-async: every stage computes '
                "a micro-batch with the weight version the first stage used for it (PipeDream's vertical sync)"),
    Option('--sync', 'train', choices=SYNC_METHODS, help="pipelined scatter-reduce (FuncPipe) or LambdaML's three "
                'phases'),
    Option('--non-finite', 'train', choices=NON_FINITE, help="a NaN or infinity in the data or in an iteration's "
                'loss: warn (default), stop the run (error; it stays resumable), or ignore'),
    Option('--checkpoint-every', 'train', type=int, metavar='N', help='checkpoint every N iterations (0, the '
                'default: the shortest interval whose upload costs at most 5%% of an iteration, by the cost '
                'model); a lost function recovers with any N, and `flatpack resume` restarts after the last '
                'checkpoint'),
    Option('--precision', 'train', choices=PRECISIONS, help='bf16: autocast in every stage with float32 master '
                'weights and optimizer state; tensors cross stage boundaries in bfloat16 (half the bytes, which '
                "the planner counts). fp16: the same in float16, with torch.amp.GradScaler's loss scaling (a step "
                'any stage overflowed in is skipped on every stage)'),
    Option('--eval-every', 'evaluation', type=int, metavar='N', help='every N iterations, the loss (and for '
                'classification the accuracy) on held-out data through the inference path, in the progress line '
                'and the report'),
    Option('--eval-data', 'evaluation', metavar='SOURCE', help='the held-out data for --eval-every, a source as '
                '--data takes (without --data: two synthetic batches of another seed)'),
    Option('--eval-fraction', 'evaluation', type=float, metavar='F', help="hold out the last F of --data's shards "
                '(whole shards) for --eval-every'),
    # no argparse choices: a cloud target gets JobOptions.check's pointer to flatpack deploy
    Option('--target', 'plan', help=f"where the functions run: {' or '.join(RUN_TARGETS)} (local: processes of "
                'this machine, the default; ray: Ray tasks on the cluster at --address); the cloud targets deploy '
                'with flatpack deploy'),
    Option('--address', 'plan', metavar='ADDRESS', help=RAY_ADDRESS_HELP),
    Option('--solver', 'plan', help=_SOLVER_HELP),
    Option('--passes', 'plan', help='pass pipeline, e.g. '
                '"fuse-elementwise,merge-branches,coarsen{max-layers=48,by=time}"'),
    Option('--stages', 'plan', type=int, metavar='N', help=stages_help('train')),
    Option('--split-points', 'plan', value=names, metavar='MODULE[,MODULE...]', help=split_points_help('train')),
    Option('--replicas', 'plan', value=_ints('--replicas'), metavar='D[,D...]', help='data-parallel degrees the '
                'solver may give a stage (default 1,2)'),
    Option('--stage-replicas', 'plan', value=_ints('--stage-replicas'), metavar='D,D[,D...]', help='with --stages or '
                '--split-points: each stage\'s replica degree, in stage order (PipeDream\'s 1F1B-RR plans, e.g. '
                '--stages 2 --stage-replicas 1,2); not candidates for a solver, which --replicas lists'),
    Option('--memory', 'plan', field='memory_mb', value=_ints('--memory'), metavar='MB[,MB...]', help='memory '
                "tiers the solver may pick (default: the local platform's)"),
    Option('--pick', 'plan', choices=PICKS, help="FuncPipe's recommended plan from the front, or its fastest"),
    Option('--recompute', 'plan', choices=RECOMPUTE, help='auto: the solver may let a stage recompute its '
                'activations in the backward instead of keeping them (less memory, one more forward); the plan '
                'shows which do'),
    Option('--calibration', 'plan', value=Path, metavar='FILE', help='what `flatpack calibrate --target local` '
                'measured: the prediction uses it (the plan records its digest)'),
    Option('--replan', 'plan', action='store_true', help='every --epoch-iterations N iterations, re-fit the cost '
                'model to what the run measured, solve again, and switch the run onto a plan predicted at least '
                '--replan-threshold faster (the checkpoints move onto the new cuts: the run ends with the weights '
                'one plan reaches)'),
    Option('--epoch-iterations', 'plan', type=int, metavar='N', help='with --replan or --elastic auto: the '
                "iterations between re-plans (at least 3: each re-fit leaves out an epoch's first 2)"),
    Option('--replan-threshold', 'plan', type=float, metavar='F', help='with --replan: the least predicted saving, '
                "a share of an iteration, that switches plans (default 0.05: below the re-fitted model's own error "
                "a switch's cold starts would not pay)"),
    Option('--elastic', 'plan', choices=('auto',), help='auto: every --epoch-iterations N iterations, re-fit the '
                'cost model to what the run measured and change the replica degrees (and the cuts) when the '
                "predicted saving exceeds the model's own error on this run (|predicted - measured| / measured of "
                'the epochs so far); every decision, kept or changed, is logged with its predicted and measured '
                'effect (Hydrozoa §3.5; the checkpoints move as with --replan)'),
    Option('--elastic-objective', 'plan', choices=OBJECTIVES, help='with --elastic auto: what a change must save '
                'per iteration, time (the default) or dollars at the platform\'s prices'),
    Option('--elastic-replicas', 'plan', value=_ints('--elastic-replicas'), metavar='MIN,MAX', help='with '
                '--elastic auto: the least and greatest replicas of a stage (default 1 and the micro-batches)'),
    Option('--save', 'output', value=Path, metavar='PATH.safetensors', help='also write the trained weights here, '
                "by the original model's state_dict names (tied weights once); load with "
                'model.load_state_dict(flatpack.load_state_dict(PATH)). e.g. --save trained.safetensors'),
    Option('--out', 'output', value=Path, help='where the timeline PNG and worker logs go'),
    Option('--no-verify', 'output', field='verify', value=_negated, action='store_true', help='skip the '
                'single-process equivalence check'),
)


def add_run_options(parser: Any) -> None:
    """The run verb's options, one argparse group per JobOptions group."""
    for group, title in GROUP_TITLES.items():
        options = parser.option_group(title)
        for option in RUN_OPTIONS:
            if option.group == group:
                options.add_argument(option.flag, default=argparse.SUPPRESS, **option.arguments)


def job_values(args: argparse.Namespace) -> dict[str, Any]:
    """The JobOptions fields the parsed ``args`` give (those not given keep JobOptions's
    defaults), by field name, as :meth:`JobOptions.of` takes them."""
    given = vars(args)
    values = {}
    for option in RUN_OPTIONS:
        if option.dest in given:
            raw = given[option.dest]
            values[option.field] = option.value(raw) if option.value is not None and raw is not None else raw
    return values
