"""FlashTrans: copies of scattered fixed-size rows between pinned host memory and device memory.

One operation serves both directions of the ESS data path:

    dst[dst_rows[i]] = src[src_rows[i]]    for every i with src_rows[i] >= 0 and dst_rows[i] >= 0

- H2D gather (misses, warm-up): src is the UVA view of a layer of the pinned host total pool, dst the layer's hot pool.
- D2H scatter (write-back of new tokens): src holds the new entries on the device, dst is the UVA view of the host pool.

Rows are `row_bytes` bytes (656 for V32 latents) and are moved as 4-byte words. The index lists may hold -1 anywhere
(padding, or entries a step did not need), so that the caller can pass fixed-size lists from inside a CUDA graph
without knowing on the host how many rows are real. Indices are never read past -1: a row is touched only when both
its source and destination indices are >= 0.

`copy_rows_reference` is the plain-torch definition; `copy_rows_triton` the kernel; `copy_rows` picks the kernel
for CUDA tensors and the reference for CPU tensors, unless `impl` names one (the CPU tests run the kernel under
TRITON_INTERPRET=1 at small sizes).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 8


def _check(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1]:
        raise ValueError(f"copy_rows wants 2-D src and dst with equal row size, got {tuple(src.shape)} and "
                         f"{tuple(dst.shape)}")
    if src.dtype != dst.dtype:
        raise ValueError(f"copy_rows: src dtype {src.dtype} != dst dtype {dst.dtype}")
    if src_rows.shape != dst_rows.shape or src_rows.dim() != 1:
        raise ValueError(f"copy_rows wants two 1-D index lists of one length, got {tuple(src_rows.shape)} and "
                         f"{tuple(dst_rows.shape)}")


def copy_rows_reference(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Plain torch: the definition the kernel is tested against (synchronises on the mask)."""
    _check(src, dst, src_rows, dst_rows)
    keep = (src_rows >= 0) & (dst_rows >= 0)
    s = src_rows[keep].long()
    d = dst_rows[keep].long()
    dst[d.to(dst.device)] = src[s.to(src.device)].to(dst.device)


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, n_rows,
                      WORDS: tl.constexpr, BLOCK_WORDS: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * ROWS + tl.arange(0, ROWS)
    in_range = r < n_rows
    s = tl.load(src_rows_ptr + r, mask=in_range, other=-1).to(tl.int64)
    d = tl.load(dst_rows_ptr + r, mask=in_range, other=-1).to(tl.int64)
    live = (s >= 0) & (d >= 0)
    w = tl.arange(0, BLOCK_WORDS)
    m = live[:, None] & (w < WORDS)[None, :]
    vals = tl.load(src_ptr + s[:, None] * WORDS + w[None, :], mask=m)
    tl.store(dst_ptr + d[:, None] * WORDS + w[None, :], vals, mask=m)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    if t.shape[1] * t.element_size() % 4:
        raise ValueError(f"copy_rows_triton moves 4-byte words: row size {t.shape[1] * t.element_size()} B is not a "
                         "multiple of 4")
    return t.view(torch.uint8).view(torch.int32) if t.dtype != torch.int32 else t


def copy_rows_triton(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Triton kernel: one program moves ROWS_PER_PROGRAM rows; the grid depends only on len(src_rows)."""
    _check(src, dst, src_rows, dst_rows)
    n = src_rows.shape[0]
    if n == 0:
        return
    src_w, dst_w = _as_words(src), _as_words(dst)
    words = src_w.shape[1]
    grid = (triton.cdiv(n, ROWS_PER_PROGRAM),)
    _copy_rows_kernel[grid](src_w, dst_w, src_rows, dst_rows, n, WORDS=words,
                            BLOCK_WORDS=triton.next_power_of_2(words), ROWS=ROWS_PER_PROGRAM)


def interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1, read when kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor,
              impl: str = "auto") -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] where both are >= 0.

    impl: "auto" (the kernel for CUDA index tensors, the reference otherwise), "triton" or "torch".
    """
    if impl == "triton" or (impl == "auto" and src_rows.is_cuda):
        copy_rows_triton(src, dst, src_rows, dst_rows)
    elif impl in ("torch", "auto"):
        copy_rows_reference(src, dst, src_rows, dst_rows)
    else:
        raise ValueError(f"copy_rows: impl must be 'auto', 'triton' or 'torch', got {impl!r}")
