import pytest
import torch

from ess_sglang.formats import (
    INDEXER_ENTRY_BYTES,
    LATENT_ENTRY_BYTES,
    pack_indexer_key,
    pack_latent,
    unpack_indexer_key,
    unpack_latent,
)


def test_latent_layout_and_round_trip():
    g = torch.Generator().manual_seed(0)
    nope, rope = torch.randn(5, 512, generator=g), torch.randn(5, 64, generator=g)
    e = pack_latent(nope, rope)
    assert e.shape == (5, LATENT_ENTRY_BYTES) and e.dtype == torch.uint8
    assert (LATENT_ENTRY_BYTES, INDEXER_ENTRY_BYTES) == (656, 132)  # FlashMLA V32 and the indexer's K (design brief)
    scales = e[:, 512:528].contiguous().view(torch.float32)
    assert torch.allclose(scales, nope.view(5, 4, 128).abs().amax(-1) / 448.0)
    assert torch.equal(e[:, 528:].contiguous().view(torch.bfloat16), rope.to(torch.bfloat16))
    back = unpack_latent(e)
    assert back.shape == (5, 576)
    rel = (back[:, :512] - nope).norm() / nope.norm()
    assert rel < 0.05  # fp8 e4m3 has 3 mantissa bits
    assert torch.equal(back[:, 512:], rope.to(torch.bfloat16).float())


def test_indexer_round_trip():
    k = torch.randn(3, 7, 128)
    e = pack_indexer_key(k)
    assert e.shape == (3, 7, INDEXER_ENTRY_BYTES)
    keys, scale = unpack_indexer_key(e)
    assert ((keys * scale.unsqueeze(-1) - k).norm() / k.norm()) < 0.05


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="pack_latent"):
        pack_latent(torch.zeros(2, 511), torch.zeros(2, 64))
    with pytest.raises(ValueError, match="unpack_latent"):
        unpack_latent(torch.zeros(2, 655, dtype=torch.uint8))
