"""Requests an ESS server refuses before they reach the model: token ids outside the vocabulary.

SGLang (0.5.17 and 0.5.23) does not check a request's ``input_ids`` against the vocabulary: 0.5.17 defines
``TokenizerManager._validate_input_ids_in_vocab`` but never calls it, 0.5.23 has no such check. An id outside
[0, vocab_size) reaches the embedding lookup, where on a GPU it is a device-side assertion that takes the scheduler
down with every request it holds. On an ESS instance the plugin checks the ids in SGLang's own per-request validation
(BEFORE ``TokenizerManager._validate_one_request``), so that such a request gets SGLang's error answer (HTTP 400, or
an error chunk when streamed) naming the first bad id, as a prompt longer than the context does.
"""

from __future__ import annotations


def out_of_vocab(input_ids, vocab_size: int) -> str | None:
    """Why `input_ids` (a list of ints) cannot be served by a model of `vocab_size` tokens, or None."""
    if not input_ids or not isinstance(input_ids, list) or not isinstance(input_ids[0], int):
        return None  # empty (SGLang refuses it), or a form SGLang validates itself
    if min(input_ids) >= 0 and max(input_ids) < vocab_size:
        return None
    i, bad = next((i, t) for i, t in enumerate(input_ids) if not 0 <= t < vocab_size)
    n = sum(1 for t in input_ids if not 0 <= t < vocab_size)
    return f"input_ids[{i}] = {bad} is outside the model's vocabulary [0, {vocab_size}) ({n} of {len(input_ids)} ids)"


def validate_one_request_hook(manager, obj, input_ids, *args, **kwargs):
    """BEFORE TokenizerManager._validate_one_request(obj, input_ids): refuse ids outside the vocabulary."""
    vocab = getattr(getattr(manager, "model_config", None), "vocab_size", None)
    if vocab is not None:
        why = out_of_vocab(input_ids, int(vocab))
        if why is not None:
            raise ValueError(why)
    return None
