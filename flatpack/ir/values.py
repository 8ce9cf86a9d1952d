"""What a graph value is, recorded from one run on the example inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from flatpack.ir import meta

TENSOR = "tensor"
SCALAR = "scalar"
NONE = "none"
OTHER = "other"

_SCALAR_TYPES = (bool, int, float, str, torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclass(frozen=True)
class ValueInfo:
    """Shape, dtype and size of one value as seen on the example inputs.

    ``kind`` is ``tensor`` (shape, dtype, nbytes), ``scalar`` (a Python number, a size or
    a string: crosses a boundary as JSON), ``none`` or ``other`` (tuples of tensors from
    multi-output ops and anything else; such values never cross a boundary).
    """

    kind: str
    shape: tuple[int, ...] = ()
    dtype: str = ""
    nbytes: int = 0
    python_type: str = ""

    @classmethod
    def of(cls, value: Any) -> ValueInfo:
        if isinstance(value, torch.Tensor):
            return cls(
                kind=TENSOR,
                shape=tuple(int(s) for s in value.shape),
                dtype=str(value.dtype).removeprefix("torch."),
                nbytes=value.numel() * value.element_size(),
            )
        if value is None:
            return cls(kind=NONE, python_type="NoneType")
        if isinstance(value, torch.Size):
            return cls(kind=SCALAR, python_type="size", shape=(len(value),), nbytes=8 * len(value))
        if isinstance(value, _SCALAR_TYPES):
            return cls(kind=SCALAR, python_type=type(value).__name__, nbytes=8)
        return cls(kind=OTHER, python_type=type(value).__name__)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"kind": self.kind, "bytes": self.nbytes}
        if self.kind == TENSOR:
            out.update(shape=list(self.shape), dtype=self.dtype)
        else:
            out["type"] = self.python_type
        return out


class ValueProp(torch.fx.Interpreter):
    """Runs the graph once and stores a :class:`ValueInfo` under ``node.meta[VALUE]``.

    Like ``torch.fx.passes.shape_prop.ShapeProp``, but it also records non-tensor values
    (sizes, masks' dtypes) because those cross stage boundaries too.
    """

    def run_node(self, node: torch.fx.Node) -> Any:
        result = super().run_node(node)
        node.meta[meta.VALUE] = ValueInfo.of(result)
        return result

    def propagate(self, *args: Any) -> Any:
        with torch.no_grad():
            return self.run(*args)


def value_info(node: torch.fx.Node) -> ValueInfo:
    return node.meta.get(meta.VALUE) or ValueInfo(kind=OTHER)
