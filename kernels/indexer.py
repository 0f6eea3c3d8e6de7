"""DSA indexer for decode: logits of every past token over the paged indexer K cache, then the top-k positions.

DeepSeek-V3.2's lightning indexer scores position t of request b for query token j as

    logits[b, j, t] = sum_h  weights[b, j, h] * relu( (q[b, j, h] . k_t) * s_t )

with 64 index heads of 128, k_t the token's fp8 e4m3 key and s_t its fp32 scale (our 132-B entry: 128 fp8 bytes,
then the scale; `ess_sglang.formats.pack_indexer_key`). Position t is read through the request table,
`index_cache[req_to_token[req_pool_indices[b], t]]`, and is visible to query token j only below its causal length
`seq_lens[b] - (Q - 1) + j` (`ess_sglang.reference.dsa.causal_lengths`); other positions get -inf.

The query, as SGLang feeds DeepGEMM's `fp8_paged_mqa_logits` (sglang 0.5.23,
srt/layers/attention/dsa/dsa_indexer.py): `q_fp8, q_scale = act_quant(query, 128, "ue8m0")` quantises each
(token, head) row of 128 to fp8 e4m3 with one fp32 scale (a power of two: models/deepseek_v2.py:2131 passes
scale_fmt="ue8m0"); the scale is folded into the head weights, `weights = weights_proj(x) * n_heads**-0.5 * q_scale
* softmax_scale` (dsa_indexer.py:585-597, `_get_logits_head_gate` / `_apply_q_scale_and_softmax_scale`), which is
exact because relu(c x) = c relu(x) for c > 0. So the kernel's `weights` are the final per-head factors: every
scale (n_heads**-0.5, head_dim**-0.5, the q scale) is the caller's. `quantize_index_q` does that folding.

Accepted query dtypes and the dot each uses on the GPU (every product is exact in fp32, fp8 and bf16 values being
exactly representable; only the summation order differs from the reference):
  - float8_e4m3fn (DeepSeek's): keys and q dequantised to bf16 (exact), bf16 tl.dot with fp32 accumulation; or,
    with `fp8_dot=True`, an fp8 x fp8 tl.dot (sm89+), faster but not exact: on the H200 its tensor-core
    accumulation left a relative error of 2.7e-4 against the fp32 reference (2026-11-29), so it is opt-in;
  - bfloat16: keys dequantised to bf16 (exact), bf16 tl.dot with fp32 accumulation;
  - float16 / float32: fp32 tl.dot with input_precision="ieee" (exact, slow: for tests, not the harness).
Under TRITON_INTERPRET every dtype takes the fp32 path (the interpreter has no fp8 or bf16 dot).

Bounds: a position's table entry is read only when the position is visible (below seq_len, max_len and the table's
width) and its request row is one of the table's (0 <= req_pool_indices[b] < rows: a request outside the table sees
nothing, every logit -inf); a table entry outside [0, N) is never dereferenced and its logit is -inf, as if the
position were masked.

`indexer_logits_reference` is the plain-torch definition (equal to `reference.dsa.indexer_logits` wherever every
visible table entry is in range, and accepting fp8 q); `indexer_logits_triton` the kernel; `indexer_topk` the top-k.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl
from ess_sglang.kernels.flashtrans import interpreting
from ess_sglang.kernels.resolve import pdl_supported

from ess_sglang.formats import FP8, FP8_MAX, INDEX_HEAD_DIM, INDEXER_ENTRY_BYTES, unpack_indexer_key
from ess_sglang.reference.dsa import causal_lengths, topk_positions

ENTRY_WORDS = INDEXER_ENTRY_BYTES // 4  # 33: 32 words of fp8 keys, then the scale
BLOCK_T = 128  # positions per tile
# tiles per program: 1 (docs/design.md, "Indexer"). The decode stacks run bf16 queries; there one tile a program
# measured 294.9 / 1,136.3 us at batch 64, 32K / 128K, against 8 tiles' 307.1 / 1,159.5, and the all-HBM decode
# stack 425.6 / 1,268.6 us a layer against 446.2 / 1,321.8 (H200, 2026-12-01)
TILES = 1
STAGES = 2  # tiles a program keeps in flight (the compiler's software pipelining of its loop over them)
NUM_WARPS = 4
DOT_FP32, DOT_BF16, DOT_FP8 = 0, 1, 2
CHAIN_POSITIONS = ("off", "head", "link")  # indexer_logits_triton's `chain`

assert INDEX_HEAD_DIM == 128 and ENTRY_WORDS == 33


def _check(q_index, weights, index_cache, req_to_token, req_pool_indices, seq_lens, max_len, first_pos=0):
    if q_index.dim() != 4 or q_index.shape[-1] != INDEX_HEAD_DIM:
        raise ValueError(f"indexer_logits wants q_index [B, Q, H, {INDEX_HEAD_DIM}], got {tuple(q_index.shape)}")
    B, Q, H = q_index.shape[:3]
    if Q < 1:
        raise ValueError("indexer_logits wants at least one query token per request")
    if tuple(weights.shape) != (B, Q, H):
        raise ValueError(f"indexer_logits wants weights [B, Q, H] = {(B, Q, H)}, got {tuple(weights.shape)}")
    if index_cache.dim() != 2 or index_cache.dtype != torch.uint8 or index_cache.shape[1] != INDEXER_ENTRY_BYTES:
        raise ValueError(f"indexer_logits wants index_cache [N, {INDEXER_ENTRY_BYTES}] uint8, got "
                         f"{index_cache.dtype} {tuple(index_cache.shape)}")
    if req_to_token.dim() != 2 or tuple(req_pool_indices.shape) != (B,) or tuple(seq_lens.shape) != (B,):
        raise ValueError(f"indexer_logits wants req_to_token [R, C], req_pool_indices [B] and seq_lens [B] (B={B}), "
                         f"got {tuple(req_to_token.shape)}, {tuple(req_pool_indices.shape)}, {tuple(seq_lens.shape)}")
    if max_len < 0:
        raise ValueError(f"indexer_logits: max_len must be >= 0, got {max_len}")
    if not 0 <= first_pos <= max_len:
        raise ValueError(f"indexer_logits: first_pos must be in [0, max_len = {max_len}], got {first_pos}")


def indexer_logits_reference(q_index: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                             req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                             max_len: int, first_pos: int = 0) -> torch.Tensor:
    """Plain torch: logits [B, Q, max_len - first_pos] fp32 of positions [first_pos, max_len); the definition the
    kernel is tested against.

    q_index [B, Q, H, 128] in any float dtype (fp8 e4m3 included: its values are used as they are, the q scale being
    folded into weights), weights [B, Q, H]. Same arithmetic as `reference.dsa.indexer_logits`, plus the kernel's
    bounds rules: a visible position whose table entry lies outside [0, N) (or past the table's width) gets -inf, and
    so does every position of a request whose row is outside the table.
    """
    _check(q_index, weights, index_cache, req_to_token, req_pool_indices, seq_lens, max_len, first_pos)
    B, Q = q_index.shape[:2]
    N, C = index_cache.shape[0], req_to_token.shape[1]
    dev = q_index.device
    pos = torch.arange(max_len, device=dev)
    locs = torch.full((B, max_len), -1, dtype=torch.long, device=dev)
    width = min(max_len, C)
    rows = req_pool_indices.long()
    row_ok = (rows >= 0) & (rows < req_to_token.shape[0])  # a row outside the table: no position is read
    locs[:, :width] = torch.where(row_ok.view(B, 1), req_to_token[torch.where(row_ok, rows, 0), :width].long(), -1)
    in_range = (locs >= 0) & (locs < N)  # [B, T]
    present = (pos.view(1, -1) < seq_lens.long().view(-1, 1)) & in_range
    keys, scale = unpack_indexer_key(index_cache[torch.where(present, locs, 0)])  # [B, T, 128], [B, T]
    dots = torch.einsum("bqhd,btd->bqht", q_index.float(), keys) * scale.view(B, 1, 1, -1)
    logits = (dots.relu() * weights.float().unsqueeze(-1)).sum(dim=2)  # [B, Q, T]
    visible = pos.view(1, 1, -1) < causal_lengths(seq_lens, Q).unsqueeze(-1)
    return logits.masked_fill(~(visible & in_range.unsqueeze(1)), float("-inf"))[..., first_pos:]


@triton.jit
def _score_tile(q_base, hm, w, cache_ptr, r2t_ptr, row, r2t_stride, num_locations, visible, pos,
                BLOCK_T: tl.constexpr, HP: tl.constexpr, DOT: tl.constexpr, Q_FP8: tl.constexpr):
    """The logits of BLOCK_T positions `pos` (-inf where not visible or the table entry is out of range)."""
    valid = pos < visible
    loc = tl.load(r2t_ptr + row * r2t_stride + pos, mask=valid, other=-1).to(tl.int64)
    ok = valid & (loc >= 0) & (loc < num_locations)
    # the entry as 33 little-endian words: key byte d = 4 w + i is byte i of word w; word 32 is the scale
    kw = tl.arange(0, 32)
    words = tl.load(cache_ptr + loc[:, None] * 33 + kw[None, :], mask=ok[:, None], other=0)  # [BLOCK_T, 32]
    scale = tl.load(cache_ptr + loc * 33 + 32, mask=ok, other=0).to(tl.float32, bitcast=True)
    acc = tl.zeros((BLOCK_T, HP), dtype=tl.float32)
    for i in tl.static_range(4):
        k8 = ((words >> (8 * i)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)  # keys d = 4 w + i
        if Q_FP8:  # fp8 q comes as its bytes (a masked load needs no fp8 constant)
            qt = tl.load(q_base + (4 * kw[:, None] + i), mask=hm[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        else:
            qt = tl.load(q_base + (4 * kw[:, None] + i), mask=hm[None, :], other=0.0)  # [32, HP]: q[h, 4 w + i]
        if DOT == 2:
            acc = tl.dot(k8, qt, acc)
        elif DOT == 1:
            acc = tl.dot(k8.to(tl.bfloat16), qt.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(k8.to(tl.float32), qt.to(tl.float32), acc, input_precision="ieee")
    scored = tl.maximum(acc * scale[:, None], 0.0) * w[None, :]
    return tl.where(ok, tl.sum(scored, axis=1), float("-inf"))


@triton.jit
def _indexer_logits_kernel(q_ptr, w_ptr, cache_ptr, r2t_ptr, rpi_ptr, seq_ptr, out_ptr,
                           q_sb, q_sq, q_sh, w_sb, w_sq, w_sh, r2t_stride, out_sb, out_sq,
                           num_locations, table_width, table_rows, first_pos, max_len, H, Q,
                           HP: tl.constexpr, BLOCK_T: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
                           DOT: tl.constexpr, Q_FP8: tl.constexpr, CHAINED: tl.constexpr):
    # program (group of TILES tiles of BLOCK_T positions from first_pos, (request b, query token j)); out[..., 0] is
    # first_pos. The tiles of a group are scored one after the other by the same program, which reads the head
    # weights once (and, for its later tiles, the query from L1 / L2 rather than DRAM)
    if CHAINED:  # (indexer_logits_triton's `chain`) the stream's next launch may be scheduled once every program of
        tl.extra.cuda.gdc_launch_dependents()  # this one has started
    group = tl.program_id(0)
    bq = tl.program_id(1)
    b = bq // Q
    j = bq % Q
    seq = tl.load(seq_ptr + b).to(tl.int64)
    visible = tl.minimum(tl.minimum(seq - (Q - 1) + j, max_len), table_width)  # readable positions: [0, visible)
    row = tl.load(rpi_ptr + b).to(tl.int64)
    # a request row outside the table: nothing is read, nothing is visible
    visible = tl.where((row >= 0) & (row < table_rows), visible, 0)
    first = first_pos + group * (TILES * BLOCK_T)
    out_row = out_ptr + b.to(tl.int64) * out_sb + j * out_sq - first_pos
    if first < visible:
        h = tl.arange(0, HP)
        hm = h < H
        q_base = q_ptr + b.to(tl.int64) * q_sb + j * q_sq + h[None, :] * q_sh
        w = tl.load(w_ptr + b.to(tl.int64) * w_sb + j * w_sq + h * w_sh, mask=hm, other=0.0).to(tl.float32)
        for t in tl.range(0, TILES, num_stages=STAGES):
            pos = first + t * BLOCK_T + tl.arange(0, BLOCK_T)
            logit = _score_tile(q_base, hm, w, cache_ptr, r2t_ptr, row, r2t_stride, num_locations, visible, pos,
                                BLOCK_T, HP, DOT, Q_FP8)
            tl.store(out_row + pos, logit, mask=pos < max_len)
    else:
        for t in tl.range(0, TILES):
            pos = first + t * BLOCK_T + tl.arange(0, BLOCK_T)
            tl.store(out_row + pos, tl.full((BLOCK_T,), float("-inf"), tl.float32), mask=pos < max_len)
    if CHAINED:  # ... but a link ends after the launch before it (a no-op in a launch without PDL)
        tl.extra.cuda.gdc_wait()


def dot_mode(q_dtype: torch.dtype, fp8_dot: bool = False) -> int:
    """Which tl.dot the kernel runs for a query dtype: DOT_FP8, DOT_BF16 or DOT_FP32 (always under the interpreter)."""
    if interpreting():
        return DOT_FP32
    if q_dtype == FP8:
        return DOT_FP8 if fp8_dot else DOT_BF16
    if q_dtype == torch.bfloat16:
        return DOT_BF16
    if q_dtype in (torch.float32, torch.float16):
        return DOT_FP32
    raise ValueError(f"indexer_logits_triton: q dtype {q_dtype} not supported (fp8 e4m3, bf16, fp16, fp32)")


def indexer_logits_triton(q_index: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                          req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                          max_len: int, out: torch.Tensor | None = None, block_t: int = BLOCK_T,
                          num_warps: int = NUM_WARPS, fp8_dot: bool = False, first_pos: int = 0,
                          chain: str = "off", tiles: int = TILES, stages: int = STAGES) -> torch.Tensor:
    """Triton kernel: logits [B, Q, max_len - first_pos] fp32 of positions [first_pos, max_len), equal to
    `indexer_logits_reference` up to fp32 summation order. A nonzero `first_pos` scores a later part of the positions
    alone (the decode stack's prefetch in position segments: `out` a slice of the whole logits).

    One program per (group of `tiles` tiles of `block_t` positions, request, query token), which scores its tiles one
    after the other (`stages`: how many of them the compiler keeps in flight); the grid depends only on B, Q and
    max_len (CUDA-graph safe). Every output element is written (-inf where not visible), so `out` may hold garbage.
    `chain` (a GPU of compute capability 9.0+): launches of one series of segments of the same logits (positions, or
    batch rows), one after the other on one stream, none reading what another writes. "head": the series' first
    launch, launched as usual; "link": each later one, launched with programmatic dependent launch after the one
    before. Every program of a series lets the stream's next launch be scheduled once it has started (so a link's
    programs fill the previous launch's last wave, ahead of kernels that other streams queue behind that launch), and
    a link's programs end only after the launch before has ended (so the stream's kernels still complete in order).
    "off": neither. The stream's next kernel after the series may then start early too if it is itself launched with
    programmatic dependent launch: it must wait (griddepcontrol.wait) before it reads the logits, as SGLang's decode
    top-k and this package's PDL kernels do; a kernel launched as usual waits for the last link to end.
    q_index [B, Q, H, 128] (last dim contiguous) in fp8 e4m3 / bf16 / fp16 / fp32; weights [B, Q, H];
    index_cache [N, 132] uint8 (rows contiguous); req_to_token [R, C] int32/int64; req_pool_indices, seq_lens [B].
    """
    _check(q_index, weights, index_cache, req_to_token, req_pool_indices, seq_lens, max_len, first_pos)
    B, Q, H = q_index.shape[:3]
    if q_index.stride(-1) != 1 or index_cache.stride(1) != 1 or index_cache.stride(0) != INDEXER_ENTRY_BYTES \
            or req_to_token.stride(1) != 1:
        raise ValueError("indexer_logits_triton wants q_index's last dim, index_cache and req_to_token rows contiguous")
    mode = dot_mode(q_index.dtype, fp8_dot)
    if chain not in CHAIN_POSITIONS:
        raise ValueError(f"indexer_logits_triton: chain must be one of {', '.join(CHAIN_POSITIONS)}, got {chain!r}")
    if chain != "off" and not pdl_supported(q_index.device):
        raise ValueError(f"indexer_logits_triton: chain {chain!r} needs programmatic dependent launch (a CUDA GPU of "
                         f"compute capability 9.0 or newer), and q_index is on {q_index.device}")
    if tiles < 1 or stages < 1:
        raise ValueError(f"indexer_logits_triton: tiles and stages must be >= 1, got {tiles} and {stages}")
    T = max_len - first_pos
    if out is None:
        out = torch.empty((B, Q, T), dtype=torch.float32, device=q_index.device)
    _check_out(out, q_index, T)
    if B == 0 or T == 0:
        return out
    cache_words = index_cache.view(torch.int32)  # [N, 33]
    grid = (triton.cdiv(T, block_t * tiles), B * Q)
    q_fp8 = q_index.dtype == FP8
    _indexer_logits_kernel[grid](
        q_index.view(torch.uint8) if q_fp8 else q_index, weights, cache_words, req_to_token, req_pool_indices,
        seq_lens, out,
        q_index.stride(0), q_index.stride(1), q_index.stride(2), weights.stride(0), weights.stride(1),
        weights.stride(2), req_to_token.stride(0), out.stride(0), out.stride(1),
        index_cache.shape[0], req_to_token.shape[1], req_to_token.shape[0], first_pos, max_len, H, Q,
        HP=max(16, triton.next_power_of_2(H)), BLOCK_T=block_t, TILES=tiles, STAGES=stages, DOT=mode, Q_FP8=q_fp8,
        CHAINED=chain != "off",
        num_warps=num_warps, **(dict(launch_pdl=True) if chain == "link" else {}))
    return out


def _check_out(out: torch.Tensor, q_index: torch.Tensor, positions: int) -> None:
    B, Q = q_index.shape[:2]
    if tuple(out.shape) != (B, Q, positions) or out.dtype != torch.float32 or out.stride(-1) != 1 or \
            out.device != q_index.device:
        raise ValueError(f"indexer_logits: out must be fp32 [B, Q, positions] = {(B, Q, positions)} on "
                         f"{q_index.device} with its last dim contiguous, got {out.dtype} {tuple(out.shape)} on "
                         f"{out.device}")


def check_tiles(tiles: object, name: str) -> None:
    """`tiles` is a valid tiles-a-program setting (an integer >= 1, not a bool, or None: the kernel's default), or a
    ValueError that names it as `name`. (StackOptions checks its own with this before anything is allocated.)"""
    if tiles is not None and (isinstance(tiles, bool) or not isinstance(tiles, numbers.Integral) or tiles < 1):
        raise ValueError(f"{name} must be an integer >= 1 or None, got {tiles!r}")


def indexer_logits(q_index, weights, index_cache, req_to_token, req_pool_indices, seq_lens, max_len,
                   impl: str = "auto", out: torch.Tensor | None = None, first_pos: int = 0,
                   chain: str = "off", tiles: int | None = None) -> torch.Tensor:
    """impl: "auto" (the kernel for CUDA tensors, the reference otherwise), "triton" or "torch". Logits of positions
    [first_pos, max_len). `out` (fp32 [B, Q, max_len - first_pos], e.g. a batch chunk's rows or a position segment of
    a larger tensor) receives the logits when given. `chain`: the kernel's (`indexer_logits_triton`); the reference
    takes "off" only. `tiles`: the kernel's tiles a program (None: its default); a launch shape only, which the
    reference (one result whatever the launch) checks and otherwise ignores."""
    check_tiles(tiles, "indexer_logits: tiles")
    if impl == "triton" or (impl == "auto" and q_index.is_cuda):
        return indexer_logits_triton(q_index, weights, index_cache, req_to_token, req_pool_indices, seq_lens,
                                     max_len, out=out, first_pos=first_pos, chain=chain,
                                     tiles=TILES if tiles is None else int(tiles))
    if chain != "off":
        raise ValueError(f"indexer_logits: chain {chain!r} is the Triton kernel's launch; impl {impl!r} runs the "
                         f"reference")
    if impl in ("torch", "auto"):
        if out is not None:
            _check_out(out, q_index, max_len - first_pos)
        logits = indexer_logits_reference(q_index, weights, index_cache, req_to_token, req_pool_indices, seq_lens,
                                          max_len, first_pos)
        return logits if out is None else out.copy_(logits)
    raise ValueError(f"indexer_logits: impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def indexer_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k positions of each row of logits [B, Q, T] as int32 [B, Q, k], best first, -1 padding: the decode
    harness's name for `reference.dsa.topk_positions` (torch.topk serves both)."""
    return topk_positions(logits, k)


def quantize_index_q(q: torch.Tensor, weights: torch.Tensor, round_scale: bool = True,
                     min_amax: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3.2's query quantisation: q [..., H, 128] float -> (q fp8 e4m3, weights * q_scale fp32).

    One scale per (token, head) row: amax / 448 (amax floored at 1e-4), rounded up to a power of two when
    `round_scale` (scale_fmt="ue8m0", as DeepSeek-V3.2 runs), as SGLang's `act_quant(query, 128, scale_fmt)`
    (sglang/kernels/ops/quantization/act_quant_triton.py:57-68, called at dsa_indexer.py:2083); the
    scale is multiplied into the head weights (weights [..., H]), so that `indexer_logits*(q_fp8, folded, ...)`
    approximates the logits of the unquantised q with the given weights. Any n_heads**-0.5 / softmax_scale factors
    are the caller's, already in `weights`.
    """
    if q.shape[-1] != INDEX_HEAD_DIM or q.shape[:-1] != weights.shape:
        raise ValueError(f"quantize_index_q wants q [..., H, {INDEX_HEAD_DIM}] and weights [..., H], got "
                         f"{tuple(q.shape)} and {tuple(weights.shape)}")
    qf = q.float()
    scale = qf.abs().amax(dim=-1).clamp_min(min_amax) / FP8_MAX
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q8 = (qf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q8, weights.float() * scale
