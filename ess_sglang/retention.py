"""Offline replays of hot-pool retention policies over a top-k trace: which entries a per-layer pool keeps.

ESS's runtime pool is least-recently-used (`HotPoolCacheManager`, replayed exactly by `traces.replay_ess`). This
module replays the same trace through other retention rules at the same pool size, in plain numpy and without
moving bytes, to decide by measurement whether a rule is worth building into the resolve kernels:

* ``lru``          least recently selected first; the decoded token is not kept (ESS's ``new_tokens: on_demand``)
* ``lru_newest``   the same, and each decoded token enters the pool when it is computed (``new_tokens: insert``)
* ``lru2``         LRU-2 with the newest token: evict by the second-to-last selection (entries selected once go
                   first, oldest first), ties by the last
* ``decay``        decayed selection count with the newest token: each selection adds 1, every step multiplies by
                   ``gamma`` (1/(1-gamma) steps of memory); the lowest count goes first, ties by the last selection
* ``belady``       the offline optimum (MIN): evict what is selected again farthest in the future; a decoded token
                   enters only when it is needed sooner than some resident entry. The ceiling no online rule reaches.

Every policy sees the same trace with the same model of a step as `replay_ess`: per layer one pool of `slots`
entries shared by all requests, warmed up from the same positions (`warmup.warmup_positions`, each request's share),
the step's decoded token written before the layer's selection is resolved, every selected entry resident after the
resolve (a miss is fetched, evicting what the rule chooses; the step's own selection and new tokens are never
evicted). Hits and misses are counted per selected entry, as the runtime's counters are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ess_sglang.traces import ReplayStats, TopKTrace

POLICIES = ("lru", "lru_newest", "lru2", "decay", "belady")
DEFAULT_DECAY_GAMMA = 0.75  # EssConfig.decay_gamma's default
_NEVER = np.iinfo(np.int64).max


@dataclass
class _Layer:
    """One layer's pool over dense entry ids (request b, position p) -> b * width + p."""

    resident: np.ndarray  # bool [ids]
    last: np.ndarray  # int64 [ids]: step of the last selection (or insertion), -1 before any
    prev: np.ndarray  # int64 [ids]: step of the selection before the last (LRU-2), -1 before any
    score: np.ndarray  # float64 [ids]: decayed selection count as of step `seen`
    seen: np.ndarray  # int64 [ids]: the step `score` was last brought up to


def replay_policy(trace: TopKTrace, slots_per_layer: int, policy: str, warmup: str = "auto",
                  gamma: float = DEFAULT_DECAY_GAMMA) -> ReplayStats:
    """Replay `trace` through one retention `policy` (POLICIES) with `slots_per_layer` slots per layer.

    warmup: "windows" (the prefill's last query windows' union, as ESS warms up), "recent", "none", or "auto"
    (windows when the trace has them). Raises ValueError when a step's selection and new tokens do not fit the pool.
    """
    import torch

    from ess_sglang.warmup import warmup_positions

    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not 0.0 < gamma < 1.0:
        raise ValueError(f"gamma must be in (0, 1), got {gamma!r}")
    if warmup == "auto":
        warmup = "windows" if trace.warmup_topk is not None else "recent"
    if warmup not in ("windows", "recent", "none"):
        raise ValueError(f"warmup must be 'auto', 'windows', 'recent' or 'none', got {warmup!r}")
    trace.validate()
    S, L, B, K = trace.topk.shape
    width = int(trace.seq_lens.max()) + 1
    n_ids = B * width
    prompts = [int(p) for p in trace.prompt_lens]
    base = (np.arange(B, dtype=np.int64) * width)[:, None]
    budget = slots_per_layer // B
    lookups = np.zeros(L, np.int64)
    misses = np.zeros(L, np.int64)
    warmed = np.zeros(L, np.int64)
    newest = policy != "lru"
    for layer in range(L):
        st = _Layer(np.zeros(n_ids, bool), np.full(n_ids, -1, np.int64), np.full(n_ids, -1, np.int64),
                    np.zeros(n_ids), np.zeros(n_ids, np.int64))
        if warmup != "none":
            for b, p in enumerate(prompts):
                win = torch.from_numpy(trace.warmup_topk[layer, b]) if warmup == "windows" else None
                pos = warmup_positions(p, budget, win).numpy().astype(np.int64)
                st.resident[b * width + pos] = True
            warmed[layer] = int(st.resident.sum())
        sel = [(trace.topk[s, layer].astype(np.int64) + base) for s in range(S)]
        sel = [np.unique(x[trace.topk[s, layer] >= 0]) for s, x in enumerate(sel)]
        new = [np.arange(B, dtype=np.int64) * width + trace.seq_lens[s].astype(np.int64) - 1 for s in range(S)]
        next_use = _next_use(sel, n_ids) if policy == "belady" else None
        for s in range(S):
            need = sel[s]
            lookups[layer] += int((trace.topk[s, layer] >= 0).sum())
            keep = np.zeros(n_ids, bool)  # this step's selection and new tokens: never evicted in this step
            keep[need] = True
            if newest:  # written before the layer's selection is resolved (Belady: only those it selects now)
                now = new[s] if policy != "belady" else new[s][keep[new[s]]]
                keep[now] = True
                _admit(st, now[~st.resident[now]], keep, slots_per_layer, policy, s, gamma, next_use,
                       optional=False)
            miss = need[~st.resident[need]]
            misses[layer] += miss.size
            _admit(st, miss, keep, slots_per_layer, policy, s, gamma, next_use, optional=False)
            if policy == "belady":  # then a decoded token enters where it is needed sooner than some resident entry
                fresh = new[s][~st.resident[new[s]]]
                fresh = fresh[next_use[s][fresh] < _NEVER]
                _admit(st, fresh, keep, slots_per_layer, policy, s, gamma, next_use, optional=True)
            _touch(st, need, s, gamma)
            if newest:
                _touch(st, new[s][st.resident[new[s]] & ~np.isin(new[s], need)], s, gamma)
    return ReplayStats(policy=policy, lookups=lookups, misses=misses, warmup_entries=warmed,
                       slots_per_layer=slots_per_layer, extra=dict(warmup=warmup, gamma=gamma if policy == "decay"
                                                                   else None))


def _next_use(sel: list[np.ndarray], n_ids: int) -> list[np.ndarray]:
    """Per step s: for every id, the first step after s that selects it (_NEVER: none)."""
    out = [None] * len(sel)
    nxt = np.full(n_ids, _NEVER, np.int64)
    for s in range(len(sel) - 1, -1, -1):
        out[s] = nxt.copy()
        nxt[sel[s]] = s
    return out


def _touch(st: _Layer, ids: np.ndarray, step: int, gamma: float) -> None:
    """A selection (or insertion) at `step`."""
    st.score[ids] = st.score[ids] * gamma ** (step - st.seen[ids]) + 1.0
    st.seen[ids] = step
    fresh = st.last[ids] != step
    st.prev[ids[fresh]] = st.last[ids[fresh]]
    st.last[ids] = step


def _admit(st: _Layer, ids: np.ndarray, keep: np.ndarray, slots: int, policy: str, step: int, gamma: float,
           next_use, optional: bool) -> None:
    """Make `ids` resident, evicting by `policy` what the pool cannot hold. `optional` (Belady's decoded tokens):
    admit an id only where it is needed sooner than the entry it would evict."""
    if ids.size == 0:
        return
    free = slots - int(st.resident.sum())
    over = ids.size - free
    if over > 0:
        cand = np.flatnonzero(st.resident & ~keep)
        if policy == "belady":
            nu = next_use[step]
            order = cand[np.argsort(-nu[cand], kind="stable")]  # farthest next selection first
            if optional:  # admit the soonest-needed ids while each beats the farthest entry left to evict
                ids = ids[np.argsort(nu[ids], kind="stable")]
                n_free = max(free, 0)
                extra = ids[n_free:]
                m = min(extra.size, order.size)
                take = n_free + int(np.cumprod(nu[extra[:m]] < nu[order[:m]]).sum())
                ids = ids[:take]
                over = ids.size - free
                if over <= 0:
                    st.resident[ids] = True
                    return
        else:
            order = cand[np.lexsort(_priority(st, cand, policy, step, gamma))]
        if order.size < over:
            raise ValueError(f"replay_policy: the pool ({slots:,} slots) cannot hold one step's selection and new "
                             f"tokens; give it more slots")
        st.resident[order[:over]] = False
    st.resident[ids] = True


def _priority(st: _Layer, cand: np.ndarray, policy: str, step: int, gamma: float) -> tuple[np.ndarray, ...]:
    """np.lexsort keys (last key first in importance) of eviction order: the first evicted sorts first."""
    if policy in ("lru", "lru_newest"):
        return (cand, st.last[cand])
    if policy == "lru2":
        return (cand, st.last[cand], st.prev[cand])
    return (cand, st.last[cand], st.score[cand] * gamma ** (step - st.seen[cand]))
