"""A decode step's per-request rows, in one launch: what every layer's resolve and prefetch of the step read.

For a batch of B entries (request rows `rpi`, lengths `lens` including the token being decoded; entries from
`num_real[0]` on are CUDA-graph padding), six int64 rows of one [6, B] tensor:

    0 rpi             the request rows
    1 lens            the lengths
    2 live_rpi        rpi, -1 where the entry is not live (padding, or length 0): the resolve ignores its positions
    3 visible_lens    lens, 0 where not live: no prefetch candidate comes from it
    4 new_host_loc    req_to_host[rpi, lens - 1], the host location of the token being decoded; -1 where not live or
                      where the row or position lies outside the table (such an entry is never read)
    5 new_token_rows  new_token_base + rpi: the device-pool row of the request's new-token slot

`step_rows_torch` is the definition, `step_rows_triton` the kernel (one program over the batch). In the SGLang
plugin these were about fifteen small torch launches (casts, compares, where, clamp, a gather) in layer 0 of every
decode step; the kernel took 1.4 us at one 32K request on an H100 (SGLang's profiler).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FIELDS = ("rpi", "lens", "live_rpi", "visible_lens", "new_host_loc", "new_token_rows")


def _check(rpi: torch.Tensor, lens: torch.Tensor, num_real: torch.Tensor, req_to_host: torch.Tensor) -> None:
    if rpi.dim() != 1 or lens.shape != rpi.shape:
        raise ValueError(f"step rows: rpi and lens must be [B] alike, got {tuple(rpi.shape)} and {tuple(lens.shape)}")
    if num_real.numel() != 1:
        raise ValueError(f"step rows: num_real must hold one count, got {num_real.numel()} elements")
    if req_to_host.dim() != 2 or req_to_host.dtype != torch.int64 or req_to_host.stride(1) != 1:
        raise ValueError(f"step rows: req_to_host must be a row-contiguous int64 [rows, width] table, got "
                         f"{req_to_host.dtype} {tuple(req_to_host.shape)}")


def step_rows_torch(rpi: torch.Tensor, lens: torch.Tensor, num_real: torch.Tensor, req_to_host: torch.Tensor,
                    new_token_base: int) -> torch.Tensor:
    """The definition: int64 [6, B], rows as the module says."""
    _check(rpi, lens, num_real, req_to_host)
    rpi, lens = rpi.long(), lens.long()
    B = rpi.shape[0]
    ids = torch.arange(B, dtype=torch.int64, device=rpi.device)
    live = (ids < num_real.reshape(()).long()) & (lens > 0)
    pos = lens - 1
    readable = live & (rpi >= 0) & (rpi < req_to_host.shape[0]) & (pos < req_to_host.shape[1])
    host = req_to_host[torch.where(readable, rpi, 0), torch.where(readable, pos, 0)]
    return torch.stack([rpi, lens, torch.where(live, rpi, -1), torch.where(live, lens, 0),
                        torch.where(readable, host, -1), rpi + new_token_base])


@triton.jit
def _step_rows_kernel(rpi_ptr, lens_ptr, num_real_ptr, r2h_ptr, r2h_stride, r2h_rows, width, new_token_base, out_ptr,
                      B, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < B
    rpi = tl.load(rpi_ptr + i, mask=m, other=0).to(tl.int64)
    lens = tl.load(lens_ptr + i, mask=m, other=0).to(tl.int64)
    live = m & (i < tl.load(num_real_ptr).to(tl.int64)) & (lens > 0)
    pos = lens - 1
    readable = live & (rpi >= 0) & (rpi < r2h_rows) & (pos < width)
    host = tl.load(r2h_ptr + rpi * r2h_stride + pos, mask=readable, other=-1)
    tl.store(out_ptr + i, rpi, mask=m)
    tl.store(out_ptr + B + i, lens, mask=m)
    tl.store(out_ptr + 2 * B + i, tl.where(live, rpi, -1), mask=m)
    tl.store(out_ptr + 3 * B + i, tl.where(live, lens, 0), mask=m)
    tl.store(out_ptr + 4 * B + i, host, mask=m)
    tl.store(out_ptr + 5 * B + i, rpi + new_token_base, mask=m)


def step_rows_triton(rpi: torch.Tensor, lens: torch.Tensor, num_real: torch.Tensor, req_to_host: torch.Tensor,
                     new_token_base: int) -> torch.Tensor:
    """`step_rows_torch` in one launch (one program: a decode batch is at most a few hundred entries)."""
    _check(rpi, lens, num_real, req_to_host)
    B = rpi.shape[0]
    out = torch.empty((len(FIELDS), B), dtype=torch.int64, device=rpi.device)
    if B:
        _step_rows_kernel[(1,)](rpi.contiguous(), lens.contiguous(), num_real, req_to_host, req_to_host.stride(0),
                                req_to_host.shape[0], req_to_host.shape[1], new_token_base, out, B,
                                BLOCK=max(16, triton.next_power_of_2(B)))
    return out
