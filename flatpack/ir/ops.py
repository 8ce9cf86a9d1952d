"""What an fx node does, for the passes: its kind, what it mutates, what it aliases, its FLOPs.

Both frontends are covered: ``torch.fx.symbolic_trace`` graphs call torch functions,
``operator`` functions and Tensor methods; ``torch.export`` graphs call ATen overloads,
whose schemas say exactly which arguments are written and which outputs alias an input.
For the fx names the lists below are conservative: calling a view what is sometimes a copy
only adds an ordering constraint, never a wrong answer.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx

from flatpack.ir import meta
from flatpack.ir.values import TENSOR, value_info

ELEMENTWISE = "elementwise"
ACTIVATION = "activation"
NORMALIZATION = "normalization"
DROPOUT = "dropout"
VIEW = "view"
OTHER = "other"

FUSABLE_KINDS = frozenset({ELEMENTWISE, ACTIVATION, NORMALIZATION, DROPOUT, VIEW})

_ACTIVATIONS = {
    "relu", "relu6", "gelu", "silu", "elu", "selu", "celu", "leaky_relu", "hardtanh",
    "hardswish", "hardsigmoid", "sigmoid", "tanh", "softplus", "softsign", "mish", "glu",
    "softmax", "log_softmax", "logsigmoid", "prelu", "rrelu", "threshold", "tanhshrink",
    "softshrink", "hardshrink", "_softmax", "_log_softmax",
}
_NORMALIZATIONS = {
    "layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm", "normalize",
    "local_response_norm", "native_layer_norm", "native_batch_norm", "native_group_norm",
    "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional", "cudnn_batch_norm",
}
_DROPOUTS = {"dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
             "native_dropout", "dropout1d", "dropout2d", "dropout3d"}
_VIEWS = {
    "view", "reshape", "flatten", "unflatten", "transpose", "permute", "t", "squeeze",
    "unsqueeze", "expand", "expand_as", "contiguous", "getitem", "select", "slice",
    "narrow", "split", "split_with_sizes", "chunk", "unbind", "tensor_split", "size",
    "sym_size", "dim", "detach", "alias", "view_as", "reshape_as", "movedim", "moveaxis",
    "swapaxes", "swapdims", "_unsafe_view", "as_strided", "unfold", "diagonal", "real",
    "imag", "view_as_real", "view_as_complex", "numel", "T", "mT", "H", "mH",
    "_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size",
    "sym_constrain_range", "lift_fresh_copy", "clone",
}
_ELEMENTWISE = {
    "add", "sub", "mul", "div", "truediv", "floordiv", "mod", "neg", "pos", "pow", "exp",
    "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "abs", "clamp",
    "clamp_min", "clamp_max", "clip", "where", "masked_fill", "reciprocal", "erf", "erfc",
    "sin", "cos", "tan", "sign", "floor", "ceil", "round", "trunc", "frac", "maximum",
    "minimum", "fmax", "fmin", "eq", "ne", "lt", "le", "gt", "ge", "logical_not",
    "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or",
    "bitwise_xor", "bitwise_not", "and_", "or_", "xor", "invert", "__and__", "__or__",
    "rsub", "to", "type", "type_as", "float", "half", "double", "bfloat16", "int", "long",
    "bool", "_to_copy", "lerp", "addcmul", "addcdiv", "square", "scale", "nan_to_num",
    "isnan", "isinf", "copysign", "hypot", "atan2", "remainder", "fmod",
    "_masked_fill",
}

_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.imatmul, operator.ilshift, operator.irshift, operator.setitem,
}


def op_name(node: torch.fx.Node) -> str:
    """A short name of the operation: ``linear``, ``add``, ``relu`` (overloads dropped)."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__
    name = getattr(target, "__name__", str(target))
    return name


_METADATA_QUERIES = {"sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "size", "dim", "numel", "stride"}


def reads_metadata_only(node: torch.fx.Node) -> bool:
    """True for ops that read a tensor's shape, not its values (``x.size(0)``, ``sym_size``,
    ``x.shape``): what they produce carries no input data."""
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
        return node.args[1] in ("shape", "ndim", "dtype", "device")
    return node.op in ("call_function", "call_method") and op_name(node) in _METADATA_QUERIES


def _bare(name: str) -> str:
    """``relu_`` -> ``relu``, ``__add__`` -> ``add``: the op family behind an in-place or dunder name."""
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        return name[1:] if name.startswith("i") and name[1:] in _ELEMENTWISE else name
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def kind(node: torch.fx.Node) -> str:
    """Classifies a call node for ``fuse-elementwise``."""
    if node.op not in ("call_function", "call_method"):
        return OTHER
    name = _bare(op_name(node))
    if name in _DROPOUTS:
        return DROPOUT
    if name in _NORMALIZATIONS:
        return NORMALIZATION
    if name in _ACTIVATIONS:
        return ACTIVATION
    if name in _VIEWS:
        return VIEW
    if name in _ELEMENTWISE:
        return ELEMENTWISE
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return ELEMENTWISE
    return OTHER


def _is_inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__") and not name.startswith("_")


# Argument names of the batch-norm entry points whose running statistics are updated in place
# in training mode, though the ATen schemas carry no write annotation for them.
_FUNCTIONAL_BATCH_NORM = ["input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"]
_ATEN_BATCH_NORM = ["input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"]


def _running_stat_writes(node: torch.fx.Node) -> list[torch.fx.Node]:
    if node.op != "call_function" or op_name(node) not in ("batch_norm", "native_batch_norm"):
        return []
    names = _FUNCTIONAL_BATCH_NORM if node.target is torch.nn.functional.batch_norm else _ATEN_BATCH_NORM
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    if bound.get("training") is not True:
        return []
    return [stat for key in ("running_mean", "running_var") if isinstance(stat := bound.get(key), torch.fx.Node)]


def mutated_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The input nodes whose tensors this node writes in place."""
    running_stats = _running_stat_writes(node)
    if running_stats:
        return running_stats
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        written = []
        arguments = target._schema.arguments
        for index, argument in enumerate(arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, torch.fx.Node):
                written.append(value)
        return written
    first = node.args[0] if node.args else None
    if not isinstance(first, torch.fx.Node):
        return []
    if node.op == "call_method" and _is_inplace_name(str(target)):
        return [first]
    if node.op == "call_function":
        if target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True:
            return [first]
        if _is_inplace_name(getattr(target, "__name__", "")):
            return [first]
    return []


def aliased_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input whose storage this node's output may share (views, in-place results)."""
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        returns = target._schema.returns
        if returns and returns[0].alias_info is not None:
            return node.args[0]
        return None
    if mutated_inputs(node):
        return node.args[0]
    if node.op in ("call_function", "call_method") and _bare(op_name(node)) in _VIEWS:
        return node.args[0]
    return None


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, torch.fx.Node):
        info = value_info(value)
        return info.shape if info.kind == TENSOR else None
    return None


_MATMUL_LIKE = {"linear", "addmm", "mm", "bmm", "matmul", "baddbmm", "einsum", "_linear"}
_CONV_LIKE = {"conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d",
              "conv_transpose2d", "conv_transpose3d", "_convolution"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention"}


def estimate_flops(node: torch.fx.Node) -> int:
    """Forward FLOPs from shapes: 2·M·N·K for matmuls and convolutions, the output size otherwise.

    A stand-in for measured time until the profiler (issue 3) exists; it ranks layers, it
    does not predict seconds.
    """
    info = value_info(node)
    out_numel = math.prod(info.shape) if info.kind == TENSOR else 0
    name = _bare(op_name(node))
    if name in _MATMUL_LIKE or name in _CONV_LIKE:
        weight_shape = None
        for arg in node.args[1:3]:
            weight_shape = _shape(arg)
            if weight_shape:
                break
        input_shape = _shape(node.args[0]) if node.args else None
        if name in _CONV_LIKE and weight_shape and len(weight_shape) >= 2:
            return 2 * out_numel * math.prod(weight_shape[1:])
        if input_shape:
            return 2 * out_numel * int(input_shape[-1])
        return 2 * out_numel
    if name in _ATTENTION:
        query, key = (_shape(a) for a in node.args[:2]) if len(node.args) >= 2 else (None, None)
        if query and key:
            return 4 * math.prod(query[:-1]) * key[-2] * query[-1]
    return out_numel


def annotate_flops(graph: torch.fx.Graph) -> None:
    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            node.meta[meta.FLOPS] = estimate_flops(node)
