"""``Problem.options`` is typed (flatpack/partitioner/options.py): every option a solver or cost
model reads is a field, so a misspelt one is refused where it is given, naming the closest
known option, before anything is traced."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flatpack
from flatpack.errors import InputError
from flatpack.partitioner.options import ProblemOptions
from flatpack.partitioner.problem import ChainLayer, Problem
from flatpack.partitioner.space import SearchSpace
from flatpack.platform.catalog import get_platform


def _problem(**options) -> Problem:
    chain = tuple(ChainLayer(f"l{index}", 1 << 20, 1000, 1 << 10) for index in range(3))
    # Problem takes a mapping as well (its __post_init__ converts it, as this file tests);
    # the field is typed as what it holds afterwards
    return Problem(chain, get_platform("aws-lambda"), options=options)  # pyright: ignore[reportArgumentType]


def test_a_mapping_becomes_typed_options_that_the_search_space_reads():
    problem = _problem(memory_mb=[2048, 1024], replicas=1)
    assert isinstance(problem.options, ProblemOptions)
    assert problem.options.given() == {"memory_mb": [2048, 1024], "replicas": 1}
    space = SearchSpace.of(problem)
    assert space.memory_mb == (1024, 2048) and space.replicas == (1,)
    changed = problem.options.with_changes(replicas=(1, 2))
    assert changed.replicas == (1, 2) and changed.memory_mb == [2048, 1024] and problem.options.replicas == 1


def test_a_misspelt_option_is_refused_naming_the_one_meant():
    with pytest.raises(InputError, match=r"unknown option\(s\) 'cluster_sise' \(did you mean 'cluster_size'\?\) "
                                         r"for Problem \(known: .*cluster_size"):
        _problem(cluster_sise=4)
    with pytest.raises(InputError, match="did you mean 'memory_mb'"):
        ProblemOptions().with_changes(memory_mbs=(1024,))


def test_compile_refuses_a_misspelt_option_before_tracing():
    class Exploding(nn.Module):
        def forward(self, x):
            raise AssertionError("traced although an option was misspelt")

    with pytest.raises(InputError, match=r"'replica' \(did you mean 'replicas'\?\) for flatpack.compile"):
        flatpack.compile(Exploding(), torch.randn(2, 2), replica=(1, 2))
