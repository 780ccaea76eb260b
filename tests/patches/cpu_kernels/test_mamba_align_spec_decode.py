"""Align mode's Mamba state copies with speculative decoding run on the CPU backend.

Patch: cpu-mamba-align-spec-decode-kernels. With ``--mamba-cache-mode align`` and a
speculative config, the V1 model runner moves each request's Mamba state with two
Triton kernels (``precopy_mamba_align_fused_kernel`` before the forward pass,
``postprocess_mamba_fused_kernel`` after the rejection sampler).
``CpuPlatform.register_triton_kernel_overrides`` replaces the other kernels the CPU
backend runs, but not these: without Triton they stay bare functions and the first
step raises ``TypeError: 'function' object is not subscriptable`` in the engine core.

The tests drive vLLM's own ``MambaSpecDecodeGPUContext`` (its metadata read from
state tensors laid out as vLLM lays out a hybrid page: conv then temporal state, the
page padded) through the CPU kernel dispatcher, for 0 ... N accepted draft tokens
around a block boundary, and compare every byte of the cache with a plain torch
reference of the copy. A copy that does nothing, or moves the wrong bytes, fails.
"""

from types import SimpleNamespace

import pytest
import torch
import vllm
from packaging.version import Version

if Version(vllm.__version__) < Version("0.32"):  # no fused align kernels before
    pytest.skip(f"covers vLLM >=0.32, this is vLLM {vllm.__version__}",
                allow_module_level=True)

from vllm.model_executor.layers.mamba import mamba_utils as layer_mamba_utils  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.utils.math_utils import cdiv  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.utils import CpuGpuBuffer  # noqa: E402
from vllm.v1.worker.mamba_utils import MambaSpecDecodeGPUContext  # noqa: E402

PATCH = pytest.mark.patch("cpu-mamba-align-spec-decode-kernels")
pytestmark = [PATCH, pytest.mark.vllm_versions(">=0.32")]

BLOCK = 8  # Mamba block size (tokens)
N = 3  # speculative tokens: num_speculative_blocks, and the conv window's extra slots
CONV_DIM, CONV_WIDTH = 6, 3 + N  # Gated-DeltaNet: kernel size 4 - 1 + N
TEMPORAL = (2, 4, 4)
GROUPS = 2  # two Mamba groups: each reads its own block table
COLUMNS = 8  # block-table columns per request
MAX_REQS = 32
NUM_BLOCKS = MAX_REQS * COLUMNS * GROUPS + 1  # block 0: vLLM's null block


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    # What every CPU worker does at start-up (WorkerBase), without Triton.
    current_platform.register_triton_kernel_overrides()


@pytest.fixture(params=["DS", "SD"])
def layout(request, monkeypatch):
    """The conv state layout (VLLM_SSM_CONV_STATE_LAYOUT; vLLM caches the choice)."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", request.param)
    layer_mamba_utils.get_conv_state_layout.cache_clear()
    yield request.param
    layer_mamba_utils.get_conv_state_layout.cache_clear()


class Cache:
    """One layer per Mamba group; each block a padded page of bytes holding a bf16
    conv state then an fp32 temporal state, as vLLM's hybrid allocator lays it out."""

    def __init__(self, layout: str):
        self.layout = layout
        self.conv_shape = (
            (CONV_DIM, CONV_WIDTH) if layout == "DS" else (CONV_WIDTH, CONV_DIM)
        )
        self.conv_bytes = CONV_DIM * CONV_WIDTH * 2
        self.temporal_offset = cdiv(self.conv_bytes, 8) * 8
        temporal_bytes = 4 * TEMPORAL[0] * TEMPORAL[1] * TEMPORAL[2]
        self.page = self.temporal_offset + temporal_bytes + 16  # padding
        gen = torch.Generator().manual_seed(0)
        self.raw = [
            torch.randint(0, 256, (NUM_BLOCKS, self.page), dtype=torch.uint8, generator=gen)
            for _ in range(GROUPS)
        ]
        # Distinct blocks for every (group, request, column).
        ids = torch.randperm(NUM_BLOCKS - 1, generator=gen)[: GROUPS * MAX_REQS * COLUMNS] + 1
        self.block_tables = list(
            ids.to(torch.int32).view(GROUPS, MAX_REQS, COLUMNS).clone().unbind(0)
        )

    def views(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        conv = raw[:, : self.conv_bytes].view(torch.bfloat16).view(NUM_BLOCKS, *self.conv_shape)
        end = self.temporal_offset + 4 * TEMPORAL[0] * TEMPORAL[1] * TEMPORAL[2]
        temporal = raw[:, self.temporal_offset : end].view(torch.float32)
        return conv, temporal.view(NUM_BLOCKS, *TEMPORAL)

    def context(self) -> MambaSpecDecodeGPUContext:
        conv, temporal = self.views(self.raw[0])
        spec = MambaSpec(
            block_size=BLOCK,
            shapes=(tuple(conv.shape[1:]), tuple(temporal.shape[1:])),
            dtypes=(torch.bfloat16, torch.float32),
            page_size_padded=self.page,
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
            mamba_cache_mode="align",
            num_speculative_blocks=N,
        )
        full = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        groups = [KVCacheGroupSpec(["attn.0"], full)] + [
            KVCacheGroupSpec([f"linear_attn.{g}"], spec) for g in range(GROUPS)
        ]
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups
        )
        copy_funcs = {
            spec.mamba_type: MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()
        }

        def make_buffer(*size, dtype):
            return CpuGpuBuffer(*size, dtype=dtype, device=torch.device("cpu"), pin_memory=False)

        ctx = MambaSpecDecodeGPUContext.create(
            MAX_REQS, config, copy_funcs, torch.device("cpu"), make_buffer
        )
        forward_context = {
            f"linear_attn.{g}": SimpleNamespace(kv_cache=list(self.views(self.raw[g])))
            for g in range(GROUPS)
        }
        ctx.initialize_from_forward_context(
            config, forward_context, copy_funcs, self.block_tables
        )
        assert ctx.num_states == 2 * GROUPS
        return ctx

    def expected_copy(self, expected: list, before: list, req: int, src: int,
                      dst: int, bias: int) -> None:
        """The reference: the conv window shifted by ``bias`` tokens from column
        ``src`` into column ``dst``; the temporal state of column ``src + bias`` (the
        state after the accepted tokens) into column ``dst``."""
        for g in range(GROUPS):
            bt = self.block_tables[g][req].tolist()
            exp_conv, exp_temporal = self.views(expected[g])
            old_conv, old_temporal = self.views(before[g])
            keep = CONV_WIDTH - bias
            if self.layout == "DS":
                exp_conv[bt[dst], :, :keep] = old_conv[bt[src], :, bias:]
            else:
                exp_conv[bt[dst], :keep] = old_conv[bt[src], bias:]
            exp_temporal[bt[dst]] = old_temporal[bt[src + bias]]


def assert_cache_equal(cache: Cache, expected: list) -> None:
    for g in range(GROUPS):
        diff = (cache.raw[g] != expected[g]).any(dim=1).nonzero().flatten().tolist()
        assert not diff, f"group {g}: blocks {diff} differ from the reference copy"


def test_precopy_moves_the_accepted_state_into_the_new_block(layout):
    # The step after a decode step that crossed into a new block: the state after
    # the last accepted token (0 ... N drafts accepted) moves from the previous
    # running column into the new one. A fresh request (-1) and one still in its
    # block copy nothing.
    cache = Cache(layout)
    ctx = cache.context()
    rows = [(1, 2, bias) for bias in range(N + 1)]  # (src col, dst col, bias)
    rows += [(0, 1, N), (2, 3, 1), (-1, 0, 0), (2, 2, 1)]
    num = len(rows)
    src = torch.tensor([r[0] for r in rows] + [0] * (MAX_REQS - num), dtype=torch.int32)
    dst = torch.tensor([r[1] for r in rows] + [0] * (MAX_REQS - num), dtype=torch.int32)
    bias = torch.tensor([r[2] for r in rows] + [0] * (MAX_REQS - num), dtype=torch.int32)
    before = [r.clone() for r in cache.raw]
    expected = [r.clone() for r in cache.raw]
    for req, (s, d, b) in enumerate(rows):
        if s >= 0 and s != d:
            cache.expected_copy(expected, before, req, s, d, b)
    assert any((e != b).any() for e, b in zip(expected, before))

    ctx.run_fused_precopy(
        num_reqs=num, state_idx_gpu=dst, src_col_gpu=src, token_bias_gpu=bias,
        idx_mapping=None,
    )

    assert_cache_equal(cache, expected)


def test_postprocess_saves_the_state_at_the_block_boundary(layout):
    # A decode step verifies N drafts: the running state sits after `running`
    # tokens, j tokens short of a block boundary, and 0 ... N drafts are accepted.
    # When the accepted tokens reach the boundary, the state at the boundary (the
    # draft state j tokens past the running one) is saved in the boundary's block;
    # when that block is the running one, its accepted count restarts at 1.
    cache = Cache(layout)
    ctx = cache.context()
    cases = [(j, accepted) for j in range(N + 2) for accepted in range(N + 1)]
    num = len(cases)
    boundary = 2 * BLOCK
    zeros = [0] * (MAX_REQS - num)
    num_computed, num_scheduled, num_draft, num_accepted, state_idx = [], [], [], [], []
    before = [r.clone() for r in cache.raw]
    expected = [r.clone() for r in cache.raw]
    expected_accepted = []
    for req, (j, accepted) in enumerate(cases):
        running = boundary - j
        computed, scheduled = running - 1, 1 + N
        # preprocess_mamba's running-state column for this step.
        col = cdiv(computed + scheduled, BLOCK) - 1
        num_computed.append(computed)
        num_scheduled.append(scheduled)
        num_draft.append(N)
        num_accepted.append(1 + accepted)
        state_idx.append(col)
        count = 1 + accepted
        if running + accepted >= boundary:  # the accepted tokens reach it
            dst = boundary // BLOCK - 1
            cache.expected_copy(expected, before, req, col, dst, j)
            if dst == col:
                count = 1
        expected_accepted.append(count)
    assert any((e != b).any() for e, b in zip(expected, before))
    assert 1 in [c for c, (_, a) in zip(expected_accepted, cases) if a > 0]

    def t(values):
        return torch.tensor(values + zeros, dtype=torch.int32)

    accepted_in = t(num_accepted)
    ctx.run_fused_postprocess(
        num_reqs=num,
        num_accepted_tokens_gpu=accepted_in,
        mamba_state_idx_gpu=t(state_idx),
        num_scheduled_tokens_gpu=t(num_scheduled),
        num_computed_tokens_gpu=t(num_computed),
        num_draft_tokens_gpu=t(num_draft),
    )

    assert_cache_equal(cache, expected)
    assert ctx.num_accepted_tokens_out[:num].tolist() == expected_accepted
    assert accepted_in[:num].tolist() == num_accepted  # the input is left as it was


def test_model_runner_v2_launches_are_refused():
    # Model Runner V2 needs Triton on CPU (its own kernels have no CPU versions), so
    # the CPU versions implement V1's launches only; V2's (an idx_mapping,
    # precomputed counts) raise instead of copying, and leave the cache as it was.
    cache = Cache("SD")
    ctx = cache.context()
    before = [r.clone() for r in cache.raw]
    zeros = torch.zeros(MAX_REQS, dtype=torch.int32)
    idx_mapping = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="Model Runner V2"):
        ctx.run_fused_postprocess_align(
            num_reqs=1, num_accepted_tokens_gpu=zeros + 1 + N, state_idx_gpu=zeros + 1,
            new_num_computed_tokens_gpu=zeros + 2 * BLOCK, idx_mapping=idx_mapping,
        )
    with pytest.raises(NotImplementedError, match="Model Runner V2"):
        ctx.run_fused_precopy(
            num_reqs=1, state_idx_gpu=zeros + 2, src_col_gpu=zeros + 1,
            token_bias_gpu=zeros + 1, idx_mapping=idx_mapping,
        )
    assert_cache_equal(cache, before)
