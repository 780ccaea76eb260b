"""Time the DS conv-window copy of the CPU fallback against the per-row form it replaced.

Not a test (no timing is asserted anywhere): run it in a pin's test environment with the
patched tree first on ``PYTHONPATH``,

    PYTHONPATH=<patched tree> VLLM_TARGET_DEVICE=cpu <env>/bin/python \
        tests/patches/cpu_kernels/bench_ds_conv_copy.py

Shape: Qwen3.5-35B-A3B's Gated-DeltaNet conv state at TP 1 in the DS layout, 8192 rows
(2*16*128 + 32*128) of state_len 6 (kernel 4 - 1 + 3 speculative tokens), bf16, accepted
bias 2. One call is one (request, layer): a request crossing a block boundary makes one
per GDN layer (30 in that model). "Before" is the previous fallback's loop, one
ctypes.memmove per row; "after" is the tree's ``_copy_mamba_state_block_impl``. Both run
on the same blocks, cross-block and same-block, and must leave identical bytes.
"""

import ctypes
import time

import torch
from vllm.utils.cpu_mamba_triton_utils import _copy_mamba_state_block_impl

ROWS, STATE_LEN, ELEM, BIAS = 8192, 6, 2, 2
ROW_STRIDE = STATE_LEN * ELEM
PAGE = ROWS * ROW_STRIDE + 64
raw = torch.randint(0, 256, (4, PAGE), dtype=torch.uint8,
                    generator=torch.Generator().manual_seed(0))
block_table = torch.tensor([[1, 2, 3, 0]], dtype=torch.int32)
# (base, block stride, elem size, inner size, conv width, group, DS rows, DS row stride)
META = ([raw.data_ptr()], [PAGE], [ELEM], [1], [STATE_LEN], [0], [ROWS], [ROW_STRIDE])


def after(src_col: int, dst_col: int) -> None:
    _copy_mamba_state_block_impl(0, 0, src_col, dst_col, BIAS, [block_table.data_ptr()],
                                 block_table.stride(0), META, True)


def before(src_col: int, dst_col: int) -> None:
    ids = block_table[0].tolist()
    src = raw.data_ptr() + ids[src_col] * PAGE
    dst = raw.data_ptr() + ids[dst_col] * PAGE
    for row in range(ROWS):
        ctypes.memmove(dst + row * ROW_STRIDE, src + row * ROW_STRIDE + BIAS * ELEM,
                       (STATE_LEN - BIAS) * ELEM)


def best_of(fn, cols: tuple[int, int], reps: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn(*cols)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main() -> None:
    torch.set_num_threads(1)
    start = raw.clone()
    cases = {"cross-block": (0, 2), "same-block": (1, 1)}
    for cols in cases.values():
        results = []
        for fn in (before, after):
            raw.copy_(start)
            fn(*cols)
            results.append(raw.clone())
        assert torch.equal(results[0], results[1]), "the two copies differ"
        assert not torch.equal(results[0], start), "nothing was copied"
    print(f"torch {torch.__version__}, 1 thread, {ROWS} rows x {STATE_LEN} bf16, "
          f"bias {BIAS}: identical bytes")
    for name, cols in cases.items():
        t_before, t_after = best_of(before, cols, 10), best_of(after, cols, 200)
        print(f"{name}: per-row memmove {t_before * 1e3:.2f} ms, strided copy "
              f"{t_after * 1e3:.3f} ms, {t_before / t_after:.0f}x")


if __name__ == "__main__":
    main()
