"""Plan + LayerGraph -> stage artifacts (generated source, weight shard, manifest).

Reading, verifying and loading an artifact is the stage kernel's job (:mod:`flatpack.stage`),
which a worker imports without the compiler.
"""

from flatpack.codegen.emit import emit_stages
from flatpack.stage.artifact import StageArtifact, build_module, load_stage, read_stage

__all__ = ["StageArtifact", "build_module", "emit_stages", "load_stage", "read_stage"]
