"""Sizes of the two per-token, per-layer cache entries of a DeepSeek Sparse Attention model, without torch.

The one definition the whole project reads (``formats.py`` packs entries of exactly these sizes; capacity planning,
the simulator and trace replays import them here so that they stay free of torch):

* latent entry, FlashMLA "V32" FP8: 512 fp8 no-rope values (kv_lora_rank), one fp32 scale per tile of 128 of them,
  then 64 bf16 rope values: 656 bytes;
* indexer K entry: 128 fp8 values (index_head_dim), then one fp32 scale: 132 bytes.
"""

KV_LORA_RANK = 512
ROPE_DIM = 64
LATENT_TILE = 128
LATENT_TILES = KV_LORA_RANK // LATENT_TILE
LATENT_ENTRY_BYTES = KV_LORA_RANK + 4 * LATENT_TILES + 2 * ROPE_DIM  # 656

INDEX_HEAD_DIM = 128
INDEXER_ENTRY_BYTES = INDEX_HEAD_DIM + 4  # 132
