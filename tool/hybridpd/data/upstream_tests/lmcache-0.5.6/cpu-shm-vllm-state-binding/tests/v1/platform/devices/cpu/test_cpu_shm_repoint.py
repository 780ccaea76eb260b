# SPDX-License-Identifier: Apache-2.0
"""Tests for ``repoint_to_shm`` in ``lmcache.v1.platform.devices.cpu.shm``.

``migrate_to_shm_and_wrap`` re-points only the tensors it is handed. An
engine computes with other views of the same storage (vLLM's Mamba layers
keep their own conv/ssm state views), which must be re-pointed too, or the
engine never reads what LMCache loads into the segment.
"""

# Standard
from typing import Iterator

# Third Party
import pytest
import torch

# First Party
from lmcache.v1.multiprocess.posix_shm import shm_unlink
from lmcache.v1.platform.devices.cpu import shm as cpu_shm


@pytest.fixture
def shm_names() -> Iterator[list[str]]:
    """SHM segment names to unlink after the test."""
    names: list[str] = []
    yield names
    for name in names:
        shm_unlink(name)


def test_repoint_moves_an_engine_view_onto_the_registered_segment(
    shm_names: list[str],
) -> None:
    """After repoint, the engine's own view aliases the registered tensor."""
    storage = torch.arange(2 * 64, dtype=torch.float32)
    registered = storage[:64].view(4, 16)
    engine_view = storage[:64].view(4, 4, 4)[:, 1:3]
    expected = engine_view.clone()
    wrapper = cpu_shm.migrate_to_shm_and_wrap(registered)
    shm_names.append(wrapper.shm_name)

    assert cpu_shm.repoint_to_shm(engine_view)

    # Same values, shape, strides and offset, now on the segment.
    assert torch.equal(engine_view, expected)
    assert tuple(engine_view.stride()) == (16, 4, 1)
    assert engine_view.storage_offset() == 4
    assert (
        engine_view.untyped_storage().data_ptr()
        == registered.untyped_storage().data_ptr()
    )
    # What LMCache writes into the registered memory, the engine reads.
    wrapper.to_tensor().fill_(5.0)
    assert torch.equal(engine_view, torch.full((4, 2, 4), 5.0))


def test_repoint_moves_a_view_outside_the_registered_range(
    shm_names: list[str],
) -> None:
    """The whole storage moved: a view past the registered tensor follows."""
    storage = torch.zeros(2 * 64, dtype=torch.float32)
    registered, sibling = storage[:64], storage[64:]
    wrapper = cpu_shm.migrate_to_shm_and_wrap(registered)
    shm_names.append(wrapper.shm_name)

    assert cpu_shm.repoint_to_shm(sibling)

    assert sibling.storage_offset() == 64
    sibling.fill_(2.0)
    rebuilt = torch.empty(0, dtype=torch.float32).set_(
        registered.untyped_storage(), 0, (2 * 64,), (1,)
    )
    assert torch.equal(rebuilt[64:], torch.full((64,), 2.0))
    assert torch.count_nonzero(rebuilt[:64]) == 0


def test_repoint_leaves_tensors_it_cannot_repoint(shm_names: list[str]) -> None:
    """A tensor whose storage never moved, or already is the segment, is
    left as it is."""
    private = torch.ones(8)
    ptr = private.data_ptr()
    assert not cpu_shm.repoint_to_shm(private)
    assert private.data_ptr() == ptr

    registered = torch.zeros(8)
    wrapper = cpu_shm.migrate_to_shm_and_wrap(registered)
    shm_names.append(wrapper.shm_name)
    assert not cpu_shm.repoint_to_shm(registered)
