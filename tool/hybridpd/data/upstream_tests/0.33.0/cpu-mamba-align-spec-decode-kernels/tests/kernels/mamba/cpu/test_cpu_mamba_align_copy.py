# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU fallbacks of the align-mode Mamba state copies of speculative decoding.

Without Triton, ``CpuPlatform.register_triton_kernel_overrides`` must replace
``precopy_mamba_align_fused_kernel`` and ``postprocess_mamba_fused_kernel``;
otherwise the first step with ``--mamba-cache-mode align`` and a speculative
config raises ``TypeError: 'function' object is not subscriptable``. The copy
tests register the fallbacks directly, as ``test_batch_memcpy_cpu_fallback``
does, so they run whether or not triton-cpu is installed. They launch both
through ``MambaSpecDecodeGPUContext``, as the V1 model runner does, and compare
every byte of the state cache with a torch reference of the copy specs
(``get_conv_copy_spec`` / ``get_temporal_copy_spec``), for 0 to N accepted
draft tokens around a block boundary, in both conv state layouts.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm.model_executor.layers.mamba import mamba_utils as layer_mamba_utils
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator
from vllm.platforms import current_platform
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.mamba_utils import MambaSpecDecodeGPUContext

pytestmark = pytest.mark.skipif(
    not current_platform.is_cpu(), reason="CPU fallbacks of the Triton kernels"
)

BLOCK_SIZE = 8
NUM_SPEC = 3
CONV_DIM = 6
CONV_WIDTH = 3 + NUM_SPEC  # kernel size 4 - 1 + speculative slots
TEMPORAL_SHAPE = (2, 4, 4)
NUM_GROUPS = 2
NUM_COLS = 8
MAX_REQS = 32
NUM_BLOCKS = MAX_REQS * NUM_COLS * NUM_GROUPS + 1


@pytest.fixture(scope="module")
def cpu_fallbacks():
    from vllm.triton_utils.dispatcher import KernelOverride, register_kernels
    from vllm.utils.cpu_mamba_triton_utils import (
        _postprocess_mamba_fused_kernel_impl,
        _precopy_mamba_align_fused_kernel_impl,
    )
    from vllm.v1.worker import mamba_utils

    register_kernels(
        {
            "vllm.v1.worker.mamba_utils.postprocess_mamba_fused_kernel": (
                _postprocess_mamba_fused_kernel_impl
            ),
            "vllm.v1.worker.mamba_utils.precopy_mamba_align_fused_kernel": (
                _precopy_mamba_align_fused_kernel_impl
            ),
        }
    )
    assert isinstance(mamba_utils.postprocess_mamba_fused_kernel, KernelOverride)
    assert isinstance(mamba_utils.precopy_mamba_align_fused_kernel, KernelOverride)


def test_cpu_overrides_include_mamba_align_kernels(monkeypatch):
    """Without Triton, the platform hook registers both fallbacks."""
    import vllm.triton_utils
    import vllm.triton_utils.dispatcher as dispatcher
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils import cpu_mamba_triton_utils as cpu_mamba_tl

    registered: dict[str, object] = {}
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", False)
    monkeypatch.setattr(dispatcher, "register_kernels", registered.update)

    CpuPlatform.register_triton_kernel_overrides()

    prefix = "vllm.v1.worker.mamba_utils."
    assert registered[prefix + "postprocess_mamba_fused_kernel"] is (
        cpu_mamba_tl._postprocess_mamba_fused_kernel_impl
    )
    assert registered[prefix + "precopy_mamba_align_fused_kernel"] is (
        cpu_mamba_tl._precopy_mamba_align_fused_kernel_impl
    )


@pytest.fixture(params=["DS", "SD"])
def conv_layout(request, monkeypatch):
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", request.param)
    layer_mamba_utils.get_conv_state_layout.cache_clear()
    yield request.param
    layer_mamba_utils.get_conv_state_layout.cache_clear()


class _StateCache:
    """A padded page per block: a bf16 conv state, then an fp32 temporal state."""

    def __init__(self, layout: str):
        self.layout = layout
        self.conv_shape = (
            (CONV_DIM, CONV_WIDTH) if layout == "DS" else (CONV_WIDTH, CONV_DIM)
        )
        self.conv_bytes = CONV_DIM * CONV_WIDTH * 2
        self.temporal_offset = cdiv(self.conv_bytes, 8) * 8
        self.temporal_bytes = 4 * torch.Size(TEMPORAL_SHAPE).numel()
        self.page = self.temporal_offset + self.temporal_bytes + 16
        gen = torch.Generator().manual_seed(0)
        self.raw = [
            torch.randint(
                0, 256, (NUM_BLOCKS, self.page), dtype=torch.uint8, generator=gen
            )
            for _ in range(NUM_GROUPS)
        ]
        num_ids = NUM_GROUPS * MAX_REQS * NUM_COLS
        ids = torch.randperm(NUM_BLOCKS - 1, generator=gen)[:num_ids] + 1
        self.block_tables = list(
            ids.to(torch.int32).view(NUM_GROUPS, MAX_REQS, NUM_COLS).clone().unbind(0)
        )

    def views(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        conv = raw[:, : self.conv_bytes].view(torch.bfloat16)
        end = self.temporal_offset + self.temporal_bytes
        temporal = raw[:, self.temporal_offset : end].view(torch.float32)
        return (
            conv.view(NUM_BLOCKS, *self.conv_shape),
            temporal.view(NUM_BLOCKS, *TEMPORAL_SHAPE),
        )

    def context(self) -> MambaSpecDecodeGPUContext:
        conv, temporal = self.views(self.raw[0])
        spec = MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=(tuple(conv.shape[1:]), tuple(temporal.shape[1:])),
            dtypes=(torch.bfloat16, torch.float32),
            page_size_padded=self.page,
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
            mamba_cache_mode="align",
            num_speculative_blocks=NUM_SPEC,
        )
        attn = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        groups = [KVCacheGroupSpec(["attn.0"], attn)] + [
            KVCacheGroupSpec([f"mamba.{g}"], spec) for g in range(NUM_GROUPS)
        ]
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups
        )
        copy_funcs = {
            spec.mamba_type: (
                MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()
            )
        }

        def make_buffer(*size, dtype):
            return CpuGpuBuffer(
                *size, dtype=dtype, device=torch.device("cpu"), pin_memory=False
            )

        ctx = MambaSpecDecodeGPUContext.create(
            MAX_REQS, config, copy_funcs, torch.device("cpu"), make_buffer
        )
        forward_context = {
            f"mamba.{g}": SimpleNamespace(kv_cache=list(self.views(self.raw[g])))
            for g in range(NUM_GROUPS)
        }
        ctx.initialize_from_forward_context(
            config, forward_context, copy_funcs, self.block_tables
        )
        return ctx

    def reference_copy(self, expected, before, req, src_col, dst_col, bias):
        for g in range(NUM_GROUPS):
            bt = self.block_tables[g][req].tolist()
            exp_conv, exp_temporal = self.views(expected[g])
            old_conv, old_temporal = self.views(before[g])
            keep = CONV_WIDTH - bias
            if self.layout == "DS":
                exp_conv[bt[dst_col], :, :keep] = old_conv[bt[src_col], :, bias:]
            else:
                exp_conv[bt[dst_col], :keep] = old_conv[bt[src_col], bias:]
            exp_temporal[bt[dst_col]] = old_temporal[bt[src_col + bias]]

    def assert_equal(self, expected):
        for g in range(NUM_GROUPS):
            torch.testing.assert_close(self.raw[g], expected[g], rtol=0, atol=0)


def _padded(values: list[int]) -> torch.Tensor:
    return torch.tensor(values + [0] * (MAX_REQS - len(values)), dtype=torch.int32)


def test_cpu_precopy_matches_copy_specs(cpu_fallbacks, conv_layout):
    cache = _StateCache(conv_layout)
    ctx = cache.context()
    # (src_col, dst_col, token_bias): every accepted count across a boundary,
    # then a fresh request and one that stays in its block (no copy).
    rows = [(1, 2, bias) for bias in range(NUM_SPEC + 1)]
    rows += [(0, 1, NUM_SPEC), (2, 3, 1), (-1, 0, 0), (2, 2, 1)]
    before = [r.clone() for r in cache.raw]
    expected = [r.clone() for r in cache.raw]
    for req, (src, dst, bias) in enumerate(rows):
        if src >= 0 and src != dst:
            cache.reference_copy(expected, before, req, src, dst, bias)

    ctx.run_fused_precopy(
        num_reqs=len(rows),
        state_idx_gpu=_padded([r[1] for r in rows]),
        src_col_gpu=_padded([r[0] for r in rows]),
        token_bias_gpu=_padded([r[2] for r in rows]),
        idx_mapping=None,
    )

    cache.assert_equal(expected)


def test_cpu_postprocess_saves_the_block_aligned_state(cpu_fallbacks, conv_layout):
    cache = _StateCache(conv_layout)
    ctx = cache.context()
    boundary = 2 * BLOCK_SIZE
    # The running state sits `gap` tokens short of a block boundary and 0 to
    # NUM_SPEC drafts are accepted.
    cases = [(gap, n) for gap in range(NUM_SPEC + 2) for n in range(NUM_SPEC + 1)]
    computed, scheduled, drafts, accepted, state_idx = [], [], [], [], []
    expected_accepted = []
    before = [r.clone() for r in cache.raw]
    expected = [r.clone() for r in cache.raw]
    for req, (gap, num_accepted_drafts) in enumerate(cases):
        running = boundary - gap
        computed.append(running - 1)
        scheduled.append(1 + NUM_SPEC)
        drafts.append(NUM_SPEC)
        accepted.append(1 + num_accepted_drafts)
        # preprocess_mamba's running state column.
        col = cdiv(running - 1 + 1 + NUM_SPEC, BLOCK_SIZE) - 1
        state_idx.append(col)
        count = 1 + num_accepted_drafts
        if running + num_accepted_drafts >= boundary:
            dst = boundary // BLOCK_SIZE - 1
            cache.reference_copy(expected, before, req, col, dst, gap)
            if dst == col:
                count = 1
        expected_accepted.append(count)

    ctx.run_fused_postprocess(
        num_reqs=len(cases),
        num_accepted_tokens_gpu=_padded(accepted),
        mamba_state_idx_gpu=_padded(state_idx),
        num_scheduled_tokens_gpu=_padded(scheduled),
        num_computed_tokens_gpu=_padded(computed),
        num_draft_tokens_gpu=_padded(drafts),
    )

    cache.assert_equal(expected)
    assert ctx.num_accepted_tokens_out[: len(cases)].tolist() == expected_accepted


def test_cpu_fallbacks_refuse_model_runner_v2_launches(cpu_fallbacks):
    # Model Runner V2 needs Triton on CPU, so only V1's launches are implemented.
    cache = _StateCache("SD")
    ctx = cache.context()
    before = [r.clone() for r in cache.raw]
    zeros = torch.zeros(MAX_REQS, dtype=torch.int32)
    idx_mapping = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="Model Runner V2"):
        ctx.run_fused_postprocess_align(
            num_reqs=1,
            num_accepted_tokens_gpu=zeros + 1 + NUM_SPEC,
            state_idx_gpu=zeros + 1,
            new_num_computed_tokens_gpu=zeros + 2 * BLOCK_SIZE,
            idx_mapping=idx_mapping,
        )
    with pytest.raises(NotImplementedError, match="Model Runner V2"):
        ctx.run_fused_precopy(
            num_reqs=1,
            state_idx_gpu=zeros + 2,
            src_col_gpu=zeros + 1,
            token_bias_gpu=zeros + 1,
            idx_mapping=idx_mapping,
        )
    cache.assert_equal(before)
