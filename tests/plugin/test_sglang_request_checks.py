"""Token ids outside the vocabulary are refused in SGLang's per-request validation on an ESS instance (SGLang itself
does not check them: request_checks.py), with an error that names the first one; valid ids pass untouched."""

from __future__ import annotations

import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ess_sglang.sglang_plugin import hooks, request_checks
from ess_sglang.sglang_plugin.compat import check_targets

VOCAB = 1000


@given(st.lists(st.integers(-5, VOCAB + 5), min_size=1, max_size=50))
def test_out_of_vocab_names_the_first_bad_id(ids):
    why = request_checks.out_of_vocab(ids, VOCAB)
    bad = [i for i, t in enumerate(ids) if not 0 <= t < VOCAB]
    if not bad:
        assert why is None
    else:
        assert why == (f"input_ids[{bad[0]}] = {ids[bad[0]]} is outside the model's vocabulary [0, {VOCAB}) "
                       f"({len(bad)} of {len(ids)} ids)")


def test_the_hook_raises_what_sglang_answers_with_a_400():
    manager = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=VOCAB))
    assert request_checks.validate_one_request_hook(manager, object(), [1, 2, 999]) is None
    assert request_checks.validate_one_request_hook(manager, object(), []) is None  # SGLang refuses it itself
    assert request_checks.validate_one_request_hook(manager, object(), None) is None  # text: tokenized in-vocab
    with pytest.raises(ValueError, match=r"input_ids\[2\] = 1000 is outside the model's vocabulary \[0, 1000\)"):
        request_checks.validate_one_request_hook(manager, object(), [1, 2, 1000, -1])


def test_the_hook_target_exists_in_the_installed_sglang():
    pytest.importorskip("sglang")
    spec = next(h for h in hooks.RUNTIME_HOOKS if h.hook is request_checks.validate_one_request_hook)
    assert check_targets([spec]) == []
