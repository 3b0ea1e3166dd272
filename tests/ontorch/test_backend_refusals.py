"""What the backend refuses before anything moves, in one process (a group of one rank:
no ring is opened): a reduction of a tensor whose values cannot be added up, by every
call that reduces, with one message."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from gradstream.torch import GradstreamProcessGroup


@pytest.fixture
def group() -> GradstreamProcessGroup:
    return GradstreamProcessGroup(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))


MESSAGE = "reduces float32, float64, float16 and bfloat16 tensors, not torch.int64"


def test_an_allreduce_of_integers_is_refused_naming_the_dtype(
    group: GradstreamProcessGroup,
) -> None:
    with pytest.raises(TypeError, match=MESSAGE):
        group.allreduce([torch.arange(4)])


def test_a_reduce_scatter_of_integers_is_refused_alike(group: GradstreamProcessGroup) -> None:
    with pytest.raises(TypeError, match=MESSAGE):
        group._reduce_scatter_base(torch.zeros(4, dtype=torch.int64), torch.arange(4))


def test_a_float_allreduce_of_one_rank_hands_back_its_values(
    group: GradstreamProcessGroup,
) -> None:
    tensor = torch.arange(4, dtype=torch.bfloat16)
    group.allreduce([tensor]).wait()
    assert torch.equal(tensor, torch.arange(4, dtype=torch.bfloat16))
