"""FlashTrans kernel against its torch reference, in Triton's CPU interpreter at small sizes."""

import pytest
import torch
from ess_sglang.kernels.flashtrans import copy_rows, copy_rows_reference, copy_rows_triton, power_of_two_chunks
from hypothesis import given, settings
from hypothesis import strategies as st


def _case(n_src, n_dst, n, row_bytes, seed, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (n_src, row_bytes), dtype=torch.uint8, generator=g)
    dst = torch.randint(0, 256, (n_dst, row_bytes), dtype=torch.uint8, generator=g)
    src_rows = torch.randint(-1, n_src, (n,), generator=g).to(dtype)
    dst_rows = torch.randperm(n_dst, generator=g)[:n].to(dtype)
    dst_rows[torch.rand(n, generator=g) < 0.2] = -1
    return src, dst, src_rows, dst_rows


@pytest.mark.parametrize("variant,rows_per_program", [("chunks", 8), ("chunks", 2), ("masked", 8), ("flat", 8),
                                                      ("flat", 1)])
@pytest.mark.parametrize("row_bytes", [656, 132, 4])
@pytest.mark.parametrize("n", [1, 7, 8, 37])
def test_kernel_matches_reference(row_bytes, n, variant, rows_per_program):
    src, dst, sr, dr = _case(64, 48, n, row_bytes, seed=n + row_bytes)
    want = dst.clone()
    copy_rows_reference(src, want, sr, dr)
    got = dst.clone()
    copy_rows_triton(src, got, sr, dr, rows_per_program=rows_per_program, variant=variant)
    assert torch.equal(got, want)
    untouched = torch.ones(dst.shape[0], dtype=torch.bool)
    untouched[dr[(dr >= 0) & (sr >= 0)]] = False
    assert torch.equal(got[untouched], dst[untouched]), "a row outside the list was written"


@settings(max_examples=15, deadline=None)
@given(n=st.integers(0, 40), seed=st.integers(0, 10_000), int32=st.booleans())
def test_kernel_matches_reference_random(n, seed, int32):
    src, dst, sr, dr = _case(50, 60, n, 656, seed, torch.int32 if int32 else torch.int64)
    want, got = dst.clone(), dst.clone()
    copy_rows_reference(src, want, sr, dr)
    copy_rows(src, got, sr, dr, impl="triton")
    assert torch.equal(got, want)


@pytest.mark.parametrize("variant", ["chunks", "masked", "flat"])
def test_kernel_handles_padded_row_strides(variant):
    g = torch.Generator().manual_seed(1)
    src_pad = torch.randint(0, 256, (40, 768), dtype=torch.uint8, generator=g)  # 656-B entries at a 768-B stride
    dst = torch.zeros(30, 656, dtype=torch.uint8)
    sr, dr = torch.randint(-1, 40, (25,), generator=g), torch.randperm(30, generator=g)[:25]
    want, got = dst.clone(), dst.clone()
    copy_rows_reference(src_pad[:, :656], want, sr, dr)
    copy_rows_triton(src_pad[:, :656], got, sr, dr, variant=variant)
    assert torch.equal(got, want)
    back = src_pad.clone()
    copy_rows_triton(got, back[:, :656], dr, sr.clamp(min=0), variant=variant)
    assert torch.equal(back[:, 656:], src_pad[:, 656:]), "padding bytes were written"


def test_power_of_two_chunks():
    assert power_of_two_chunks(164) == (128, 32, 4, 0)  # a 656-B latent entry
    assert power_of_two_chunks(33) == (32, 1, 0, 0)  # a 132-B indexer entry
    assert power_of_two_chunks(64) == (64, 0, 0, 0)
    with pytest.raises(ValueError, match="power-of-two chunks"):
        power_of_two_chunks(31)


def test_bad_arguments():
    src, dst, sr, dr = _case(8, 8, 4, 656, 0)
    with pytest.raises(ValueError, match="equal row size"):
        copy_rows(src, dst[:, :132], sr, dr)
    with pytest.raises(ValueError, match="one length"):
        copy_rows(src, dst, sr, dr[:3])
    with pytest.raises(ValueError, match="impl"):
        copy_rows(src, dst, sr, dr, impl="cuda")


def test_counted_kernel_refuses_rows_that_are_not_a_power_of_two():
    from ess_sglang.kernels.flashtrans import copy_rows_counted

    src, dst, sr, dr = _case(64, 48, 37, 656, seed=0)
    for bad in (0, 3, 12):
        with pytest.raises(ValueError, match=f"rows_per_program a power of two, got {bad}"):
            copy_rows_counted(src, dst, sr, dr, torch.tensor([5]), programs=2, rows_per_program=bad)


@pytest.mark.parametrize("programs,rows", [(1, 8), (3, 4), (16, 2), (2, 16)])
@pytest.mark.parametrize("count", [0, 5, 37, 100])
def test_counted_kernel_copies_the_first_count_rows(programs, rows, count):
    from ess_sglang.kernels.flashtrans import copy_rows_counted

    src, dst, sr, dr = _case(64, 48, 37, 656, seed=count + programs)
    want = dst.clone()
    copy_rows_reference(src, want, sr[:count], dr[:count])
    got = dst.clone()
    copy_rows_counted(src, got, sr, dr, torch.tensor([count]), programs=programs, rows_per_program=rows)
    assert torch.equal(got, want)
