"""Stage artifacts: generated source + safetensors shard + manifest, their index, and their loader."""

from flatpack.codegen.artifact import build_module, load_stage, read_stage
from flatpack.codegen.emit import StageArtifact, emit_stages

__all__ = ["StageArtifact", "build_module", "emit_stages", "load_stage", "read_stage"]
