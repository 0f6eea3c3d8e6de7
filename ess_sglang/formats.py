"""Byte layouts of the two per-token, per-layer cache entries of a DeepSeek Sparse Attention model.

Latent entry, FlashMLA "V32" FP8 format (656 bytes):

    bytes [0, 512)    512 fp8 e4m3 values: the no-rope part of the MLA latent (kv_lora_rank = 512)
    bytes [512, 528)  4 fp32 scales, one per tile of 128 no-rope values
    bytes [528, 656)  64 bf16 values: the rope part

Indexer K entry (132 bytes): 128 fp8 e4m3 values, then one fp32 scale.

The functions here are the plain-torch definitions the rest of the project (and its tests) agree on:
``pack_latent`` / ``unpack_latent`` and ``pack_indexer_key`` / ``unpack_indexer_key``.
"""

from __future__ import annotations

import torch

from ess_sglang.entry_sizes import (  # noqa: F401  (the sizes, re-exported beside the layouts that fill them)
    INDEX_HEAD_DIM,
    INDEXER_ENTRY_BYTES,
    KV_LORA_RANK,
    LATENT_ENTRY_BYTES,
    LATENT_TILE,
    LATENT_TILES,
    ROPE_DIM,
)

QK_HEAD_DIM = KV_LORA_RANK + ROPE_DIM  # 576: what a query head dots with a latent entry

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 1e-8

assert LATENT_ENTRY_BYTES == 656 and INDEXER_ENTRY_BYTES == 132


def pack_latent(nope: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Quantise latents to V32 entries.

    nope: [..., 512] float, rope: [..., 64] float -> [..., 656] uint8.
    Each tile of 128 no-rope values gets the scale amax / 448, so that it fills the fp8 range.
    """
    if nope.shape[-1] != KV_LORA_RANK or rope.shape[-1] != ROPE_DIM or nope.shape[:-1] != rope.shape[:-1]:
        raise ValueError(f"pack_latent wants nope [..., {KV_LORA_RANK}] and rope [..., {ROPE_DIM}], "
                         f"got {tuple(nope.shape)} and {tuple(rope.shape)}")
    lead = nope.shape[:-1]
    tiles = nope.float().reshape(*lead, LATENT_TILES, LATENT_TILE)
    scale = (tiles.abs().amax(dim=-1) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (tiles / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(*lead, KV_LORA_RANK)
    out = torch.empty(*lead, LATENT_ENTRY_BYTES, dtype=torch.uint8, device=nope.device)
    out[..., :KV_LORA_RANK] = q.view(torch.uint8)
    out[..., KV_LORA_RANK:KV_LORA_RANK + 16] = scale.contiguous().view(torch.uint8).reshape(*lead, 16)
    out[..., KV_LORA_RANK + 16:] = rope.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(*lead, 2 * ROPE_DIM)
    return out


def unpack_latent(entries: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantise V32 entries [..., 656] uint8 to [..., 576] = (nope * tile scale, rope)."""
    if entries.dtype != torch.uint8 or entries.shape[-1] != LATENT_ENTRY_BYTES:
        raise ValueError(f"unpack_latent wants uint8 [..., {LATENT_ENTRY_BYTES}], got {entries.dtype} "
                         f"{tuple(entries.shape)}")
    lead = entries.shape[:-1]
    flat = entries.reshape(-1, LATENT_ENTRY_BYTES)
    nope = flat[:, :KV_LORA_RANK].contiguous().view(FP8).to(dtype)
    scale = flat[:, KV_LORA_RANK:KV_LORA_RANK + 16].contiguous().view(torch.float32).to(dtype)
    rope = flat[:, KV_LORA_RANK + 16:].contiguous().view(torch.bfloat16).to(dtype)
    nope = (nope.reshape(-1, LATENT_TILES, LATENT_TILE) * scale.unsqueeze(-1)).reshape(-1, KV_LORA_RANK)
    return torch.cat([nope, rope], dim=-1).reshape(*lead, QK_HEAD_DIM)


def pack_indexer_key(key: torch.Tensor) -> torch.Tensor:
    """Quantise indexer keys [..., 128] float to [..., 132] uint8 (fp8 values, then an fp32 scale)."""
    if key.shape[-1] != INDEX_HEAD_DIM:
        raise ValueError(f"pack_indexer_key wants [..., {INDEX_HEAD_DIM}], got {tuple(key.shape)}")
    lead = key.shape[:-1]
    k = key.float()
    scale = (k.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (k / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch.empty(*lead, INDEXER_ENTRY_BYTES, dtype=torch.uint8, device=key.device)
    out[..., :INDEX_HEAD_DIM] = q.view(torch.uint8)
    out[..., INDEX_HEAD_DIM:] = scale.contiguous().view(torch.uint8).reshape(*lead, 4)
    return out


def unpack_indexer_key(entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split indexer entries [..., 132] uint8 into fp8-valued keys as float32 [..., 128] and scales [...]."""
    if entries.dtype != torch.uint8 or entries.shape[-1] != INDEXER_ENTRY_BYTES:
        raise ValueError(f"unpack_indexer_key wants uint8 [..., {INDEXER_ENTRY_BYTES}], got {entries.dtype} "
                         f"{tuple(entries.shape)}")
    lead = entries.shape[:-1]
    flat = entries.reshape(-1, INDEXER_ENTRY_BYTES)
    keys = flat[:, :INDEX_HEAD_DIM].contiguous().view(FP8).float().reshape(*lead, INDEX_HEAD_DIM)
    scale = flat[:, INDEX_HEAD_DIM:].contiguous().view(torch.float32).reshape(lead)
    return keys, scale
