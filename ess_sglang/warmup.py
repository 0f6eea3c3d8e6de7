"""LRU warm-up: which positions of a request to load into a layer's hot pool before its first decode step.

A request whose whole prompt fits its slot budget loads all of it (decode can then select nothing that misses).
Otherwise the preferred source is the top-k sets of the prefill's last query windows (DeepSeek's indexer ran them
anyway): their union is what decode is about to select. When it is larger than the budget, positions chosen by more
windows come first, then the more recent ones. Without such sets, the most recent positions fill the budget.
"""

from __future__ import annotations

import torch


def warmup_positions(seq_len: int, budget: int, window_topk: torch.Tensor | None = None) -> torch.Tensor:
    """Positions (int64, CPU, at most `budget`, each < seq_len) to load for one request and one layer.

    window_topk: [windows, k] positions selected by the prefill's last query windows (-1 padding), or None.
    """
    if budget <= 0 or seq_len <= 0:
        return torch.empty(0, dtype=torch.int64)
    if seq_len <= budget:
        return torch.arange(seq_len, dtype=torch.int64)
    if window_topk is None or window_topk.numel() == 0:
        return torch.arange(max(seq_len - budget, 0), seq_len, dtype=torch.int64)
    pos = window_topk.reshape(-1).long().cpu()
    pos = pos[(pos >= 0) & (pos < seq_len)]
    if pos.numel() == 0:
        return torch.arange(max(seq_len - budget, 0), seq_len, dtype=torch.int64)
    uniq, votes = torch.unique(pos, return_counts=True)
    if uniq.numel() <= budget:
        return uniq
    # most votes first, then the most recent position: sort by (votes, position) descending
    key = votes * (seq_len + 1) + uniq
    return uniq[torch.argsort(key, descending=True)[:budget]].sort().values
