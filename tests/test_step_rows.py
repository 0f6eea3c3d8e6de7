"""kernels/step_rows.py: the decode step's per-request rows in one launch (Triton, interpreted on CPU) against its
torch definition, bit for bit, over batches with padding rows, empty requests and rows or positions outside the
host table (never read)."""

from __future__ import annotations

import pytest
import torch
from ess_sglang.kernels.step_rows import FIELDS, step_rows_torch, step_rows_triton
from hypothesis import given, settings
from hypothesis import strategies as st


def _table(rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 1 << 40, (rows, width), generator=g, dtype=torch.int64)


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 40), real=st.integers(0, 40), rows=st.integers(1, 9), width=st.integers(1, 70),
       seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.int64, torch.int32]))
def test_kernel_matches_definition(batch, real, rows, width, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    table = _table(rows, width, seed)
    rpi = torch.randint(-1, rows + 2, (batch,), generator=g).to(dtype)  # -1 and rows past the table: not read
    lens = torch.randint(0, width + 3, (batch,), generator=g).to(dtype)  # 0: not live; past the width: not read
    num_real = torch.tensor([real], dtype=torch.int32)
    want = step_rows_torch(rpi, lens, num_real, table, 5000)
    got = step_rows_triton(rpi, lens, num_real, table, 5000)
    assert got.dtype == torch.int64 and got.shape == (len(FIELDS), batch)
    assert torch.equal(got, want)


def test_rows_say_what_the_module_says():
    table = torch.arange(4 * 8, dtype=torch.int64).view(4, 8) + 100
    rpi = torch.tensor([2, 1, 0, 3])
    lens = torch.tensor([5, 0, 1, 8])
    rows = dict(zip(FIELDS, step_rows_torch(rpi, lens, torch.tensor([3], dtype=torch.int32), table, 1000),
                    strict=True))
    assert rows["live_rpi"].tolist() == [2, -1, 0, -1]  # entry 1 is empty, entry 3 is padding (past num_real)
    assert rows["visible_lens"].tolist() == [5, 0, 1, 0]
    assert rows["new_host_loc"].tolist() == [table[2, 4].item(), -1, table[0, 0].item(), -1]
    assert rows["new_token_rows"].tolist() == [1002, 1001, 1000, 1003]


@pytest.mark.parametrize("bad", ["shape", "count", "table"])
def test_bad_input_is_refused_with_one_line(bad):
    rpi, lens, real, table = torch.zeros(3, dtype=torch.int64), torch.ones(3), torch.ones(1), _table(2, 4, 0)
    if bad == "shape":
        lens = torch.ones(4)
    elif bad == "count":
        real = torch.ones(2)
    else:
        table = table.to(torch.int32)
    for fn in (step_rows_torch, step_rows_triton):
        with pytest.raises(ValueError, match="step rows: "):
            fn(rpi, lens, real, table, 0)
