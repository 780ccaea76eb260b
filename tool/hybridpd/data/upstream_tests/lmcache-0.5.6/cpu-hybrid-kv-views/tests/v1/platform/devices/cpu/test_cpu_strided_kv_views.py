# SPDX-License-Identifier: Apache-2.0
"""Strided KV cache views on the CPU shared-memory path.

vLLM pads each Mamba page of a hybrid model's KV cache to the attention page,
so the per-layer views a CPU worker registers are strided: their blocks are
further apart than their elements. Registration must move them to shared
memory with their strides (and the padding between their blocks), and the
non-CUDA copy kernel must address their blocks at the real block stride.
"""

# Standard
from typing import Iterator

# Third Party
import pytest
import torch

# First Party
from lmcache.lmcache_native import EngineKVFormat, TransferDirection
from lmcache.v1.multiprocess.posix_shm import shm_unlink
from lmcache.v1.platform.devices.cpu.shm import migrate_to_shm_and_wrap
from lmcache.v1.platform.ops_types import PageBufferShapeDesc
from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer

NUM_LAYERS = 2
NUM_BLOCKS = 6
BLOCK_SIZE = 4
NUM_HEADS = 2
HEAD_SIZE = 8
BLOCKS_PER_CHUNK = 2
CHUNK_TOKENS = BLOCKS_PER_CHUNK * BLOCK_SIZE
DTYPE = torch.float32


def _padded_pages(padded_elems: int, *page_shape: int) -> torch.Tensor:
    """A ``[NUM_BLOCKS, *page_shape]`` view of blocks ``padded_elems`` apart.

    The storage behind it holds the padding, as vLLM's hybrid KV cache does.
    """
    page_elems = 1
    for dim in page_shape:
        page_elems *= dim
    storage = torch.arange(NUM_BLOCKS * padded_elems, dtype=DTYPE)
    pages = storage.view(NUM_BLOCKS, padded_elems)[:, :page_elems]
    return pages.view(NUM_BLOCKS, *page_shape)


@pytest.fixture
def shm_names() -> Iterator[list[str]]:
    """SHM segment names to unlink after the test."""
    names: list[str] = []
    yield names
    for name in names:
        shm_unlink(name)


def test_migrate_to_shm_and_wrap_keeps_a_strided_view(shm_names: list[str]) -> None:
    """A padded (non-contiguous) view moves to SHM with its strides."""
    view = _padded_pages(40, 3, 8)
    expected = view.clone()
    assert not view.is_contiguous()

    wrapper = migrate_to_shm_and_wrap(view)
    shm_names.append(wrapper.shm_name)

    # The whole backing storage moved, so the view reads the same values.
    assert torch.equal(view, expected)
    assert tuple(view.stride()) == (40, 8, 1)
    rebuilt = wrapper.to_tensor()
    assert tuple(rebuilt.stride()) == (40, 8, 1)
    assert torch.equal(rebuilt, expected)
    # Both sides alias the segment: a write through one is seen by the other.
    view[3].fill_(-1.0)
    assert torch.equal(rebuilt[3], torch.full((3, 8), -1.0))
    rebuilt[5].fill_(-2.0)
    assert torch.equal(view[5], torch.full((3, 8), -2.0))


def test_strided_views_of_one_storage_share_one_segment(
    shm_names: list[str],
) -> None:
    """vLLM's views of one padded buffer (a Mamba layer's conv and ssm
    state) land in one segment and keep their offsets."""
    padded = 40
    storage = torch.zeros(NUM_BLOCKS * padded, dtype=DTYPE)
    pages = storage.view(NUM_BLOCKS, padded)
    conv = pages[:, :8].view(NUM_BLOCKS, 2, 4)
    ssm = pages[:, 8:32].view(NUM_BLOCKS, 3, 8)

    wrappers = [migrate_to_shm_and_wrap(v) for v in (conv, ssm)]
    shm_names.append(wrappers[0].shm_name)

    assert {w.shm_name for w in wrappers} == {wrappers[0].shm_name}
    assert conv.untyped_storage().data_ptr() == ssm.untyped_storage().data_ptr()
    assert (wrappers[0].storage_offset, wrappers[1].storage_offset) == (0, 8)
    ssm[2].fill_(7.0)
    assert torch.equal(wrappers[1].to_tensor()[2], torch.full((3, 8), 7.0))
    assert torch.count_nonzero(wrappers[0].to_tensor()) == 0


def _shape_desc(nh: int, hs: int, block_stride_elems: int) -> PageBufferShapeDesc:
    desc = PageBufferShapeDesc()
    desc.nl = NUM_LAYERS
    desc.nb = NUM_BLOCKS
    desc.bs = BLOCK_SIZE
    desc.nh = nh
    desc.hs = hs
    desc.element_size = DTYPE.itemsize
    desc.dtype = DTYPE
    desc.block_stride_elems = block_stride_elems
    return desc


# (format, per-block shape, nh, hs, K/V planes per block): blocks-first
# layouts, the block axis leads.
BLOCKS_FIRST_FORMATS = [
    (EngineKVFormat.NL_X_NB_BS_HS, (BLOCK_SIZE, HEAD_SIZE), 1, HEAD_SIZE, 1),
    (
        EngineKVFormat.NL_X_NB_TWO_BS_NH_HS,
        (2, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE),
        NUM_HEADS,
        HEAD_SIZE,
        2,
    ),
]


def _chunks(fmt: EngineKVFormat, nh: int, hs: int) -> list[torch.Tensor]:
    if fmt == EngineKVFormat.NL_X_NB_BS_HS:
        shape: tuple[int, ...] = (NUM_LAYERS, CHUNK_TOKENS, hs)
    else:
        shape = (2, NUM_LAYERS, CHUNK_TOKENS, nh * hs)
    return [
        torch.zeros(shape, dtype=DTYPE) for _ in range(NUM_BLOCKS // BLOCKS_PER_CHUNK)
    ]


@pytest.mark.parametrize(
    "fmt,block_shape,nh,hs,kv_size",
    BLOCKS_FIRST_FORMATS,
    ids=["mla", "kv_blocks_first"],
)
def test_pointer_transfer_honours_a_padded_block_stride(
    fmt: EngineKVFormat,
    block_shape: tuple[int, ...],
    nh: int,
    hs: int,
    kv_size: int,
) -> None:
    """Paged layers given by pointer with a padded block stride store the
    same chunks as tight layers, and a load writes no padding.

    As in the CUDA kernel (``PageBufferShapeDesc::scalars_per_block``), the
    stride replaces each K/V plane's ``bs * nh * hs``: a K/V-interleaved
    block pads each of its two planes."""
    gen = torch.Generator().manual_seed(0)
    tight = [
        torch.randn((NUM_BLOCKS, *block_shape), generator=gen, dtype=DTYPE)
        for _ in range(NUM_LAYERS)
    ]
    plane = BLOCK_SIZE * nh * hs
    padded = plane + 16

    def padded_pool() -> torch.Tensor:
        return torch.full((NUM_BLOCKS, kv_size, padded), -5.0, dtype=DTYPE)

    pools = [padded_pool() for _ in tight]
    for pool, layer in zip(pools, tight, strict=True):
        pool[:, :, :plane].copy_(layer.reshape(NUM_BLOCKS, kv_size, plane))
    block_ids = [4, 1, 5, 0, 2, 3]

    def transfer(
        paged: torch.Tensor | list[torch.Tensor],
        chunks: list[torch.Tensor],
        direction: TransferDirection,
    ) -> None:
        multi_layer_block_kv_transfer(
            paged,
            chunks,
            block_ids,
            torch.device("cpu"),
            direction,
            _shape_desc(nh, hs, padded),
            CHUNK_TOKENS,
            fmt,
            0,
        )

    def pointers(layers: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)

    stored = _chunks(fmt, nh, hs)
    transfer(pointers(pools), stored, TransferDirection.D2H)
    expected = _chunks(fmt, nh, hs)
    transfer(tight, expected, TransferDirection.D2H)
    for got, want in zip(stored, expected, strict=True):
        assert torch.equal(got, want)

    loaded = [padded_pool() for _ in tight]
    transfer(pointers(loaded), stored, TransferDirection.H2D)
    for got_pool, want_pool in zip(loaded, pools, strict=True):
        assert torch.equal(got_pool, want_pool)


def test_pointer_transfer_takes_a_tight_plane_stride_as_tight() -> None:
    """A K/V-interleaved layer whose stride is one plane's ``bs * nh * hs``
    (tight, as the CUDA kernel reads it) copies like a layer without one."""
    gen = torch.Generator().manual_seed(1)
    fmt = EngineKVFormat.NL_X_NB_TWO_BS_NH_HS
    layers = [
        torch.randn(
            (NUM_BLOCKS, 2, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE),
            generator=gen,
            dtype=DTYPE,
        )
        for _ in range(NUM_LAYERS)
    ]
    pointers = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    block_ids = [4, 1, 5, 0, 2, 3]
    stored = _chunks(fmt, NUM_HEADS, HEAD_SIZE)
    expected = _chunks(fmt, NUM_HEADS, HEAD_SIZE)
    for paged, chunks, stride in (
        (pointers, stored, BLOCK_SIZE * NUM_HEADS * HEAD_SIZE),
        (layers, expected, 0),
    ):
        multi_layer_block_kv_transfer(
            paged,
            chunks,
            block_ids,
            torch.device("cpu"),
            TransferDirection.D2H,
            _shape_desc(NUM_HEADS, HEAD_SIZE, stride),
            CHUNK_TOKENS,
            fmt,
            0,
        )
    for got, want in zip(stored, expected, strict=True):
        assert torch.equal(got, want)


def test_pointer_transfer_refuses_a_padded_stride_of_partial_planes() -> None:
    """An MLA descriptor whose ``nh`` is not 1 gives a block of fewer elements
    than one ``bs * nh * hs`` plane: no K/V plane count fits the padded
    stride, so the transfer is refused rather than read at a wrong span."""
    pools = [
        torch.zeros((NUM_BLOCKS, BLOCK_SIZE * NUM_HEADS * HEAD_SIZE + 16))
        for _ in range(NUM_LAYERS)
    ]
    pointers = torch.tensor([t.data_ptr() for t in pools], dtype=torch.int64)
    with pytest.raises(NotImplementedError, match="one or two K/V planes"):
        multi_layer_block_kv_transfer(
            pointers,
            _chunks(EngineKVFormat.NL_X_NB_BS_HS, NUM_HEADS, HEAD_SIZE),
            [4, 1, 5, 0, 2, 3],
            torch.device("cpu"),
            TransferDirection.D2H,
            _shape_desc(NUM_HEADS, HEAD_SIZE, BLOCK_SIZE * NUM_HEADS * HEAD_SIZE + 16),
            CHUNK_TOKENS,
            EngineKVFormat.NL_X_NB_BS_HS,
            0,
        )
