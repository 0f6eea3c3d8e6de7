"""The request table: for each request row, the KV location of each of its token positions.

This is the engine-agnostic twin of SGLang's ``ReqToTokenPool.req_to_token``: int32 [rows, max_context], -1 where a
position holds nothing. The cache manager only reads it; the demo and the tests fill it.
"""

from __future__ import annotations

import torch


class RequestTableFullError(RuntimeError):
    """No free request row."""


class RequestTable:
    def __init__(self, max_requests: int, max_context: int, device: torch.device | str = "cpu"):
        if max_requests <= 0 or max_context <= 0:
            raise ValueError(f"RequestTable needs positive sizes, got {max_requests} rows x {max_context} positions")
        self.req_to_token = torch.full((max_requests, max_context), -1, dtype=torch.int32, device=device)
        self.max_context = max_context
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise RequestTableFullError(f"all {self.req_to_token.shape[0]} request rows are in use")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        if row in self._free_rows or not 0 <= row < self.req_to_token.shape[0]:
            raise ValueError(f"free_row: row {row} is not in use")
        self.req_to_token[row] = -1
        self._free_rows.append(row)

    def set(self, row: int, start: int, locs: torch.Tensor) -> None:
        """Positions [start, start + len(locs)) of request `row` live at `locs`."""
        end = start + locs.numel()
        if end > self.max_context:
            raise ValueError(f"request row {row}: position {end - 1} is past max_context {self.max_context}")
        self.req_to_token[row, start:end] = locs.to(self.req_to_token.device, torch.int32)
