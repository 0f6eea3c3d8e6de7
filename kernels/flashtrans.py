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

ROWS_PER_PROGRAM = 4  # with NUM_WARPS and the masked variant: the best of the sweep (docs/design.md)
NUM_WARPS = 2


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
def _copy_chunk(src_ptr, dst_ptr, s, d, live, SRC_STRIDE: tl.constexpr, DST_STRIDE: tl.constexpr,
                START: tl.constexpr, SIZE: tl.constexpr):
    """Copy words [START, START + SIZE) of each live row; SIZE is a power of two, so no column mask is needed and
    Triton can issue 16-byte accesses (row strides in words are multiples of 4 for 656-B entries)."""
    w = START + tl.arange(0, SIZE)
    m = live[:, None]
    vals = tl.load(src_ptr + s[:, None] * SRC_STRIDE + w[None, :], mask=m)
    tl.store(dst_ptr + d[:, None] * DST_STRIDE + w[None, :], vals, mask=m)


@triton.jit
def _program_rows(src_rows_ptr, dst_rows_ptr, n_rows, ROWS: tl.constexpr):
    """This program's ROWS (source row, destination row) pairs, and which of them are real (both >= 0)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_range = r < n_rows
    s = tl.load(src_rows_ptr + r, mask=in_range, other=-1).to(tl.int64)
    d = tl.load(dst_rows_ptr + r, mask=in_range, other=-1).to(tl.int64)
    return s, d, (s >= 0) & (d >= 0)


@triton.jit(do_not_specialize=("n_rows",))
def _copy_rows_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, n_rows, SRC_STRIDE: tl.constexpr,
                      DST_STRIDE: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                      C3: tl.constexpr, ROWS: tl.constexpr):
    # A row is copied as up to four power-of-two chunks of words, C0 + C1 + C2 + C3 (656 B: 128 + 32 + 4).
    s, d, live = _program_rows(src_rows_ptr, dst_rows_ptr, n_rows, ROWS)
    _copy_chunk(src_ptr, dst_ptr, s, d, live, SRC_STRIDE, DST_STRIDE, 0, C0)
    if C1 > 0:
        _copy_chunk(src_ptr, dst_ptr, s, d, live, SRC_STRIDE, DST_STRIDE, C0, C1)
    if C2 > 0:
        _copy_chunk(src_ptr, dst_ptr, s, d, live, SRC_STRIDE, DST_STRIDE, C0 + C1, C2)
    if C3 > 0:
        _copy_chunk(src_ptr, dst_ptr, s, d, live, SRC_STRIDE, DST_STRIDE, C0 + C1 + C2, C3)


@triton.jit
def _copy_masked(src_ptr, dst_ptr, s, d, live, WORDS: tl.constexpr, SRC_STRIDE: tl.constexpr,
                 DST_STRIDE: tl.constexpr, BLOCK_WORDS: tl.constexpr):
    """Copy the WORDS words of each live row as one power-of-two block with a column mask."""
    w = tl.arange(0, BLOCK_WORDS)
    m = live[:, None] & (w < WORDS)[None, :]
    vals = tl.load(src_ptr + s[:, None] * SRC_STRIDE + w[None, :], mask=m)
    tl.store(dst_ptr + d[:, None] * DST_STRIDE + w[None, :], vals, mask=m)


@triton.jit(do_not_specialize=("n_rows",))
def _copy_rows_masked_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, n_rows, WORDS: tl.constexpr,
                             SRC_STRIDE: tl.constexpr, DST_STRIDE: tl.constexpr, BLOCK_WORDS: tl.constexpr,
                             ROWS: tl.constexpr):
    # One power-of-two block per row with a column mask: the default (the best of the benchmark's sweep).
    s, d, live = _program_rows(src_rows_ptr, dst_rows_ptr, n_rows, ROWS)
    _copy_masked(src_ptr, dst_ptr, s, d, live, WORDS, SRC_STRIDE, DST_STRIDE, BLOCK_WORDS)


@triton.jit(do_not_specialize=("n_rows",))
def _copy_rows_flat_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, n_rows, WORDS: tl.constexpr,
                           SRC_STRIDE: tl.constexpr, DST_STRIDE: tl.constexpr, BLOCK: tl.constexpr):
    # The copy as one flat range of n_rows x WORDS words, one word per lane: each warp reads 128 contiguous bytes,
    # and many more warps are in flight than with a row per lane group (the shape torch.index_select uses).
    f = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    r = f // WORDS
    w = f % WORDS
    m = r < n_rows
    s = tl.load(src_rows_ptr + r, mask=m, other=-1).to(tl.int64)
    d = tl.load(dst_rows_ptr + r, mask=m, other=-1).to(tl.int64)
    live = m & (s >= 0) & (d >= 0)
    vals = tl.load(src_ptr + s * SRC_STRIDE + w, mask=live)
    tl.store(dst_ptr + d * DST_STRIDE + w, vals, mask=live)


@triton.jit(do_not_specialize=("n_rows",))
def _copy_rows_counted_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, count_ptr, n_rows, WORDS: tl.constexpr,
                              SRC_STRIDE: tl.constexpr, DST_STRIDE: tl.constexpr, BLOCK_WORDS: tl.constexpr,
                              ROWS: tl.constexpr, PROGRAMS: tl.constexpr):
    # Persistent: PROGRAMS programs walk the first count[0] rows of the lists (a count the device wrote, e.g. the
    # number of misses), ROWS at a time. Few programs leave the other SMs to concurrent compute.
    n = tl.minimum(tl.load(count_ptr).to(tl.int64), n_rows)
    for start in range(tl.program_id(0) * ROWS, n, PROGRAMS * ROWS):
        r = start + tl.arange(0, ROWS)
        in_range = r < n
        s = tl.load(src_rows_ptr + r, mask=in_range, other=-1).to(tl.int64)
        d = tl.load(dst_rows_ptr + r, mask=in_range, other=-1).to(tl.int64)
        _copy_masked(src_ptr, dst_ptr, s, d, (s >= 0) & (d >= 0), WORDS, SRC_STRIDE, DST_STRIDE, BLOCK_WORDS)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """A 4-byte-word view of rows; rows may be strided (a padded layout) but each row must be contiguous."""
    nbytes, stride = t.shape[1] * t.element_size(), t.stride(0) * t.element_size()
    if nbytes % 4 or stride % 4 or t.stride(1) != 1:
        raise ValueError(f"copy_rows_triton moves 4-byte words of contiguous rows: row of {nbytes} B with a stride of "
                         f"{stride} B does not fit")
    return t if t.dtype == torch.int32 else t.view(torch.int32)


def power_of_two_chunks(words: int) -> tuple[int, int, int, int]:
    """Split a row of `words` words into at most four power-of-two chunks, largest first (164 -> 128, 32, 4, 0)."""
    chunks = [1 << b for b in range(words.bit_length() - 1, -1, -1) if words >> b & 1]
    if len(chunks) > 4:
        raise ValueError(f"copy_rows_triton: a row of {words} words needs {len(chunks)} power-of-two chunks (max 4)")
    return tuple(chunks + [0] * (4 - len(chunks)))  # type: ignore[return-value]


def copy_rows_triton(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor,
                     rows_per_program: int = ROWS_PER_PROGRAM, num_warps: int = NUM_WARPS,
                     variant: str = "masked") -> None:
    """Triton kernel: one program moves `rows_per_program` rows; the grid depends only on len(src_rows)."""
    _check(src, dst, src_rows, dst_rows)
    n = src_rows.shape[0]
    if n == 0:
        return
    src_w, dst_w = _as_words(src), _as_words(dst)
    words, src_stride, dst_stride = src_w.shape[1], src_w.stride(0), dst_w.stride(0)
    grid = (triton.cdiv(n, rows_per_program),)
    if variant == "chunks":
        c0, c1, c2, c3 = power_of_two_chunks(words)
        _copy_rows_kernel[grid](src_w, dst_w, src_rows, dst_rows, n, SRC_STRIDE=src_stride, DST_STRIDE=dst_stride,
                                C0=c0, C1=c1, C2=c2, C3=c3, ROWS=rows_per_program, num_warps=num_warps)
    elif variant == "flat":  # rows_per_program x 128 words per program
        block = 128 * rows_per_program
        _copy_rows_flat_kernel[(triton.cdiv(n * words, block),)](
            src_w, dst_w, src_rows, dst_rows, n, WORDS=words, SRC_STRIDE=src_stride, DST_STRIDE=dst_stride,
            BLOCK=block, num_warps=num_warps)
    elif variant == "masked":
        _copy_rows_masked_kernel[grid](src_w, dst_w, src_rows, dst_rows, n, WORDS=words, SRC_STRIDE=src_stride,
                                       DST_STRIDE=dst_stride, BLOCK_WORDS=triton.next_power_of_2(words),
                                       ROWS=rows_per_program, num_warps=num_warps)
    else:
        raise ValueError(f"copy_rows_triton: variant must be 'chunks', 'flat' or 'masked', got {variant!r}")


def copy_rows_counted(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor,
                      count: torch.Tensor, programs: int, rows_per_program: int = 8, num_warps: int = 4) -> None:
    """Like `copy_rows_triton` over the first `count` rows only (a 1-element device tensor, read by the kernel: no
    host synchronisation), with a fixed number of persistent programs; the torch definition is
    `copy_rows_reference(src, dst, src_rows[:count], dst_rows[:count])`."""
    _check(src, dst, src_rows, dst_rows)
    n = src_rows.shape[0]
    if n == 0:
        return
    if programs < 1 or count.numel() != 1:
        raise ValueError(f"copy_rows_counted wants programs >= 1 and a 1-element count, got {programs}, "
                         f"{tuple(count.shape)}")
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"copy_rows_counted wants rows_per_program a power of two, got {rows_per_program}")
    src_w, dst_w = _as_words(src), _as_words(dst)
    words = src_w.shape[1]
    _copy_rows_counted_kernel[(programs,)](
        src_w, dst_w, src_rows, dst_rows, count, n, WORDS=words, SRC_STRIDE=src_w.stride(0),
        DST_STRIDE=dst_w.stride(0), BLOCK_WORDS=triton.next_power_of_2(words), ROWS=rows_per_program,
        PROGRAMS=programs, num_warps=num_warps)


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
