"""Validation during training: the loss on held-out batches (and, for classification, the
accuracy) of the weights trained so far, through whatever serves predictions: the
deployment's inference path (``Deployment.infer``: the latest checkpoint, modules in eval
mode) during a run, or a single-process model for the reference, so both are measured alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from flatpack.analysis.reference import first_output
from flatpack.data import first_batch_rows
from flatpack.runtime.optim import loss_value


@dataclass(frozen=True)
class Evaluation:
    """The held-out loss after ``iteration`` iterations: the mean over ``samples`` samples;
    ``accuracy``: the share of samples whose arg-max class is the target (cross-entropy
    runs; None otherwise)."""

    iteration: int
    loss: float
    accuracy: float | None
    samples: int

    def short(self) -> str:
        """What the progress line shows."""
        accuracy = f" acc {self.accuracy:.3f}" if self.accuracy is not None else ""
        return f"eval loss {self.loss:.4f}{accuracy} @ iter {self.iteration}"

    def describe(self) -> str:
        accuracy = f", accuracy {self.accuracy:.3f}" if self.accuracy is not None else ""
        return (f"evaluation after {self.iteration} iterations on {self.samples} held-out samples: loss "
                f"{self.loss:.4f}{accuracy}")


def evaluate(predict: Callable[[Any], Any], batches: Iterable[tuple[Any, Any]], loss: str, *,
             iteration: int) -> Evaluation:
    """The mean ``loss`` of ``predict``'s outputs over ``batches`` of ``(inputs, target)``
    (each batch's mean weighted by its samples) and the arg-max accuracy under cross-entropy.
    A model that returns its own loss (``loss="output"``) is given its labels in the inputs."""
    total = correct = 0.0
    samples = 0
    with torch.no_grad():
        for inputs, target in batches:
            rows = first_batch_rows((inputs, target))
            output = first_output(predict(inputs))
            total += float(loss_value(loss, output, target)) * rows
            if loss == "cross_entropy":
                correct += float((output.argmax(dim=-1) == target).sum())
            samples += rows
    if not samples:
        raise ValueError("evaluation needs at least one held-out batch")
    return Evaluation(iteration, total / samples, correct / samples if loss == "cross_entropy" else None, samples)
