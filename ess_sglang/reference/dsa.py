"""Reference pieces of one DeepSeek Sparse Attention decode layer, in plain torch (CPU), plus the FlashMLA path (GPU).

- Indexer: logits[t] = sum_h w[h] * relu(q_h . k_t) with k_t = fp8 key * per-token scale (DeepSeek-V3.2's indexer),
  over the request's own tokens, causal per query token; then top-k positions (-1 padding when fewer exist).
- Sparse MLA attention over V32 latent entries: each query head (576 = 512 no-rope + 64 rope) dots with the
  dequantised entries named by an index table, softmax, and the output is the probability-weighted sum of the
  512 no-rope values. Index -1 is padding (ignored).

Both attention paths read entries only through the index table, so they cannot tell whether the table holds KV
locations of a full device cache or slots of an ESS hot pool: same bytes in the same order give the same output.
"""

from __future__ import annotations

import torch

from ess_sglang.formats import KV_LORA_RANK, LATENT_ENTRY_BYTES, QK_HEAD_DIM, unpack_indexer_key, unpack_latent


def causal_lengths(seq_lens: torch.Tensor, q_tokens: int) -> torch.Tensor:
    """[batch, q_tokens]: how many positions query token j may see (the last q_tokens positions are this step's)."""
    offs = torch.arange(q_tokens, device=seq_lens.device) - (q_tokens - 1)
    return seq_lens.long().view(-1, 1) + offs.view(1, -1)


def indexer_logits(q_index: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, req_to_token: torch.Tensor,
                   req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """q_index [B, Q, Hi, 128] float, weights [B, Q, Hi], index_cache [locations, 132] uint8 -> logits [B, Q, max_len].

    Positions a query token may not see (past its causal length) get -inf.
    """
    B, Q = q_index.shape[:2]
    locs = req_to_token[req_pool_indices.long(), :max_len].long()  # [B, max_len]
    visible = causal_lengths(seq_lens, Q)  # [B, Q]
    pos = torch.arange(max_len, device=q_index.device)
    present = pos.view(1, -1) < seq_lens.long().view(-1, 1)
    keys, scale = unpack_indexer_key(index_cache[torch.where(present, locs, 0)])  # [B, T, 128], [B, T]
    dots = torch.einsum("bqhd,btd->bqht", q_index.float(), keys) * scale.view(B, 1, 1, -1)
    logits = (dots.relu() * weights.float().unsqueeze(-1)).sum(dim=2)  # [B, Q, T]
    return logits.masked_fill(pos.view(1, 1, -1) >= visible.unsqueeze(-1), float("-inf"))


def topk_with_scores(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k positions of each row of logits [B, Q, T] as int32 [B, Q, k] (-1 where fewer than k are visible), and
    the k-th best score [B, Q] (-inf where fewer than k are visible)."""
    T = logits.shape[-1]
    kk = min(k, T)
    values, pos = torch.topk(logits, kk, dim=-1)
    pos = torch.where(torch.isfinite(values), pos, -1).to(torch.int32)
    if kk < k:
        pos = torch.cat([pos, pos.new_full((*pos.shape[:-1], k - kk), -1)], dim=-1)
        return pos, torch.full(values.shape[:-1], float("-inf"), device=logits.device)
    return pos, values[..., -1]


def topk_positions(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k positions of each row of logits [B, Q, T] as int32 [B, Q, k]; -1 where fewer than k are visible."""
    return topk_with_scores(logits, k)[0]


def sparse_mla_reference(q: torch.Tensor, kv_entries: torch.Tensor, indices: torch.Tensor,
                         softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Q, H, 576]; kv_entries [N, 656] uint8; indices [B, Q, K] int32 rows of kv_entries, -1 = padding.

    Returns (out [B, Q, H, 512] float32, lse [B, Q, H] float32). Only rows named by `indices` are read.
    """
    if q.shape[-1] != QK_HEAD_DIM or kv_entries.shape[-1] != LATENT_ENTRY_BYTES:
        raise ValueError(f"sparse_mla_reference wants q [..., {QK_HEAD_DIM}] and entries [N, {LATENT_ENTRY_BYTES}]")
    valid = indices >= 0
    kv = unpack_latent(kv_entries[torch.where(valid, indices, 0).long()])  # [B, Q, K, 576]
    scores = torch.einsum("bqhd,bqkd->bqhk", q.float(), kv) * softmax_scale
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bqhk,bqkd->bqhd", probs, kv[..., :KV_LORA_RANK])
    return out, lse


def latent_store_rows(num_locations: int) -> int:
    """Rows of a latent store FlashMLA can read: whole pages of 64 entries."""
    return (num_locations + 63) // 64 * 64


def sparse_mla_flashmla(q: torch.Tensor, kv_entries: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                        metadata=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same attention through FlashMLA's V32 sparse decode kernel (GPU; sgl-flash-mla, legacy SM90 path).

    q [B, Q, H, 576] bf16 with H in (64, 128); kv_entries [N, 656] uint8 with N a multiple of 64.
    """
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    if kv_entries.shape[0] % 64:
        raise ValueError(f"FlashMLA reads pages of 64 entries: {kv_entries.shape[0]} rows is not a multiple of 64")
    if metadata is None:
        metadata, _ = get_mla_metadata()
    k_cache = kv_entries.view(-1, 64, 1, LATENT_ENTRY_BYTES)
    block_table = torch.empty((q.shape[0], 0), dtype=torch.int32, device=q.device)
    return flash_mla_with_kvcache(q.to(torch.bfloat16), k_cache, block_table, None, KV_LORA_RANK, metadata,
                                  softmax_scale=softmax_scale, is_fp8_kvcache=True, indices=indices.to(torch.int32),
                                  use_legacy=True, kv_format="V32")
