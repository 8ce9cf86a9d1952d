"""The stage kernel: everything a worker needs to run one stage, and nothing else.

* :mod:`.artifact` — a stage's files (source, weights, manifest): their names, serializing,
  verifying and loading them as an ``nn.Module``;
* :mod:`.integrity` — the artifact's index (sizes, sha256, signature) and the safetensors
  framing check;
* :mod:`.wire` — the format tensors travel in between stages (safetensors, never pickle);
* :mod:`.tensor_check` — a stage's input contract (shapes, dtypes, dynamic dimensions);
* :mod:`.settings` — the names of the run settings a worker acts on.

It imports only the standard library, torch, safetensors and flatpack's leaf modules
(``errors``, ``version``), so a stage worker starts without the compiler (the layering:
docs/architecture.md). This ``__init__`` imports nothing, so that importing one module of the
kernel loads only that module.
"""
