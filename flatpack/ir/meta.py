"""The metadata keys flatpack reads and writes, documented in one place.

On fx nodes (``node.meta[...]``):

``VALUE`` ("flatpack_value")
    :class:`flatpack.ir.values.ValueInfo` of the value the node produced when the model ran
    on the example inputs: kind (tensor, scalar, none, other), shape, dtype, bytes.
``PARAM_DEPENDENT`` ("flatpack_param_dependent")
    True when the value depends (transitively) on a trainable parameter. Values that do
    not (masks, position ids, sizes) may cross any boundary as extra tensors.
``FREE`` ("flatpack_free")
    True for values computed from parameters, buffers and constants alone (``get_attr``
    and side-effect-free ops over them). They belong to no layer: each stage that needs
    one recomputes it, so they never cross a boundary.
``FLOPS`` ("flatpack_flops")
    Estimated forward floating-point operations of the node (see ``ir.ops``).

On layers (``layer.meta[...]``), filled by the analyses and passes of each issue:

``OP_SUMMARY`` ("op_summary")
    Short text naming the heaviest ops of the layer, for ``flatpack inspect``.
``PARAMS`` ("params")
    Sorted canonical names of the parameters and buffers the layer reads.
``PARAM_BYTES`` ("param_bytes")
    Bytes of the trainable parameters among ``PARAMS``.
``FLOPS`` ("flops")
    Sum of the nodes' FLOP estimates; the stand-in for time until a profile exists.
``PROFILE`` ("profile")
    :class:`flatpack.ir.profile.LayerProfile` written by ``profiler.attach``: measured
    seconds (fitted in the micro-batch size) and bytes of the layer. When present,
    ``coarsen{by=time}`` ranks layers by its forward+backward seconds at batch 1 instead of
    ``FLOPS``. ``LayerGraph.merged`` (what ``coarsen`` uses) merges the profiles of the
    layers it joins (``ir.profile.merge_layer_profiles``); passes that regroup nodes
    otherwise drop them. ``compile(profile=...)`` profiles just before the first pass that
    reads profiles, so ``coarsen{by=time}`` balances measured seconds.

``LayerGraph.meta`` holds graph-wide facts: ``FRONTEND`` ("frontend": "fx" or "export").
"""

from __future__ import annotations

VALUE = "flatpack_value"
PARAM_DEPENDENT = "flatpack_param_dependent"
FREE = "flatpack_free"
FLOPS = "flatpack_flops"

OP_SUMMARY = "op_summary"
PARAMS = "params"
PARAM_BYTES = "param_bytes"
LAYER_FLOPS = "flops"
PROFILE = "profile"

FRONTEND = "frontend"
