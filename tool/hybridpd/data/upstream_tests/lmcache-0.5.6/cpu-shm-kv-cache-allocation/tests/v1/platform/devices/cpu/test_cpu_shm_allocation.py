# SPDX-License-Identifier: Apache-2.0
"""Tests for ``allocate_in_shm`` and ``ShmAllocationMode`` in
``lmcache.v1.platform.devices.cpu.shm``.

A CPU KV cache allocated in a POSIX SHM segment is registered in place:
``migrate_to_shm_and_wrap`` moves nothing, so whatever holds its address
(another connector that registered it first, the engine's own views) keeps
the memory LMCache reads and writes.
"""

# Standard
import gc
import os

# Third Party
import pytest
import torch

# First Party
from lmcache.v1.platform.devices.cpu import shm as cpu_shm

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/dev/shm"), reason="POSIX SHM segments live in /dev/shm"
)


def _segments() -> set[str]:
    """This process's CPU KV SHM segments, named as the wrappers name them."""
    prefix = "%s%d_" % (cpu_shm.CpuShmTensorWrapper.SHM_NAME_PREFIX, os.getpid())
    names = ("/" + name for name in os.listdir("/dev/shm"))
    return {name for name in names if name.startswith(prefix)}


def test_allocated_tensor_is_registered_in_place() -> None:
    """Registration shares an allocated tensor's memory instead of moving it."""
    before = _segments()
    kv_cache = cpu_shm.allocate_in_shm((4, 16), torch.float32)
    assert torch.equal(kv_cache, torch.zeros(4, 16))
    (segment,) = _segments() - before
    address = kv_cache.data_ptr()
    # What another connector registered first: a view at the same address.
    held = kv_cache.view(-1)

    wrapper = cpu_shm.migrate_to_shm_and_wrap(kv_cache)

    assert wrapper.shm_name == segment
    assert kv_cache.data_ptr() == address
    assert _segments() - before == {segment}
    wrapper.to_tensor().fill_(3.0)
    assert torch.equal(held, torch.full((64,), 3.0))


def test_view_of_an_allocated_tensor_is_registered_in_place() -> None:
    """A view the engine registers (one layer's part of the KV cache) stays
    at its address, and so does the rest of the allocation."""
    kv_cache = cpu_shm.allocate_in_shm((4, 16), torch.float32)
    view = kv_cache[1:3]
    address = view.data_ptr()

    wrapper = cpu_shm.migrate_to_shm_and_wrap(view)

    assert view.data_ptr() == address
    wrapper.to_tensor().fill_(2.0)
    assert torch.equal(kv_cache[1:3], torch.full((2, 16), 2.0))
    assert torch.equal(kv_cache[::3], torch.zeros(2, 16))


def test_segment_is_released_with_the_last_view() -> None:
    before = _segments()
    kv_cache = cpu_shm.allocate_in_shm((8,), torch.bfloat16)
    view = kv_cache[2:]
    (segment,) = _segments() - before

    del kv_cache
    gc.collect()
    assert segment in _segments()

    del view
    gc.collect()
    assert segment not in _segments()


@pytest.mark.parametrize(
    "allocate",
    [
        lambda: torch.zeros(2, 3, 4, dtype=torch.int8, device="cpu"),
        lambda: torch.zeros((2, 3, 4), dtype=torch.int8, device="cpu"),
        lambda: torch.empty([2, 3, 4], dtype=torch.int8, device=torch.device("cpu")),
        lambda: torch.zeros(2, 3, 4, dtype=torch.int8, device="cpu", pin_memory=False),
    ],
    ids=["sizes", "tuple", "list", "default-kwargs"],
)
def test_allocation_mode_allocates_cpu_tensors_in_shm(allocate) -> None:
    """``torch.empty`` / ``torch.zeros`` in the mode allocate in SHM, zeroed."""
    before = _segments()
    with cpu_shm.ShmAllocationMode():
        kv_cache = allocate()
    assert kv_cache.shape == (2, 3, 4)
    assert kv_cache.dtype == torch.int8
    assert torch.equal(kv_cache, torch.zeros(2, 3, 4, dtype=torch.int8))
    (segment,) = _segments() - before

    address = kv_cache.data_ptr()
    wrapper = cpu_shm.migrate_to_shm_and_wrap(kv_cache)
    assert (wrapper.shm_name, kv_cache.data_ptr()) == (segment, address)


def test_allocated_segment_pages_are_reserved() -> None:
    """A /dev/shm too small for the KV cache fails at allocation (ENOSPC),
    not with SIGBUS at the first write past its limit while serving."""
    before = _segments()
    kv_cache = cpu_shm.allocate_in_shm((256, 1024), torch.float32)
    (segment,) = _segments() - before
    st = os.stat("/dev/shm" + segment)
    assert st.st_blocks * 512 >= kv_cache.numel() * kv_cache.element_size()


def test_allocation_without_posix_fallocate(monkeypatch) -> None:
    """Where ``os.posix_fallocate`` is missing (macOS), the segment is still
    allocated, its pages on first write as without the reservation."""
    monkeypatch.delattr(os, "posix_fallocate", raising=False)
    before = _segments()
    kv_cache = cpu_shm.allocate_in_shm((4, 16), torch.float32)
    (segment,) = _segments() - before
    assert torch.equal(kv_cache, torch.zeros(4, 16))
    kv_cache.fill_(1.0)
    wrapper = cpu_shm.migrate_to_shm_and_wrap(kv_cache)
    assert wrapper.shm_name == segment


def test_allocation_mode_leaves_other_calls_alone() -> None:
    """Other factories, other devices and other arguments are not changed,
    nor are calls that name no device (a buffer of the engine's own)."""
    buffer = torch.empty(4)
    before = _segments()
    with cpu_shm.ShmAllocationMode():
        ones = torch.ones(4, device="cpu")
        meta = torch.empty(4, device="meta")
        unnamed = torch.zeros(4)
        grad = torch.zeros(4, device="cpu", requires_grad=True)
        out = torch.zeros(4, device="cpu", out=buffer)
    assert _segments() == before
    assert torch.equal(ones, torch.ones(4))
    assert meta.device.type == "meta"
    assert torch.equal(unnamed, torch.zeros(4))
    assert grad.requires_grad
    assert torch.equal(out, torch.zeros(4))
