"""The ESS coordinator: what SGLang's model runner and scheduler call where HiSparse's coordinator would be.

SGLang 0.5.23 calls ``model_runner.hisparse_coordinator`` from the DSA attention backend, the scheduler, the PD
decode queues and the CUDA graph runners. ``maybe_init_hisparse_coordinator_hook`` builds an ``EssCoordinator`` in
its place when ESS is enabled. It reuses HiSparse's plumbing:

* the logical allocator (``HiSparseTokenToKVPoolAllocator``): logical KV locations with a GPU indexer entry each,
  and physical slots of the device latent pool (``HiSparseDSATokenToKVPool``, what FlashMLA reads);
* the pinned host pool class (``MLATokenToKVPoolHost``, layer-first, 656-byte rows) and the per-request table of
  host slots ``req_to_host_pool`` that SGLang's PD decode path fills and transfers into directly (RDMA to DRAM);
* the decode seam ``swap_in_selected_pages(req_pool_indices, seq_lens, top_k_result, layer_id)``.

and owns the rest: one hot pool per layer, a contiguous region of the device pool reserved at start-up and managed
by ``HotPoolCacheManager`` (LRU across all requests, GPU-resident maps, CUDA-graph safe), the write-back of each
decoded token, admission and metrics; a request's staging, warm-up and release are ``RequestLifecycle``'s
(lifecycle.py), the views of SGLang's pools are in pools.py.

The decode seam, as ``DeepseekSparseAttnBackend.forward_decode`` calls it (read from 0.5.23, exercised on CPU by
tests/plugin/test_sglang_decode_seam.py with SGLang's own pools):

    req_pool_indices  int64 [bs]       request rows (row 0 is the padding row of CUDA-graph padded batches)
    seq_lens          int64 [bs]       tokens of each request including the one being decoded
    top_k_result      int32 [bs, k]    the indexer's top-k POSITIONS within each request (-1 padding); HiSparse
                                       forces the indexer's unfused path so positions, not locations, arrive here
    layer_id          int              the model layer
    returns           int32 [bs, k]    rows of ``token_to_kv_pool.get_key_buffer(layer_id)`` (the device pool)
                                       that FlashMLA reads with ``kv_format="V32"``; -1 where the input was -1

What the seam does in each layer, step by step, with the indexer tap around it: echo.py's docstring (one decode
layer with ESS in SGLang, top to bottom).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import numpy as np
import torch

from ess_sglang.cache_manager import NewTokens
from ess_sglang.kernels.step_rows import step_rows_torch, step_rows_triton
from ess_sglang.sglang_plugin import compat, echo, health
from ess_sglang.sglang_plugin import settings as settings_mod
from ess_sglang.sglang_plugin.active import active_coordinator, set_active
from ess_sglang.sglang_plugin.admission import EssAdmission
from ess_sglang.sglang_plugin.lifecycle import RequestLifecycle
from ess_sglang.sglang_plugin.pools import (
    HostPoolView,
    LayerViews,
    allocate_host_pool,
    build_cache_manager,
    first_of_run,
)
from ess_sglang.sglang_plugin.warmup import WindowCapture

logger = logging.getLogger("ess_sglang.sglang_plugin")


class StepRows(NamedTuple):
    """What a decode step's layers share about its batch (``EssCoordinator.rows_of_step``), [bs] each."""

    key: tuple  # the decode step (map_last_loc_to_buffer's count) and the request-row and length tensors they were
    # computed from (identity, shape, dtype, device)
    rpi: torch.Tensor  # request rows (int64)
    lens: torch.Tensor  # tokens of each request, the one being decoded included (int64)
    live_rpi: torch.Tensor  # request rows, -1 for CUDA-graph padding rows (the resolve ignores their positions)
    visible_lens: torch.Tensor  # lens, 0 for padding rows (positions a prefetch candidate may come from)
    new_host_loc: torch.Tensor  # host location of the token being decoded, -1 for padding rows
    new_token_rows: torch.Tensor  # device-pool row of each request's new-token slot


class TokenStats(NamedTuple):  # same fields as HiSparseTokenStats (the scheduler's pool log line reads them)
    device_tokens: int
    device_token_usage: float
    host_tokens: int
    host_token_usage: float


class _NoSpeculation:
    """HiSparse's speculative-swap manager, as SGLang's call sites see it when speculation is off."""

    enabled = False
    scratch_capacity = 0

    def allocate_scratch(self, req_pool_idx: int) -> None:
        return None


class EssCoordinator(RequestLifecycle):
    """Drop-in for ``HiSparseCoordinator`` (DSA models, no speculative decoding) driving ``HotPoolCacheManager``."""

    is_dsv4_hisparse = False
    is_m3_hisparse = False
    compress_ratio = 1
    enable_prefetch = False

    def __init__(self, *, req_to_token_pool: Any, token_to_kv_pool_allocator: Any, config: Any,
                 hot_slots_per_layer: int, host_tokens: int, device: torch.device | str, top_k: int,
                 max_running_requests: int | None = None, pin_memory: bool | None = None, copy_impl: str = "auto",
                 host_pool: Any = None, resolve_impl: str = "auto"):
        dev = torch.device(device)
        from ess_sglang.cache_manager import resolve_settings

        # what the resolve can run on this device: checked before SGLang's pools are touched or the host pool pinned
        resolve_impl, self.resolve_pdl = resolve_settings(resolve_impl, getattr(config, "resolve_pdl", None), dev)
        self.config = config
        self.device = dev
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = allocator = token_to_kv_pool_allocator
        self.mem_pool_device = pool = allocator.get_kvcache()
        self.top_k = top_k
        self.page_size = page = pool.page_size
        self.num_layers = L = pool.layer_num
        self.start_layer = pool.start_layer
        self.entry_bytes = E = pool.kv_cache_dim * torch.empty((), dtype=pool.store_dtype).element_size()
        rows = req_to_token_pool.req_to_token.shape[0]
        self.num_rows = rows
        self.max_running_requests = max_running_requests or rows - 1
        if hot_slots_per_layer % page:
            raise ValueError(f"ESS: hot_slots_per_layer {hot_slots_per_layer} is not a multiple of page_size {page}")

        # Regions of the device pool, reserved from a fresh physical allocator (pages come out in order).
        self.hot_slots_per_layer = hot_slots_per_layer
        self.hot_base, self.new_token_base = self._reserve_regions()
        phys = allocator.hisparse_attn_allocator
        self.staging_capacity = int(phys.available_size())

        # Host pool (pinned, layer-first, 656-byte rows): SGLang's class, sized by ESS.
        if host_pool is None:
            host_pool = allocate_host_pool(pool, host_tokens, dev.type == "cuda" if pin_memory is None else pin_memory)
        self.mem_pool_host = host_pool
        width = req_to_token_pool.req_to_token.shape[1] + page
        self.req_to_host_pool = torch.full((rows, width), -1, dtype=torch.int64, device=dev)
        self.req_to_host_pool_allocated_len = torch.zeros(rows, dtype=torch.int64)
        self._host_allocated_len = self.req_to_host_pool_allocated_len.numpy()  # the same memory, for numpy reads

        # The device pool's layers, as [rows, entry_bytes] byte views; the hot pools are regions of them.
        self.device_kv = [pool.kv_buffer[i].view(torch.uint8).view(-1, E) for i in range(L)]
        base = self.hot_base
        views = LayerViews([kv[base:base + hot_slots_per_layer] for kv in self.device_kv])
        self.host = HostPoolView(host_pool, L, E, dev)
        # ECHO prefetch and spare slots (echo.py): which layers prefetch, how many slots each keeps spare
        self.overlap_plan = echo.plan(config, L, top_k, self.max_running_requests, hot_slots_per_layer, page)
        # (a resolve's entries: the selection, and each row's token where new_tokens="insert")
        self.manager = build_cache_manager(self.host, hot_slots_per_layer, views, dev, max_selected=rows * (top_k + 1),
                                           copy_impl=copy_impl, resolve_impl=resolve_impl,
                                           spare_slots=self.overlap_plan.spare_slots, resolve_pdl=self.resolve_pdl,
                                           refill_interval=self.overlap_plan.refill_interval,
                                           spare_max_entries=self.overlap_plan.spare_max_entries,
                                           decay_gamma=config.decay_gamma if config.retention == "decay" else None)
        self.max_selected = rows * top_k
        self.overlap = echo.DecodeOverlap(self.manager, self.overlap_plan, rows, width, rows, config)

        # (a reserve of spare slots for small resolves only is no slot for the larger ones: it is not admitted on)
        reserve = self.overlap_plan.spare_slots if self.overlap_plan.spare_max_entries is not None else 0
        self.admission = EssAdmission(
            host_tokens=self.host.num_tokens, indexer_tokens=int(allocator.logical_attn_allocator.available_size()),
            hot_slots_per_layer=hot_slots_per_layer - reserve, top_k=top_k, page_size=page, q_tokens=1,
            max_requests=self.max_running_requests)
        # SGLang's budget checks read allocator.available_size(), min(logical, physical) for HiSparse. With ESS a
        # decoded token needs no physical slot (new-token slots are static), so the logical pool is the budget;
        # prefill staging is checked by ESS admission.
        allocator.available_size = allocator.logical_attn_allocator.available_size
        # SGLang's flush_cache clears the allocator (with no request running): reserve the regions again.
        allocator.clear = self._clear_allocator_and_reserve(allocator.clear)

        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=dev)
        # a step's per-request rows: one launch on the Triton path (kernels/step_rows.py), its torch definition else
        self._step_rows_fn = step_rows_triton if self.manager.resolve_impl == "triton" else step_rows_torch
        self._step_rows: StepRows | None = None  # the decode step's per-request tensors (layer 0 computes them)
        self._write_rows: tuple[tuple, torch.Tensor] | None = None  # a forward's KV-write rows (first layer's)
        self.decode_tap = None  # the indexer call of a decode layer in progress (indexer_tap.py)
        self.spec_swap = _NoSpeculation()
        self.padded_buffer_size = 1  # SGLang's PD queue divides free physical slots by this per request
        self.device_buffer_size = hot_slots_per_layer
        self.decode_producer_stream = None
        self.ack_staging_queue: list = []  # HiSparse's staging acknowledgements: ESS's staging needs none
        self._init_requests()
        # A prompt that fits its warm-up budget is loaded whole: its windows are not needed.
        self.capture = WindowCapture(L, config.warmup_windows, min_seq_len=self.warmup_budget(1 << 62)) \
            if config.warmup_windows > 0 else None
        self._capture_note: str | None = None
        self.metrics = None
        self.queued = 0
        self.busy_since_idle_check = True  # health.py: the idle check runs once after every busy period
        self.last_idle_check = 0.0
        self._admitted_published = -1
        self._step = 0
        self._step_started = False  # the clock was advanced at layer 0's prefetch, for its swap-in (_start_step)
        set_active(self)
        logger.info("ESS coordinator: %d layers, hot pool %d slots/layer at device rows [%d, %d), new-token slots "
                    "at %d, host pool %d tokens, %d prefill staging slots; %s", L, hot_slots_per_layer, base,
                    base + hot_slots_per_layer, self.new_token_base, self.host.num_tokens, self.staging_capacity,
                    self.overlap_plan.note)

    # ------------------------------------------------------------------------------------------ construction
    def _reserve_regions(self) -> tuple[int, int]:
        """Take the hot-pool region and the new-token slots (one per request row) from the physical allocator."""
        phys = self.token_to_kv_pool_allocator.hisparse_attn_allocator
        base = first_of_run(phys.alloc(self.hot_slots_per_layer))
        if base is None:
            raise RuntimeError("ESS: could not reserve a contiguous hot-pool region in the device pool (the physical "
                               "allocator was already in use); the ESS coordinator must be created at start-up")
        new_base = first_of_run(phys.alloc(-(-self.num_rows // self.page_size) * self.page_size))
        if new_base is None:
            raise RuntimeError("ESS: could not reserve the new-token slots in the device pool")
        return base, new_base

    def _clear_allocator_and_reserve(self, original_clear):
        def clear():
            original_clear()
            if self._reserve_regions() != (self.hot_base, self.new_token_base):
                raise RuntimeError("ESS: the device-pool regions moved after the allocator was cleared")
            self.manager.empty_pools()
            self.overlap.forget_rows(range(self.num_rows))
            self.req_to_host_pool.fill_(-1)
            self.req_to_host_pool_allocated_len.zero_()
            self.mem_pool_host.clear()
            self._init_requests()

        return clear

    @classmethod
    def from_model_runner(cls, runner: Any, s: settings_mod.EssSettings, pools: Any) -> EssCoordinator:
        top_k = int(getattr(runner.model_config.hf_text_config, "index_topk", s.config.top_k))
        allocator = runner.token_to_kv_pool_allocator
        if pools is not None:
            hot, host = pools.hot_slots_per_layer, pools.host_tokens
        else:  # sizing did not run (e.g. a user-fixed pool): derive from what SGLang allocated
            host = int(allocator.size_full)
            hot = max(s.config.page_size, int(allocator.get_kvcache().size) // 2 // s.config.page_size
                      * s.config.page_size)
        return cls(req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool_allocator=allocator,
                   config=s.config, hot_slots_per_layer=hot, host_tokens=host, device=runner.device, top_k=top_k,
                   max_running_requests=getattr(runner, "max_running_requests", None))

    # ------------------------------------------------------------------------------------------ decode seam
    def swap_in_selected_pages(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                               top_k_result: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Make every selected entry resident in the layer's hot pool; return device-pool rows for FlashMLA.

        One call of its own on the main stream in a layer with the defaults (the resolve: five launches, three with
        spare slots or for one or two requests; the torch resolve adds its own): what depends only on the batch is
        computed once a step (`rows_of_step`), padding rows reach the resolve as request row -1 (ignored there), the
        resolve writes device-pool rows itself (`slot_offset`) and writes the token back after the selection, reading
        its entry in place from its new-token slot (`new_tokens`). In the decode harness on the H200 the per-layer
        torch ops this replaced (about a dozen small launches) cost 24-29 us a layer at batch 64, 32K and 128K
        (benchmarks/RESULTS.md, decode_layers)."""
        if top_k_result.dim() != 2:
            raise NotImplementedError("ESS: multi-token (speculative) decode steps are not supported")
        layer = layer_id - self.start_layer
        if layer == 0:
            self._start_step(from_tap=False)
        B, K = top_k_result.shape
        rows = self.rows_of_step(req_pool_indices, seq_lens)
        # the layer's prefetch has landed and the previous layer's refill is done (echo.py, 3a-b)
        self.overlap.before_resolve(layer)
        # this step's token, read in place from its new-token slot (set_mla_kv_buffer wrote it there); with
        # new_tokens="insert" the resolve also gives it a hot slot (no copy, no launch of its own)
        new_tokens = NewTokens(rows.new_host_loc, self.device_kv[layer], rows.new_token_rows,
                               insert=self.config.new_tokens == "insert")
        # the selection: positions -> host locations -> hot slots (misses fetched from the host pool) -> rows of the
        # device pool; then the token is written back (host pool, and its hot slot: a selection naming it reads its
        # entry) by the resolve's last launch
        slots = self.manager.resolve(layer, top_k_result.reshape(B, 1, K), self.req_to_host_pool, rows.live_rpi,
                                     rows.lens, slot_offset=self.hot_base, new_tokens=new_tokens)
        self.overlap.after_resolve(layer)  # settle the prefetch, refill spare slots: beside attention (3d-e)
        return slots.view(B, K)

    def _start_step(self, from_tap: bool) -> None:
        """Advance the LRU clock once per decode step, before the step's first hot-pool work: at layer 0's prefetch
        (indexer tap) when it prefetches, so that the side stream's prefetch reads the new clock, else at layer 0's
        swap-in. The flag only bridges a layer-0 tap to its swap-in. The step's per-request tensors are computed
        again by the step's first hook."""
        if from_tap:
            self.manager.begin_step()
            self._step_started = True
            self._step_rows = None
        elif self._step_started:
            self._step_started = False
        else:
            self.manager.begin_step()
            self._step_rows = None

    def rows_of_step(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> StepRows:
        """The decode step's per-request tensors (`StepRows`), computed by the step's first hook call (layer 0) and
        reused by every later layer of the step, on the same tensors (other tensors, or another decode step, compute
        them again: the step's start clears them, and the key holds the host's decode-step count too, in case a step
        cut short left the start's flag behind). One launch (kernels/step_rows.py); in a CUDA graph, layer 0's launch
        is captured once and recomputes them in every replay."""
        rpi, lens = req_pool_indices, seq_lens
        key = (self._step,) + tuple((t.data_ptr(), tuple(t.shape), t.dtype, t.device) for t in (rpi, lens))
        if self._step_rows is not None and self._step_rows.key == key:
            return self._step_rows
        rows = self._step_rows_fn(rpi, lens, self.num_real_reqs, self.req_to_host_pool, self.new_token_base)
        self._step_rows = StepRows(key, *rows.unbind(0))
        return self._step_rows

    def write_rows(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """The device-pool rows ``set_mla_kv_buffer`` writes a forward's new tokens to (``loc``: their logical
        locations, the same tensor in every layer of a forward): translated through the pool's mapping by the
        forward's first layer, and reused by its later layers while the tensor and the mapping are unchanged
        (SGLang's HiSparse pool translates in every layer: one gather kernel a layer, which all-HBM SGLang does not
        run). The first layer always translates, so a CUDA graph captures the translation once and replays it in
        every step; the mapping's version counter keeps an eager forward from reusing another's rows."""
        pool = self.mem_pool_device
        key = (loc.data_ptr(), tuple(loc.shape), loc.dtype, loc.device,
               pool.full_to_hisparse_device_index_mapping._version)
        first = layer_id == self.start_layer
        if not first and self._write_rows is not None and self._write_rows[0] == key:
            return self._write_rows[1]
        rows = pool.translate_loc_to_hisparse_device(loc)
        if first:
            self._write_rows = (key, rows)
        return rows

    def prefetch_from_logits(self, layer_id: int, logits: torch.Tensor, req_pool_indices: torch.Tensor,
                             seq_lens: torch.Tensor) -> None:
        """The indexer's logits of a decode layer exist (indexer_tap.py): queue the layer's ECHO prefetch (real
        requests only; this step's token included, see echo.py step 1)."""
        layer = layer_id - self.start_layer
        if layer == 0:
            self._start_step(from_tap=True)
        rows = self.rows_of_step(req_pool_indices, seq_lens)
        self.overlap.prefetch(layer, logits, rows.rpi, rows.visible_lens, self.req_to_host_pool)

    def note_selection(self, layer_id: int, logits: torch.Tensor, positions: torch.Tensor,
                       req_pool_indices: torch.Tensor) -> None:
        """The layer's top-k positions exist: keep them and the logits; each row's k-th best score moves the prefetch
        threshold beside attention (echo.py, 3d)."""
        self.overlap.note_selection(layer_id - self.start_layer, logits, positions, req_pool_indices.long())

    def prefetches(self, layer_id: int, batch_size: int | None = None) -> bool:
        return self.overlap.prefetches(layer_id - self.start_layer, batch_size)

    def map_last_loc_to_buffer(self, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                               req_pool_indices: torch.Tensor, seq_lens_cpu: torch.Tensor,
                               req_pool_indices_cpu: torch.Tensor) -> None:
        """Before a decode step (host side): a host slot for each new token, its KV write to the new-token slot."""
        # (numpy on the host tensors' memory: at one request this runs on the decode loop's critical path, and a
        # handful of torch CPU ops cost tens of microseconds there)
        rows_cpu = req_pool_indices_cpu.numpy()
        pos_cpu = seq_lens_cpu.numpy() - 1
        for i in np.flatnonzero(pos_cpu >= self._host_allocated_len[rows_cpu]).tolist():  # a new host page
            self.mem_pool_host.alloc_paged_token_slots(self.req_to_host_pool, self.req_to_host_pool_allocated_len,
                                                       int(rows_cpu[i]), int(pos_cpu[i]), 1)
        # set_mla_kv_buffer writes the new token where the mapping points: its request's new-token slot. Earlier
        # tokens keep pointing there (a forward still in flight under the overlap scheduler may read them); they are
        # cleared when the request finishes, before SGLang frees its locations.
        mapping = self.token_to_kv_pool_allocator.full_to_hisparse_device_index_mapping
        mapping[out_cache_loc.long()] = self.new_token_base + req_pool_indices.long()
        self._step += 1
        self._publish_metrics(self._step)

    # ------------------------------------------------------------------------------------------ metrics
    def _publish_metrics(self, step: int) -> None:
        # ===== METRICS CALL SITE =====================================================================
        # Once per decode step, on the host, outside the CUDA graph. ess_sglang.metrics.EssMetrics (created in
        # attach_scheduler when --enable-metrics and ess_config.metrics.enabled) reads the device counters back
        # asynchronously every readout_interval_steps steps and publishes the sglang:ess_* series.
        # ==============================================================================================
        if self.metrics is not None:
            self.metrics.on_step()
            if self.admission.running != self._admitted_published:
                self._admitted_published = self.admission.running
                self.metrics.set_admitted_requests(self._admitted_published)
        health.after_step(self, step)  # the running self-check, every invariant_check_interval_steps steps

    def note_queued(self, n: int) -> None:
        """Requests held back by admission (the sglang:ess_* 'queued for host capacity' gauge)."""
        self.queued = int(n)
        if self.metrics is not None:
            self.metrics.set_queued_for_host_capacity(self.queued)

    def attach_scheduler(self, scheduler: Any) -> None:
        from ess_sglang.sglang_plugin import metrics as metrics_glue

        enabled = False
        try:
            from sglang.srt.runtime_context import get_observability

            enabled = bool(get_observability().enable_metrics)
        except Exception:
            enabled = bool(getattr(getattr(scheduler, "server_args", None), "enable_metrics", False))
        if enabled and self.metrics is None:
            self.metrics = metrics_glue.make_exporter(self.manager, self.config,
                                                      metrics_glue.scheduler_labels(scheduler))

    # ------------------------------------------------------------------------------------------ the rest
    def get_token_stats(self) -> TokenStats:
        phys = self.token_to_kv_pool_allocator.hisparse_attn_allocator
        dev_cap = int(phys.size)
        dev_used = dev_cap - int(phys.available_size())
        host_cap = self.host.num_tokens
        host_used = self.host.num_used
        return TokenStats(dev_used, dev_used / dev_cap if dev_cap else 0.0, host_used,
                          host_used / host_cap if host_cap else 0.0)

    def note_capture_unavailable(self, why: str) -> None:
        if self._capture_note is None:
            self._capture_note = why
            logger.warning("ESS warm-up: cannot capture the prefill's query windows (%s); warm-up loads the most "
                           "recent tokens", why)

    def set_decode_producer_stream(self, stream: Any) -> None:
        self.decode_producer_stream = stream

    def wait_for_pending_backup(self) -> None:
        return None  # write-back happens inside the decode step, on its stream

    def allocate_spec_scratch(self, req_pool_indices: list) -> None:
        return None

    def prepare_spec_verify(self, batch: Any) -> None:
        raise NotImplementedError("ESS does not support speculative decoding")

    def commit_spec_accept_tokens(self, batch: Any, accept_indices: torch.Tensor) -> None:
        raise NotImplementedError("ESS does not support speculative decoding")

    def swap_in_selected_blocks(self, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError("ESS serves DSA models only (not MiniMax sparse blocks)")

    def host_token_len(self, kv_allocated_len: int) -> int:
        return kv_allocated_len

    def destroy(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        destroy = getattr(self.mem_pool_host, "destroy", None)
        if destroy is not None:
            destroy()
        if active_coordinator() is self:
            set_active(None)


# ---------------------------------------------------------------------------------------------- hooks

def runs_ess(runner) -> bool:
    """Whether this model runner serves with ESS (its settings enable it, and SGLang's HiSparse path is on)."""
    return settings_mod.current(getattr(runner, "server_args", None)).enabled and \
        bool(getattr(runner, "enable_hisparse", False))


def maybe_init_hisparse_coordinator_hook(original, runner, *args, **kwargs):
    """AROUND ModelRunner.maybe_init_hisparse_coordinator: the ESS coordinator instead of HiSparse's (the registry,
    hooks.py, first checks that every ESS hook took effect)."""
    if not runs_ess(runner):
        return original(runner, *args, **kwargs)
    from ess_sglang.sglang_plugin import sizing

    s = settings_mod.current(getattr(runner, "server_args", None))
    runner.hisparse_coordinator = EssCoordinator.from_model_runner(runner, s, sizing.current_pools())
    # The scheduler's token capacity is the logical locations (indexer entries backed by the host pool), not the
    # device slots the pool configurator sized: ESS's allocator reports the logical free count
    # (EssCoordinator.__init__), and SGLang's pool statistics divide it by this number (a device-sized one gave a
    # negative usage and a failed assertion on the first idle step of a real 0.5.17 server); it also caps a
    # request's length, which with ESS may exceed the device slots.
    runner.max_total_num_tokens = int(runner.token_to_kv_pool_allocator.size)
    from ess_sglang.sglang_plugin import decode_topk

    decode_topk.log_startup(runner, s.config)
    return None


def set_mla_kv_buffer_hook(original, pool, *args, **kwargs):
    """AROUND HiSparseDSATokenToKVPool.set_mla_kv_buffer(layer, loc, cache_k_nope, cache_k_rope) on an ESS
    instance: the rows are translated once a forward (``EssCoordinator.write_rows``) instead of in every layer, then
    stored as the HiSparse pool itself stores them (its parent class's method). Any other call (keywords, a
    ``KVWriteLoc``, another pool) passes straight through."""
    coord = active_coordinator()
    if coord is None or kwargs or len(args) != 4 or pool is not coord.mem_pool_device \
            or not isinstance(args[1], torch.Tensor):
        return original(pool, *args, **kwargs)
    layer, loc, k_nope, k_rope = args
    return compat.store_in_device_pool(pool, layer, coord.write_rows(layer.layer_id, loc), k_nope, k_rope)


def release_kv_cache_hook(req, *args, **kwargs):
    """BEFORE mem_cache.common.release_kv_cache(req, ...) (SGLang 0.5.17): a request's KV is released without
    ``request_finished`` when it finishes at prefill or is aborted while waiting; ESS releases what it holds for the
    request first (``request_finished`` is idempotent: a second call for the same row frees nothing)."""
    coord = active_coordinator()
    if coord is not None and compat.req_row(req) is not None and getattr(req, "kv", None) is not None:
        coord.request_finished(req)
    return None


def init_hisparse_coordinator_hook(result, scheduler, *args, **kwargs):
    """AFTER Scheduler.init_hisparse_coordinator: give the ESS coordinator the scheduler (metrics labels)."""
    coord = getattr(scheduler, "hisparse_coordinator", None)
    if isinstance(coord, EssCoordinator):
        coord.attach_scheduler(scheduler)
    return None
