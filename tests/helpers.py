"""Shared checks: the staged model computes exactly what the original computes; a `flatpack`
command run as a user runs it, stopped and resumed."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

import flatpack
from flatpack.ir.graph import LayerGraph
from flatpack.verify import check_equivalence


def layer_graph(compiled: flatpack.Compiled) -> LayerGraph:
    """The layer graph of a model compiled in this process (``flatpack.load`` keeps none)."""
    assert compiled.graph is not None, "a loaded Compiled has no layer graph: compile the model here"
    return compiled.graph


def assert_equivalent(model: nn.Module, inputs: Any, compiled: flatpack.Compiled | None = None,
                      staged: flatpack.StagedModule | None = None, **compile_kwargs: Any) -> flatpack.Compiled | None:
    """Stage weights are the original's; outputs and input and parameter gradients are equal."""
    reference = copy.deepcopy(model)
    if staged is None:
        compiled = compiled or flatpack.compile(model, inputs, **compile_kwargs)
        staged = compiled.as_module()
    originals = dict(reference.named_parameters(remove_duplicate=False)) | dict(
        reference.named_buffers(remove_duplicate=False))
    for name, tensor in staged.named_original_parameters():
        if name in originals:
            assert torch.equal(tensor.detach(), originals[name].detach()), f"stage weight {name} differs"
    check_equivalence(reference, staged, inputs).assert_close()
    return compiled


REPOSITORY = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def flatpack_process(arguments: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
    """``python -m flatpack ARGUMENTS`` in a subprocess (unbuffered, its output in ``log_path``),
    as a user's terminal runs it; killed on leaving the block if it is still running."""
    with open(log_path, "wb") as log:
        runner = subprocess.Popen([sys.executable, "-m", "flatpack", *arguments], stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPOSITORY,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            yield runner
        finally:
            if runner.poll() is None:
                runner.kill()
                runner.wait()


def wait_for_output(runner: subprocess.Popen, log_path: Path, text: str, timeout_s: float = 300.0,
                    also: Callable[[], object] | None = None) -> None:
    """Waits until ``text`` shows in ``log_path`` (calling ``also`` on each poll); fails with the
    log's tail if the process ends or ``timeout_s`` passes first."""
    deadline = time.time() + timeout_s
    while text not in log_path.read_text(errors="replace"):
        assert runner.poll() is None and time.time() < deadline, log_path.read_text(errors="replace")[-3000:]
        if also is not None:
            also()
        time.sleep(0.05)


def stop_with_sigterm(runner: subprocess.Popen) -> None:
    """SIGTERM, as a scheduler stops a job; the run must exit 128 + 15, resumable."""
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=60) == 128 + signal.SIGTERM


def assert_same_weights(expected_file: Path, actual_file: Path) -> None:
    """Two safetensors files of trained weights hold the same tensors, bit for bit."""
    from safetensors.torch import load_file

    expected, actual = load_file(expected_file), load_file(actual_file)
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name
