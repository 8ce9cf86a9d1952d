"""How stages are named on disk, in a store and in an image, defined once: every layer that
lays out or looks up a stage's files (the compiler, the images, the store keys, the worker, the
gpu-container ranks) calls :func:`stage_dirname`."""


def stage_dirname(index: int) -> str:
    """The name of stage ``index``'s directory in an artifact (``stage_007``); a run's
    per-stage parameters file takes the same name."""
    return f"stage_{index:03d}"
