"""What the profiler measured, as plain data (no torch): the contract between the profiler
(``profiler.py``), the cost models and the solvers.

Times and sizes that grow with the micro-batch are stored as :class:`Linear` fits
``per_sample * batch + fixed`` over the batch sizes the profiler ran, as FuncPipe's model
profiler does (FuncPipe §4). A :class:`LayerProfile` sits in ``layer.meta["profile"]``
(``ir.meta.PROFILE``) and in ``ChainLayer.profile``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

from flatpack.errors import InputError
from flatpack.linear import Linear

# the directory profiles are cached in (flatpack.profiler), and the rl solver's policies beside them
CACHE_ENV = "FLATPACK_CACHE_DIR"

OPTIMIZERS = ("sgd", "sgd-momentum", "adam")


@dataclass(frozen=True)
class LayerProfile:
    """One layer of the chain, measured on the host.

    ``forward_s`` / ``backward_s``: median seconds of the layer's forward and backward for a
    micro-batch, as a line in the micro-batch size. ``saved_bytes``: bytes autograd keeps
    for backward (what ``saved_tensors_hooks`` saw, parameters excluded). ``output_bytes``:
    bytes crossing the boundary after the layer (the layer's share of it: every value that
    crosses, as in ``LayerGraph.boundary``). ``peak_bytes``: the most memory the layer's
    forward plus backward held at once beyond its parameters. ``optimizer_state_bytes``:
    per optimizer name in :data:`OPTIMIZERS`, the state bytes one step creates.
    ``inference_s``: the forward under ``torch.no_grad``, as served (see
    :meth:`inference_line`). ``saved_boundary_bytes``: the parts of ``saved_bytes`` that
    are values crossing the layer's boundaries (its inputs and outputs), by value name, so
    that :func:`stage_saved_bytes` counts a tensor that several layers of a stage keep once.
    """

    name: str
    forward_s: Linear
    backward_s: Linear
    param_bytes: int
    grad_bytes: int
    buffer_bytes: int
    saved_bytes: Linear
    output_bytes: Linear
    peak_bytes: Linear
    optimizer_state_bytes: dict[str, int] = field(default_factory=dict, hash=False)
    saved_boundary_bytes: dict[str, Linear] = field(default_factory=dict, hash=False)
    inference_s: Linear | None = None

    def inference_line(self) -> Linear:
        """Seconds of a forward under ``torch.no_grad`` (serving), a line in the batch size.
        Profiles without that measurement fall back to the training forward, which also
        records the autograd graph and so over-estimates."""
        return self.inference_s if self.inference_s is not None else self.forward_s

    def optimizer_bytes(self, optimizer: str) -> int:
        if optimizer not in self.optimizer_state_bytes:
            raise InputError(f"unknown optimizer {optimizer!r}; profiled optimizers: "
                             f"{', '.join(sorted(self.optimizer_state_bytes))}")
        return self.optimizer_state_bytes[optimizer]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in _LINES:
            data[key] = getattr(self, key).to_json()
        data["saved_boundary_bytes"] = {name: line.to_json() for name, line in self.saved_boundary_bytes.items()}
        data["inference_s"] = self.inference_s.to_json() if self.inference_s is not None else None
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerProfile:
        # keyword arguments by field name: the per-sample lines, and two fields of other types
        lines: dict[str, Any] = {key: Linear.from_json(data[key]) for key in _LINES}
        lines["saved_boundary_bytes"] = {name: Linear.from_json(line)
                                         for name, line in data.get("saved_boundary_bytes", {}).items()}
        lines["inference_s"] = Linear.from_json(data["inference_s"]) if data.get("inference_s") else None
        return cls(name=data["name"], param_bytes=int(data["param_bytes"]), grad_bytes=int(data["grad_bytes"]),
                   buffer_bytes=int(data["buffer_bytes"]),
                   optimizer_state_bytes={k: int(v) for k, v in data["optimizer_state_bytes"].items()}, **lines)


_LINES = ("forward_s", "backward_s", "saved_bytes", "output_bytes", "peak_bytes")


def stage_saved_bytes(layers: Sequence[LayerProfile], micro_batch: float) -> float:
    """Bytes autograd keeps for one micro-batch of a stage running ``layers`` (consecutive).

    Each layer was measured alone, so a tensor crossing between layers of the stage that
    the producer keeps as its output (a ReLU's result) and a reader as its input (the next
    convolution's) was counted by both; in the stage it is one storage, counted once.
    """
    return stage_saved_line(layers).at(micro_batch)


class SavedLineSum:
    """:func:`stage_saved_line` of consecutive layers, built one layer at a time: :meth:`add`
    the next layer, :attr:`line` is the line of the layers added so far. A solver's table of
    every stage start..end then costs one ``add`` per entry instead of a pass over the stage.

    A boundary value that several of the layers keep is one storage: the stage counts its
    largest line once. Adding a keeper of a value already kept counts the smaller of the two
    lines as ``_shared`` (the layers' sum over-counts by exactly that), so the line is the
    layers' sum less what they share, with no subtraction of running totals."""

    def __init__(self) -> None:
        self._saved = Linear(0.0)
        self._shared = Linear(0.0)
        self.kept: dict[str, Linear] = {}    # boundary value -> its largest line among the keepers

    def add(self, layer: LayerProfile) -> None:
        self._saved = self._saved + layer.saved_bytes
        for value, line in layer.saved_boundary_bytes.items():
            largest = self.kept.get(value)
            if largest is None:
                self.kept[value] = line
                continue
            self.kept[value] = _largest([largest, line])
            self._shared = self._shared + (line if self.kept[value] is largest else largest)

    @property
    def line(self) -> Linear:
        return self._saved + self._shared.scaled(-1.0)


def _summed(layers: Sequence[LayerProfile]) -> SavedLineSum:
    saved = SavedLineSum()
    for layer in layers:
        saved.add(layer)
    return saved


def stage_saved_line(layers: Sequence[LayerProfile]) -> Linear:
    """:func:`stage_saved_bytes` as a line in the micro-batch size."""
    return _summed(layers).line


def _largest(lines: Sequence[Linear]) -> Linear:
    return max(lines, key=lambda line: (line.per_sample, line.fixed))


def _total(lines: Sequence[Linear]) -> Linear:
    return Linear(sum(line.per_sample for line in lines), sum(line.fixed for line in lines))


def merge_layer_profiles(name: str, layers: Sequence[LayerProfile]) -> LayerProfile:
    """The profile of consecutive layers merged into one (``coarsen`` after profiling).

    Exact for times (the layers run one after another), parameter, gradient, buffer and
    optimizer bytes, the boundary after the group (the last layer's) and the saved
    activations (:func:`stage_saved_bytes`, kept as a line). The peak is an estimate: the
    group's saved activations plus the largest transient any one layer needed beyond its
    own saved ones.
    """
    if not layers:
        raise ValueError("merging needs at least one layer profile")
    if len(layers) == 1:
        return replace(layers[0], name=name)
    summed = _summed(layers)
    saved = summed.line
    transient = _largest([Linear(max(layer.peak_bytes.per_sample - layer.saved_bytes.per_sample, 0.0),
                                 max(layer.peak_bytes.fixed - layer.saved_bytes.fixed, 0.0)) for layer in layers])
    optimizers = {key for layer in layers for key in layer.optimizer_state_bytes}
    inference = [layer.inference_s for layer in layers if layer.inference_s is not None]  # all, or no line
    return LayerProfile(
        name=name,
        forward_s=_total([layer.forward_s for layer in layers]),
        backward_s=_total([layer.backward_s for layer in layers]),
        param_bytes=sum(layer.param_bytes for layer in layers), grad_bytes=sum(layer.grad_bytes for layer in layers),
        buffer_bytes=sum(layer.buffer_bytes for layer in layers), saved_bytes=saved,
        output_bytes=layers[-1].output_bytes, peak_bytes=saved + transient,
        optimizer_state_bytes={key: sum(layer.optimizer_state_bytes.get(key, 0) for layer in layers)
                               for key in sorted(optimizers)},
        saved_boundary_bytes=dict(summed.kept),
        inference_s=_total(inference) if len(inference) == len(layers) else None,
    )


class ProfileWarning(UserWarning):
    """A profile measured something a cost model should not trust blindly: layer times that
    did not grow with the micro-batch (a fitted slope of zero, or a negative one clamped to
    zero). ``ChainProfile.flat_slopes`` names them."""


@dataclass(frozen=True)
class HostInfo:
    """Where a profile was measured: the compute-time model maps these seconds to a tier."""

    device: str            # "cpu" or "cuda"
    threads: int           # torch intra-op threads used while profiling
    cpu: str               # processor name, for the record
    torch_version: str
    gpu: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostInfo:
        return cls(**data)


@dataclass(frozen=True)
class ChainProfile:
    """Every layer's profile plus how and where it was measured."""

    layers: tuple[LayerProfile, ...]
    host: HostInfo
    batch_sizes: tuple[int, ...]
    graph_hash: str
    dtype: str
    repeats: int
    input_bytes: Linear = Linear(0.0, 0.0)   # the model's inputs (boundary -1) per micro-batch
    notes: tuple[str, ...] = field(default=(), compare=False)   # e.g. batch sizes the model refused
    wall_s: float = field(default=0.0, compare=False)
    cache_hit: bool = field(default=False, compare=False)
    # "layer N (name): forward" for each time line whose fitted slope was zero or negative
    # (clamped to zero): the micro-batch does not change those predictions; see ProfileWarning
    flat_slopes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def slopes_trusted(self) -> bool:
        """False when some layer's time did not grow with the micro-batch (``flat_slopes``)."""
        return not self.flat_slopes

    def to_json(self) -> dict[str, Any]:
        return {"layers": [layer.to_json() for layer in self.layers], "host": self.host.to_json(),
                "batch_sizes": list(self.batch_sizes), "graph_hash": self.graph_hash, "dtype": self.dtype,
                "repeats": self.repeats, "input_bytes": self.input_bytes.to_json(), "notes": list(self.notes),
                "wall_s": self.wall_s, "flat_slopes": list(self.flat_slopes)}

    @classmethod
    def from_json(cls, data: dict[str, Any], cache_hit: bool = False) -> ChainProfile:
        return cls(tuple(LayerProfile.from_json(layer) for layer in data["layers"]), HostInfo.from_json(data["host"]),
                   tuple(data["batch_sizes"]), data["graph_hash"], data["dtype"], int(data["repeats"]),
                   Linear.from_json(data["input_bytes"]), tuple(data.get("notes", ())), float(data.get("wall_s", 0.0)),
                   cache_hit, tuple(data.get("flat_slopes", ())))
