"""The first hour of a new user (issue 41), rerun: the README's commands and the mistakes a new
user plausibly makes, each on a fresh clone, each checked against what the README says.

The script clones the repository's HEAD into a temporary directory (``git clone``, no network:
a local clone), runs every case there as ``python -m flatpack ...`` with this interpreter and
``PYTHONPATH`` at the clone, in one scratch directory whose files the earlier cases leave for the
later ones (``compile`` writes ``out/``, ``check`` verifies it with the digest ``compile``
printed). Each case states what the README promises:

- the exit code (0 ok, 1 a run failed, 2 bad input with nothing started);
- words the output must hold: for a mistake, its cause and the fix the message offers;
- files the command must write, and for a refused run the directory it must NOT leave behind;
- never a ``Traceback`` on stdout or stderr, and for an example shown as a pipeline never
  "no pipeline cut was exercised".

Prints a table (case, expected, got, ok) and the totals; exits 1 when any case failed.
``--quick`` gives the long-running commands (training runs, the demo, a full-size plan) smaller
sizes; the default runs every case as the README writes it. ``--only WORD`` keeps the cases
whose name holds WORD.

Run from the repository root: ``python benchmarks/newcomer.py [--quick]`` (``HF_HUB_OFFLINE=1``;
the README's ``[hf]`` extra installed for the BERT cases).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PIPELINE_NOT_CUT = "no pipeline cut was exercised"


@dataclass(frozen=True)
class Result:
    """What one command did."""

    exit_code: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@dataclass(frozen=True)
class Case:
    """One command and what the README says it does.

    ``argv`` follows ``python -m flatpack``; ``{digest}`` in it is replaced by the digest the
    ``compile`` case printed. ``says`` are words (case-insensitive) the output must hold.
    ``writes`` are paths that must exist afterwards, ``leaves_no`` paths that must not.
    ``quick`` is the argv ``--quick`` runs instead. ``pipeline``: the README presents it as a
    pipeline, so it must cut at least two stages.
    """

    name: str
    argv: tuple[str, ...]
    exit_code: int = 0
    says: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    leaves_no: tuple[str, ...] = ()
    quick: tuple[str, ...] | None = None
    pipeline: bool = False
    check: Callable[[Result], str | None] | None = None
    timeout_s: float = 1800.0


def _mistake(name: str, argv: Sequence[str], *says: str, leaves_no: Sequence[str] = ()) -> Case:
    return Case(name, tuple(argv), exit_code=2, says=says, leaves_no=tuple(leaves_no), timeout_s=300.0)


def _json_has(key: str) -> Callable[[Result], str | None]:
    def check(result: Result) -> str | None:
        import json

        try:
            document = json.loads(result.stdout)
        except ValueError as error:
            return f"stdout is not one JSON document ({error})"
        found = key in document if isinstance(document, dict) else any(key in item for item in document)
        return None if found else f"the JSON document has no {key!r}"
    return check


def _stages_at_least(count: int) -> Callable[[Result], str | None]:
    def check(result: Result) -> str | None:
        found = re.search(r"wrote (\d+) stages?", result.output)
        if found is None:
            return "no 'wrote N stages' line"
        return None if int(found.group(1)) >= count else f"{found.group(1)} stage(s), wanted {count}"
    return check


RUN_FILES = ("run/timeline.png", "run/timeline.json", "run/compiled/flatpack.json", "run/logs",
             "run/trained.safetensors")

COMMANDS: tuple[Case, ...] = (
    Case("version", ("--version",), says=("flatpack",)),
    Case("help", ("--help",), says=("exit", "--config")),
    Case("run --help", ("run", "--help"), says=("--config", "--micro-batches")),
    Case("plan --help", ("plan", "--help"), says=("--config",)),
    Case("inspect mlp", ("inspect", "mlp"), says=("linear",)),
    Case("inspect bert", ("inspect", "bert"), says=("bert.encoder",)),
    Case("inspect --json", ("inspect", "mlp", "--json"), check=_json_has("layers")),
    Case("compile file:factory", ("compile", "my_model.py:build", "--stages", "4", "--out", "out/"),
         says=("digest",), writes=("out/flatpack.json", "out/flatpack.index.json"), check=_stages_at_least(4)),
    Case("check --digest", ("check", "out/", "--digest", "{digest}"), says=("digest",)),
    Case("sign", ("sign", "out/", "--key", "key.pem", "--name", "my-model", "--version", "3"), says=("signed",)),
    Case("check --verify-key", ("check", "out/", "--verify-key", "key.pub", "--name", "my-model",
                                "--min-version", "3"), says=("my-model",)),
    Case("profile", ("profile", "resnet50", "--batch-sizes", "1,2", "--repeats", "2", "--max-seconds", "60"),
         quick=("profile", "mlp", "--batch-sizes", "1,2", "--repeats", "2", "--max-seconds", "20")),
    Case("platforms", ("platforms",), says=("aws-lambda",)),
    Case("platforms aws-lambda --json", ("platforms", "aws-lambda", "--json"), check=_json_has("tiers")),
    Case("plan resnet101 full", ("plan", "resnet101", "--size", "full", "--target", "aws-lambda", "--batch", "64",
                                 "--micro-batches", "16", "--solver", "dp", "--passes",
                                 "fuse-elementwise,merge-branches,coarsen{max-layers=32,by=time}",
                                 "--plot", "front.png"),
         says=("recommend",), writes=("front.png",),
         quick=("plan", "resnet50", "--target", "aws-lambda", "--batch", "64", "--micro-batches", "16",
                "--solver", "dp", "--plot", "front.png")),
    Case("plan resnet50 dp", ("plan", "resnet50", "--target", "aws-lambda", "--batch", "64", "--micro-batches", "16",
                              "--solver", "dp", "--plot", "front.png"), says=("recommend",), writes=("front.png",)),
    Case("plan --json", ("plan", "bert", "--json"), check=_json_has("plans")),
    Case("plan --config (a run's)", ("plan", "mlp", "--config", "run.toml"), says=("recommend",)),
    Case("run vgg16 --stages 2 (README)", ("run", "vgg16", "--batch", "16", "--micro-batches", "4", "--iterations",
                                           "4", "--stages", "2", "--schedule", "1f1b", "--out", "run/"),
         writes=RUN_FILES, pipeline=True, says=("fixed cuts: 2 stages", "schedule 1f1b"),
         quick=("run", "vgg16", "--batch", "16", "--micro-batches", "4", "--iterations", "2", "--stages", "2",
                "--schedule", "1f1b", "--out", "run/")),
    Case("resume a finished run", ("resume", "run/"), says=("run/",)),
    Case("plan --from-run", ("plan", "--from-run", "run/"), says=("plan",)),
    Case("run vgg16 dp 1f1b", ("run", "vgg16", "--batch", "64", "--micro-batches", "8", "--iterations", "4",
                               "--solver", "dp", "--schedule", "1f1b", "--out", "run-dp/"),
         says=("schedule 1f1b", "the plan that runs (dp"),
         quick=("run", "vgg16", "--batch", "16", "--micro-batches", "4", "--iterations", "2", "--solver", "dp",
                "--schedule", "1f1b", "--out", "run-dp/")),
    Case("run bf16 recompute", ("run", "vgg16", "--precision", "bf16", "--recompute", "auto", "--out", "run-bf16/"),
         quick=("run", "mlp", "--precision", "bf16", "--recompute", "auto", "--iterations", "2",
                "--out", "run-bf16/")),
    Case("run --data --save", ("run", "bert", "--data", "shards/", "--batch", "8", "--micro-batches", "4",
                               "--epochs", "2", "--save", "bert.safetensors", "--out", "run-data/"),
         writes=("bert.safetensors",)),
    Case("run training knobs", ("run", "bert", "--data", "shards/", "--eval-fraction", "0.25", "--eval-every", "2",
                                "--batch", "8", "--micro-batches", "2", "--stages", "2", "--epochs", "2",
                                "--optimizer", "adamw", "--optimizer-args", "lr=3e-4,weight_decay=0.01",
                                "--no-decay-bias-norm", "--schedule-lr", "cosine", "--warmup", "1",
                                "--clip-grad-norm", "1.0", "--precision", "bf16", "--out", "run-knobs/"),
         pipeline=True),
    Case("run --split-points", ("run", "bert", "--split-points", "bert.encoder.layer.2,cls", "--out", "run-split/"),
         pipeline=True, says=("fixed cuts",),
         quick=("run", "bert", "--split-points", "bert.encoder.layer.2,cls", "--iterations", "2",
                "--out", "run-split/")),
    Case("run --config", ("run", "vgg16", "--config", "run.toml", "--out", "run-config/"),
         quick=("run", "mlp", "--config", "run.toml", "--iterations", "2", "--out", "run-config/")),
    Case("run --replan", ("run", "vgg16", "--iterations", "12", "--replan", "--epoch-iterations", "4",
                          "--out", "run-replan/"),
         quick=("run", "mlp", "--iterations", "6", "--replan", "--epoch-iterations", "3", "--out", "run-replan/")),
    Case("run mlp -q", ("run", "mlp", "-q", "--out", "run-mlp/")),
    Case("run mlp --json", ("run", "mlp", "--json", "--iterations", "2", "--out", "run-json/"),
         check=_json_has("comparison")),
    # the first demo (an empty cache) predicts uncalibrated and names the command that calibrates
    Case("demo", ("demo", "--out", "demo/"), pipeline=True,
         says=("uncalibrated", "flatpack demo --calibration measure", "passed: equivalent"),
         writes=("demo/timeline.png", "demo/trained.safetensors"),
         quick=("demo", "--iterations", "4", "--out", "demo/")),
    # the command the first demo names: it calibrates this host, caches it and predicts with it
    Case("demo --calibration measure", ("demo", "--calibration", "measure", "--out", "demo-cal/"), pipeline=True,
         says=("predictions (FuncPipe's cost model) calibrated", "passed: equivalent"),
         quick=("demo", "--calibration", "measure", "--iterations", "4", "--out", "demo-cal/")),
    Case("demo bert", ("demo", "--model", "bert", "--out", "demo-bert/"), pipeline=True,
         quick=("demo", "--model", "bert", "--iterations", "4", "--calibration", "none", "--out", "demo-bert/")),
    Case("compile mlp (serve's artifact)", ("compile", "mlp", "--out", "mlp-art"), says=("digest",)),
    Case("deploy --dry-run", ("deploy", "vgg16", "--target", "aws-lambda", "--dry-run", "--out", "deploy/"),
         says=("teardown",), writes=("deploy/",)),
    Case("teardown a dry run", ("teardown", "deploy/"), says=("dry run",)),
    Case("deploy gpu-container", ("deploy", "vgg16", "--target", "gpu-container", "--out", "k8s-run/"),
         writes=("k8s-run/",)),
    Case("calibrate local", ("calibrate", "--target", "local", "--out", "calibration.json"),
         writes=("calibration.json",)),
    Case("run --calibration FILE", ("run", "vgg16", "--calibration", "calibration.json", "--out", "run-cal/"),
         quick=("run", "mlp", "--calibration", "calibration.json", "--iterations", "2", "--out", "run-cal/")),
)

MISTAKES: tuple[Case, ...] = (
    _mistake("misspelt option", ("run", "mlp", "--iteratoins", "3"), "--iterations", leaves_no=("flatpack-run",)),
    _mistake("misspelt verb", ("rn", "mlp"), "did you mean", "run"),
    _mistake("unknown model", ("run", "resnet999"), "resnet999", "did you mean", leaves_no=("flatpack-run",)),
    _mistake("demo unknown model", ("demo", "--model", "resnet999"), "resnet999"),
    _mistake("missing model file", ("run", "nowhere.py:build"), "no such file"),
    _mistake("file without the factory", ("run", "my_model.py:nothing"), "nothing"),
    _mistake("stages 0", ("run", "mlp", "--stages", "0"), "--stages", "positive"),
    _mistake("batch 0", ("run", "mlp", "--batch", "0"), "--batch", "e.g."),
    _mistake("micro-batches do not divide", ("run", "mlp", "--batch", "16", "--micro-batches", "3"),
             "does not divide", "use --micro-batches"),
    _mistake("iterations 0", ("run", "mlp", "--iterations", "0"), "--iterations"),
    _mistake("unknown split point", ("run", "mlp", "--split-points", "nope.layer"), "nope.layer", "named_modules"),
    _mistake("stages and split points", ("run", "mlp", "--stages", "2", "--split-points", "2"), "--split-points"),
    _mistake("unknown schedule", ("run", "mlp", "--schedule", "bogus"), "bogus", "1f1b"),
    _mistake("unknown solver", ("plan", "mlp", "--solver", "bogus"), "bogus", "dp"),
    _mistake("unknown target", ("run", "mlp", "--target", "bogus"), "bogus", "local"),
    _mistake("unknown precision", ("run", "mlp", "--precision", "fp8"), "fp8", "bf16"),
    _mistake("unknown optimizer", ("run", "mlp", "--optimizer", "bogus"), "bogus", "adamw"),
    _mistake("optimizer args not KEY=VALUE", ("run", "mlp", "--optimizer-args", "garbage"), "KEY=VALUE"),
    _mistake("unknown loss", ("run", "mlp", "--loss", "hinge"), "hinge", "cross-entropy"),
    _mistake("memory under every tier", ("plan", "mlp", "--memory", "1"), "--memory"),
    _mistake("config is missing", ("run", "mlp", "--config", "missing.toml"), "missing.toml", "does not exist"),
    _mistake("config is not TOML", ("run", "mlp", "--config", "broken.toml"), "broken.toml"),
    _mistake("config key no verb takes", ("run", "mlp", "--config", "unknown-key.toml"), "colour"),
    _mistake("config integer micro-batches", ("run", "mlp", "--config", "u.toml", "--micro-batches", "3"),
             "does not divide"),
    _mistake("data directory missing", ("run", "mlp", "--data", "no-shards/"), "no-shards", "no such directory"),
    _mistake("data directory empty", ("run", "mlp", "--data", "empty-shards/"), "empty-shards", "*.safetensors"),
    _mistake("shard with 4 channels", ("run", "tiny-resnet", "--data", "four-channel-shards/", "--batch", "8",
                                                "--micro-batches", "2"),
             "part-0.safetensors", "channel", leaves_no=("flatpack-run",)),
    _mistake("shard without a target", ("run", "mlp", "--data", "no-target-shards/"), "target"),
    _mistake("data the batch does not divide", ("run", "mlp", "--data", "mlp-shards/", "--batch", "7",
                                                "--micro-batches", "1"), "--drop-last"),
    _mistake("check without digest match", ("check", "out/", "--digest", "0" * 64), "digest"),
    _mistake("check a directory that is no artifact", ("check", "shards/"), "flatpack.json"),
    _mistake("check with the wrong name", ("check", "out/", "--verify-key", "key.pub", "--name", "other",
                                           "--min-version", "3"), "other"),
    _mistake("sign without a key file", ("sign", "out/", "--key", "nokey.pem", "--name", "m", "--version", "1"),
             "nokey.pem"),
    _mistake("resume a directory that is no run", ("resume", "shards/"), "run.json"),
    _mistake("teardown with no deployment", ("teardown", "shards/"), "--out"),
    _mistake("plan --from-run without a run", ("plan", "--from-run", "shards/"), "events.json", "flatpack run"),
    _mistake("calibration file missing", ("run", "mlp", "--calibration", "nocal.json"), "nocal.json"),
)


def _workspace_files(root: Path) -> None:
    """The files the cases read: a model file, configs, a key pair and shard directories."""
    import torch
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from safetensors.torch import save_file

    (root / "my_model.py").write_text(
        "import torch\nfrom torch import nn\n\n\ndef build():\n"
        "    layers = [m for _ in range(6) for m in (nn.Linear(32, 32), nn.ReLU())]\n"
        "    return nn.Sequential(*layers, nn.Linear(32, 4)), (torch.randn(8, 32),)\n")
    (root / "run.toml").write_text("batch = 64\nmicro-batches = 8\nreplicas = [1, 2]\niterations = 4\n")
    (root / "u.toml").write_text("batch = 16\nmicro-batches = 2\n")
    (root / "broken.toml").write_text("batch = = 3\n")
    (root / "unknown-key.toml").write_text("colour = 'blue'\n")
    key = Ed25519PrivateKey.generate()
    (root / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    (root / "key.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                 serialization.PublicFormat.SubjectPublicKeyInfo))
    generator = torch.Generator().manual_seed(1)
    shards = root / "shards"
    shards.mkdir()
    for index in range(2):   # BERT's masked-LM rows (the built-in example: vocabulary 512, 16 tokens)
        ids = torch.randint(0, 512, (8, 16), generator=generator)
        save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()},
                  str(shards / f"part-{index}.safetensors"))
    (root / "empty-shards").mkdir()
    for name, inputs in (("four-channel-shards", torch.randn(16, 4, 16, 16)),):
        (root / name).mkdir()
        save_file({"x": inputs, "target": torch.randint(0, 10, (16,))}, str(root / name / "part-0.safetensors"))
    (root / "no-target-shards").mkdir()
    save_file({"x": torch.randn(16, 64)}, str(root / "no-target-shards" / "part-0.safetensors"))
    (root / "mlp-shards").mkdir()
    save_file({"x": torch.randn(16, 64), "target": torch.randint(0, 10, (16,))},
              str(root / "mlp-shards" / "part-0.safetensors"))


@dataclass
class Session:
    """The clone, the scratch directory the cases run in, and what earlier cases printed."""

    clone: Path
    scratch: Path
    quick: bool
    digest: str = ""
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)

    def run(self, case: Case) -> Result:
        argv = [word.replace("{digest}", self.digest) for word in (case.quick if self.quick and case.quick
                                                                   else case.argv)]
        # an empty cache, as a new user's: profiles and the host's calibration are measured anew
        env = {**os.environ, "PYTHONPATH": str(self.clone), "HF_HUB_OFFLINE": "1", "COLUMNS": "120",
               "FLATPACK_CACHE_DIR": str(self.scratch.parent / "cache")}
        started = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "flatpack", *argv], cwd=self.scratch, env=env,
                                  capture_output=True, text=True, timeout=case.timeout_s)
        except subprocess.TimeoutExpired as expired:
            return Result(-1, str(expired.stdout or ""), f"timed out after {case.timeout_s:.0f} s",
                          time.perf_counter() - started)
        return Result(done.returncode, done.stdout, done.stderr, time.perf_counter() - started)

    def verdict(self, case: Case, result: Result) -> list[str]:
        """What the case did that the README does not say it does."""
        wrong = []
        if result.exit_code != case.exit_code:
            wrong.append(f"exit {result.exit_code}")
        if "Traceback" in result.output:
            wrong.append("a traceback")
        lowered = result.output.lower()
        wrong += [f"no {word!r}" for word in case.says if word.lower() not in lowered]
        wrong += [f"no {path}" for path in case.writes if not (self.scratch / path).exists()]
        wrong += [f"left {path}" for path in case.leaves_no if (self.scratch / path).exists()]
        if case.pipeline and PIPELINE_NOT_CUT in result.output:
            wrong.append("one stage")
        if case.check is not None and result.exit_code == case.exit_code:
            found = case.check(result)
            wrong += [found] if found else []
        return wrong

    def play(self, case: Case) -> bool:
        result = self.run(case)
        if case.name.startswith("compile file"):
            found = re.search(r"digest ([0-9a-f]{64})", result.output)
            self.digest = found.group(1) if found else ""
        wrong = self.verdict(case, result)
        expected = f"exit {case.exit_code}" + (f", says {', '.join(case.says)}" if case.says else "")
        got = f"exit {result.exit_code} in {result.seconds:.1f} s" + (f": {'; '.join(wrong)}" if wrong else "")
        self.rows.append((case.name, expected, got, "ok" if not wrong else "FAIL"))
        # each case as it ends, on stderr: a long run interrupted still says how far it got
        print(f"{'ok  ' if not wrong else 'FAIL'} {case.name}: {got}", file=sys.stderr, flush=True)
        if wrong:
            tail = "\n".join(result.output.strip().splitlines()[-6:])
            print(f"--- {case.name}: {' '.join(case.argv)}\n{tail}", file=sys.stderr, flush=True)
        return not wrong


def clone_head(into: Path) -> Path:
    """A fresh clone of this repository's HEAD (local, no network)."""
    clone = into / "flatpack"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True)
    return clone


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller sizes for the long-running commands")
    parser.add_argument("--only", default="", help="run only the cases whose name holds this word")
    args = parser.parse_args(argv)
    from flatpack.table import format_table

    with tempfile.TemporaryDirectory(prefix="flatpack-newcomer-") as temporary:
        root = Path(temporary)
        session = Session(clone=clone_head(root), scratch=root / "work", quick=args.quick)
        session.scratch.mkdir()
        _workspace_files(session.scratch)
        counts = {}
        for kind, cases in (("commands", COMMANDS), ("mistakes", MISTAKES)):
            chosen = [case for case in cases if args.only in case.name]
            counts[kind] = (sum(session.play(case) for case in chosen), len(chosen))
    print(format_table(("case", "expected", "got", "ok"), session.rows))
    for kind, (passed, total) in counts.items():
        print(f"{kind}: {passed} of {total} as the README says")
    return 0 if all(passed == total for passed, total in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
