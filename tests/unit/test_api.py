"""flatpack.compile (``flatpack/api.py``) shows its parameters: tools and readers see the
compiler's signature, not ``**options``."""

from __future__ import annotations

import inspect

import flatpack
from flatpack import compiler


def test_flatpack_compile_lists_the_compiler_s_parameters():
    public = inspect.signature(flatpack.compile)
    assert public == inspect.signature(compiler.compile)
    assert list(public.parameters)[:4] == ["model", "example_inputs", "target", "solver"]
    assert {"stages", "passes", "plan", "profile", "workload", "calibration", "measured"} <= set(public.parameters)
    assert public.parameters["target"].default == "local"
    assert public.parameters["target"].kind is inspect.Parameter.KEYWORD_ONLY
    # only the cost-model solvers' ProblemOptions stay open-ended
    assert [p.name for p in public.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD] == ["options"]


def test_flatpack_compile_passes_every_parameter_on(monkeypatch):
    seen = {}

    def fake(model, example_inputs=(), **given):
        seen.update(given, model=model, example_inputs=example_inputs)
        return "compiled"

    monkeypatch.setattr(compiler, "compile", fake)
    # sentinels of the wrong types on purpose: the test checks each is passed on unchanged
    assert flatpack.compile("m", (1,), solver="dp", stages=3, passes="p", out_dir="o",  # pyright: ignore[reportArgumentType]
                            example_kwargs={"k": 1}, plan="plan",  # pyright: ignore[reportArgumentType]
                            profile=True, calibration="c", force=True, measured="r",
                            memory_mb=1024) == "compiled"
    assert seen == {"model": "m", "example_inputs": (1,), "target": "local", "solver": "dp", "stages": 3,
                    "passes": "p", "out_dir": "o", "example_kwargs": {"k": 1}, "plan": "plan", "profile": True,
                    "workload": None, "calibration": "c", "force": True, "measured": "r", "memory_mb": 1024}
