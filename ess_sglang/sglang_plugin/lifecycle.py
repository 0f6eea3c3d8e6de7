"""A request's life in ESS, as SGLang's scheduler drives it: admitted prompts holding device slots until staged, the
colocated staging to host memory (copy, free, warm-up) and the PD decode instance's direct admission, the queue of
staged requests SGLang's next decode batch collects, and the release of a finished, aborted or retracted request.

``RequestLifecycle`` is a part of ``EssCoordinator`` (coordinator.py), which SGLang holds where HiSparse's coordinator
would be and calls by HiSparse's method names; it reads the coordinator's pools, cache manager, window capture,
overlap and admission, which the coordinator builds at start-up (``_init_requests`` itself reads none of them).
Nothing here runs inside a decode step.
"""

from __future__ import annotations

from typing import Any

import torch

from ess_sglang.sglang_plugin import compat


class RequestLifecycle:
    """Staging, warm-up and release of requests (see the module docstring): the request-lifecycle part of the
    ESS coordinator."""

    def _init_requests(self) -> None:
        """No request held: at start-up, and when SGLang clears the allocator."""
        self._staging: dict[str, int] = {}  # rid -> prompt slots held in the device pool until staged to host
        self._ready: list = []  # staged requests for SGLang's next decode batch
        self._rids: dict[int, str] = {}  # request row -> rid, from staging (or PD admission) to release

    # ------------------------------------------------------------------------------------------ admission
    def staging_free(self) -> int:
        """Device slots left for prompts awaiting staging (colocated prefill)."""
        return self.staging_capacity - sum(self._staging.values())

    def hold_staging(self, rid: str, prompt_tokens: int) -> None:
        """An admitted prompt will occupy device slots until it is staged to host memory."""
        self._staging[rid] = -(-int(prompt_tokens) // self.page_size) * self.page_size

    def admit_request_into_staging(self, req: Any) -> None:
        """Colocated: the prefill's result is processed (SGLang calls this for each request that goes on to decode).
        Its prompt is copied to host memory on the current stream, behind the prefill that wrote it, its device slots
        go back to SGLang's allocator, its warm-up is loaded, and it waits for SGLang's next decode batch
        (`collect_ready_reqs`), as SGLang's HiSparse stages a request."""
        from ess_sglang.kernels.flashtrans import copy_rows

        row, n = compat.req_row(req), compat.req_extend_end(req)
        logical = self.req_to_token_pool.req_to_token[row, :n].to(dtype=torch.int64, device=self.device)
        physical = self.mem_pool_device.translate_loc_from_full_to_hisparse_device(logical).long()
        host = self.mem_pool_host.alloc_paged_token_slots(self.req_to_host_pool, self.req_to_host_pool_allocated_len,
                                                          row, 0, n).long()
        for layer in range(self.num_layers):
            copy_rows(self.device_kv[layer], self.host.layer(layer), physical, host, self.manager.copy_impl)
        self.token_to_kv_pool_allocator.free_hisparse(logical)
        self._staging.pop(req.rid, None)
        self._rids[row] = req.rid
        locs = self._warm_up_locations(row, n, self.capture.take(row, seq_len=n) if self.capture is not None else None)
        if locs is not None:
            self._after_inflight_decode()
            self._load_warm_up(locs)
        req.hisparse_staging = True
        self._ready.append(req)

    def admit_request_direct(self, req: Any) -> None:
        """PD decode: the KV arrived from the prefill instance straight into the host pool; warm up from the window
        sets the prefill sent (``req.ess_warmup_ranked``, see pd_windows), else the most recent tokens."""
        row = compat.req_row(req)
        n = compat.req_allocated_len(req)
        ranked = getattr(req, "ess_warmup_ranked", None)
        windows = getattr(req, "ess_window_topk", None)
        locs = self._warm_up_locations(row, n, list(windows) if windows is not None and ranked is None else None,
                                       ranked=ranked)
        if locs is not None:
            self._after_inflight_decode()
            self._load_warm_up(locs)
        for attr in ("ess_warmup_ranked", "ess_window_topk"):  # 1 MB per request: not kept while it decodes
            if getattr(req, attr, None) is not None:
                setattr(req, attr, None)
        self._rids[row] = req.rid
        req.hisparse_staging = False

    def holds_row(self, row: int) -> bool:
        """The request row is staged (its prompt has host slots) and decoding or about to."""
        return row in self._rids

    def collect_ready_reqs(self) -> list:
        """The staged requests for SGLang's next decode batch."""
        ready, self._ready = self._ready, []
        for req in ready:
            req.hisparse_staging = False
        return ready

    def has_ongoing_staging(self) -> bool:
        return bool(self._ready)

    def warmup_budget(self, seq_len: int) -> int:
        """Hot slots per layer a new request warms up (its share of the hot pool), at most its length."""
        return min(int(seq_len), self.hot_slots_per_layer // max(1, self.max_running_requests))

    def _warm_up_locations(self, row: int, seq_len: int, windows: list | None,
                           ranked: torch.Tensor | None = None) -> torch.Tensor | None:
        """A new request's warm-up, per layer the host locations to load ([layers, width] on the device, -1 padding),
        or None: from the query windows' top-k sets (`windows`, per layer [windows, k], ranked here for all layers in
        one pass; or `ranked`, per layer the union in priority order, as the PD prefill sends it), else the most recent
        tokens. Host work only (it synchronises with the current stream, never with a decode step)."""
        from ess_sglang.sglang_plugin.warmup import rank_window_sets, ranked_warmup_positions

        if self.config.warmup_windows <= 0 or seq_len <= 0:
            return None
        budget = self.warmup_budget(seq_len)
        if ranked is None and windows is not None:
            ranked = rank_window_sets(windows, seq_len, budget)[0]
        ranked_layers = 0 if ranked is None else min(ranked.shape[0], self.num_layers)
        recent = ranked_warmup_positions(seq_len, budget, None) if ranked_layers < self.num_layers else None
        per_layer = [ranked_warmup_positions(seq_len, budget, ranked[layer]) if layer < ranked_layers else recent
                     for layer in range(self.num_layers)]
        width = max(p.numel() for p in per_layer)
        if width == 0:
            return None
        positions = torch.full((self.num_layers, width), -1, dtype=torch.int64)
        for layer, p in enumerate(per_layer):
            positions[layer, :p.numel()] = p
        positions = positions.to(self.device)
        table = self.req_to_host_pool[row]
        return torch.where(positions >= 0, table[positions.clamp(min=0)], -1)

    def _load_warm_up(self, locs: torch.Tensor) -> None:
        """Load warm-up locations ([layers, width], -1 skipped) into the hot pools (after `_after_inflight_decode`)."""
        for layer in range(self.num_layers):
            for start in range(0, locs.shape[1], self.max_selected):  # never grow the manager's scratch
                self.manager.warm_up(layer, locs[layer, start:start + self.max_selected])

    # ------------------------------------------------------------------------------------------ release
    def _after_inflight_decode(self) -> None:
        """Order what follows after the decode step the overlap scheduler may still be running: the hot pools are
        shared by all requests, so warm-up and release must not run beside a step's swap-in and attention."""
        if self.decode_producer_stream is not None and self.device.type == "cuda":
            torch.cuda.current_stream().wait_stream(self.decode_producer_stream)

    def request_finished(self, req: Any) -> None:
        """Finished or aborted: forget its hot entries, free its host slots and its admission reservation."""
        self._after_inflight_decode()
        row = compat.req_row(req)
        host = self.mem_pool_host.allocated_host_indices(self.req_to_host_pool, row,
                                                         self.req_to_host_pool_allocated_len[row])
        if host.numel() > 0:
            self.manager.release(host)
            if self.config.scrub_on_free:  # on the stream, after every step that could still read them
                rows = host.to(self.device, torch.int64)
                for layer in range(self.num_layers):
                    self.host.layer(layer).index_fill_(0, rows, 0)
            self.mem_pool_host.free(host)
        self.req_to_host_pool[row] = -1
        self.req_to_host_pool_allocated_len[row] = 0
        if self._rids.pop(row, None) is not None:
            # Decoding started: its locations map to the new-token slot (or to nothing); unmap them so that SGLang's
            # release_kv_cache frees only logical locations. A request still in prefill keeps its device slots
            # mapped: release_kv_cache frees them.
            locs = self.req_to_token_pool.req_to_token[row, : compat.req_allocated_len(req)].long()
            self.token_to_kv_pool_allocator.full_to_hisparse_device_index_mapping[locs] = 0
        if self.capture is not None:
            self.capture.drop(row)
        self.overlap.forget_rows([row])
        self._staging.pop(req.rid, None)
        self._ready = [r for r in self._ready if r is not req]
        self.admission.release(req.rid)
        req.hisparse_staging = False

    def retract_req(self, req: Any) -> None:
        self.request_finished(req)

    def abort_staging_request(self, req: Any) -> None:
        self.request_finished(req)
