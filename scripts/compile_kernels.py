"""Compile (not run) the project's Triton kernels for sm_90 (H100 / H200), on any machine: Triton's own ptxas needs no
GPU. The CPU tests run the kernels in Triton's interpreter, which accepts some programs the compiler rejects (types,
shapes); this catches those. Exit status 1 if any kernel fails to compile.

    TRITON_INTERPRET=0 python scripts/compile_kernels.py        (tests/test_kernels_compile.py runs it)
"""
import sys

import triton
from ess_sglang.kernels import flashtrans as kf
from ess_sglang.kernels import indexer as ki
from ess_sglang.kernels import new_tokens as kn
from ess_sglang.kernels import prefetch as kp
from ess_sglang.kernels import resolve as kr
from ess_sglang.kernels import step_rows as ks
from ess_sglang.kernels import topk as kt
from ess_sglang.kernels import translate as ktr
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ess_sglang.cache_manager import Counter

target = GPUTarget("cuda", 90, 32)


FAILED = []


def check(fn, sig, consts):
    names = fn.arg_names
    signature = {n: sig.get(n, "constexpr" if n in consts else None) for n in names}
    missing = [n for n, t in signature.items() if t is None]
    assert not missing, (fn.__name__, missing)
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    try:
        triton.compile(src, target=target)
        print("ok  ", fn.__name__, consts)
    except Exception as e:  # noqa: BLE001
        print("FAIL", fn.__name__, consts, type(e).__name__, str(e)[:2000])
        FAILED.append(fn.__name__)


I64, I32, P64, P32, PF, PU8 = "i64", "i32", "*i64", "*i32", "*fp32", "*u8"
_DECAY = kr.decay_retention(0.75)
LRU_AGES, DECAY_AGES = dict(UNITS=1, OFFSET=0), dict(UNITS=_DECAY.units, OFFSET=_DECAY.offset)
LRU, DECAY = dict(A=256, **LRU_AGES), dict(A=256, **DECAY_AGES)
check(ktr._translate_kernel, dict(pos_ptr=P32, seq_ptr=P64, rpi_ptr=P64, r2t_ptr=P32, r2t_stride=I64, num_rows=I64,
                                  width=I64, n=I64, per_batch=I64, num_locations=I64, out_ptr=P32, l2s_ptr=P32,
                                  num_slots=I64, cnt_ptr=P64),
      dict(THROUGH_SLOTS=True, C_LOOKUPS=0, C_HITS=1, C_NOT_RESIDENT=13, BLOCK=1024))
check(ktr._translate_kernel, dict(pos_ptr=P32, seq_ptr=P64, rpi_ptr=P64, r2t_ptr=P32, r2t_stride=I64, num_rows=I64,
                                  width=I64, n=I64, per_batch=I64, num_locations=I64, out_ptr=P32, l2s_ptr=P32,
                                  num_slots=I64, cnt_ptr=P32),
      dict(THROUGH_SLOTS=False, C_LOOKUPS=0, C_HITS=1, C_NOT_RESIDENT=13, BLOCK=1024))
for mode in (0, 1):
    for protect, listed, spare_only, copy in ((True, True, False, False), (True, True, False, True),
                                              (False, True, False, False), (False, True, False, True),
                                              (True, False, False, False), (False, True, True, False)):
        # (a prefetch's lookup: chained or not; a resolve's that copies: with or without resolve_pdl; a resolve's
        # that inserts this step's tokens)
        for pdl in ((False, True) if spare_only or copy else (True,)):
            for insert in ((False, True) if mode == 0 and protect and not spare_only else (False,)):
                sig = dict(src_ptr=P32 if mode == 0 else P64, seq_ptr=P64, rpi_ptr=P64, r2t_ptr=P32, r2t_stride=I64,
                           r2t_rows=I64, width=I64, n=I64, per_batch=I64, l2s_ptr=P32, s2l_ptr=P32, stamp_ptr=P64,
                           clock_ptr=P64, out_ptr=P32, loc_ptr=P64, cnt_ptr=P64, scr_ptr=P32, over_loc_ptr=P64,
                           over_idx_ptr=P32, spare_ptr=P32, taken_ptr=P64, num_spare=I64, took_loc_ptr=P64,
                           took_slot_ptr=P64, num_locations=I64, num_slots=I64, host_ptr=P32, hot_ptr=P32,
                           copy_cap=I64, n_sel=I64, **(dict(ins_ptr=P64) if insert else {}))
                consts = dict(MODE=mode, COUNT=mode == 0, PROTECT=protect, LIST=listed, SPARE_ONLY=spare_only,
                              C_LOOKUPS=0, C_HITS=1, C_BAD=5, C_FETCH_A=2, C_FETCH_B=3, BLOCK=256, PDL=pdl, COPY=copy,
                              WORDS=164 if copy else 4, BLOCK_WORDS=256 if copy else 4, COPY_ROWS=16, INSERT=insert,
                              C_NEW=9, **({} if insert else dict(ins_ptr=None)))
                check(kr._lookup_kernel, sig, dict(consts, **LRU, bonus_ptr=None))
                if protect and not spare_only:  # (the hits' stamps with decayed retention)
                    check(kr._lookup_kernel, dict(sig, bonus_ptr=P64), dict(consts, **DECAY))
for (copy, pend), ages in zip(((True, False), (False, True), (True, True), (False, False)),
                               (LRU_AGES, DECAY_AGES, LRU_AGES, DECAY_AGES), strict=True):
    check(kr._assign_kernel, dict(scr_ptr=P32, victims_ptr=P32, over_loc_ptr=P64, over_idx_ptr=P32, took_loc_ptr=P64,
                                  took_slot_ptr=P64, l2s_ptr=P32, s2l_ptr=P32, stamp_ptr=P64, clock_ptr=P64,
                                  out_ptr=P32, cnt_ptr=P64, src_ptr=P32, dst_ptr=P32, pend_src_ptr=P64,
                                  pend_dst_ptr=P64, pend_count_ptr=P64, taken_ptr=P64, num_spare=I64, n=I64,
                                  n_sel=I64, copy_cap=I64),
          dict(COPY=copy, PEND=pend, WORDS=164, BLOCK_WORDS=256, C_FETCH_A=2, C_FETCH_B=3, C_EVICT=8, C_OVERFLOW=6,
               C_NEW=9, STAMP_BACK=0 if copy else 1, ROWS=4, CLEAR=1024, PDL=copy or pend))
    # (the same walk in the merged tail of a resolve with spare slots, after its scans)
    check(kr._tail_kernel, dict(stamp_ptr=P64, clock_ptr=P64, scr_ptr=P32, victims_ptr=P32, over_loc_ptr=P64,
                                over_idx_ptr=P32, took_loc_ptr=P64, took_slot_ptr=P64, l2s_ptr=P32, s2l_ptr=P32,
                                out_ptr=P32, cnt_ptr=P64, src_ptr=P32, dst_ptr=P32, pend_src_ptr=P64, pend_dst_ptr=P64,
                                pend_count_ptr=P64, taken_ptr=P64, num_spare=I64, num_slots=I64, n=I64, n_sel=I64,
                                copy_cap=I64, age_per=I32, victim_per=I32, assign_programs=I32),
          dict(A=256, SBLOCK=1024, VBLOCK=512, COPY=copy, PEND=pend, WORDS=164, BLOCK_WORDS=256, C_FETCH_A=2,
               C_FETCH_B=3, C_EVICT=8, C_OVERFLOW=6, C_NEW=9, STAMP_BACK=0 if copy else 1, ROWS=4, CLEAR=1024, **ages,
               PDL=copy or pend))
for rows in (8, 16, 32):  # (decode_stack's overlap_copy_rows: 8 by default, more rows on fewer programs)
    check(kf._copy_rows_counted_kernel, dict(src_ptr=P32, dst_ptr=P32, src_rows_ptr=P64, dst_rows_ptr=P64,
                                             count_ptr=P64, n_rows=I64),
          dict(WORDS=164, SRC_STRIDE=164, DST_STRIDE=164, BLOCK_WORDS=256, ROWS=rows, PROGRAMS=32))
check(kt._topk_kernel, dict(scores_ptr=PF, row_stride=I64, T=I64, K=I32, out_pos_ptr=P32, out_kth_ptr=PF),
      dict(BLOCK=2048))
for p in range(4):
    check(kt._tile_hist_kernel, dict(scores_ptr=PF, row_stride=I64, T=I64, prefix_ptr=P64, hist_ptr=P32),
          dict(P=p, BLOCK=2048))
check(kt._tile_select_kernel, dict(hist_ptr=P32, prefix_ptr=P64, need_ptr=P32), {})
for short_neg_inf in (True, False):
    check(kt._kth_of_selection_kernel, dict(scores_ptr=PF, row_stride=I64, T=I64, pos_ptr=P32, pos_stride=I64,
                                            K=I32, out_ptr=PF), dict(BLOCK_K=2048, SHORT_NEG_INF=short_neg_inf))
check(kt._tile_count_kernel, dict(scores_ptr=PF, row_stride=I64, T=I64, prefix_ptr=P64, counts_ptr=P32, tiles=I32),
      dict(BLOCK=2048))
check(kt._tile_write_kernel, dict(scores_ptr=PF, row_stride=I64, T=I64, K=I32, prefix_ptr=P64, need_ptr=P32,
                                  offsets_ptr=P32, tiles=I32, out_pos_ptr=P32), dict(BLOCK=2048))
common = dict(logits_ptr=PF, l_stride_b=I64, l_stride_q=I64, Q=I32, T=I64, first_pos=I64, thr_ptr=PF, rpi_ptr=P64,
              seq_ptr=P64, r2t_ptr=P32, r2t_stride=I64, r2t_rows=I64, r2t_width=I64, l2s_ptr=P32, num_locations=I64,
              tiles=I32)
for pdl in (False, True):  # (the prefetch's candidate kernels, with and without programmatic dependent launch)
    check(kp._count_kernel, dict(common, margin="fp32", counts_ptr=P32, kept_ptr=P32), dict(TILE=kp.TILE, PDL=pdl))
    check(kp._offsets_kernel, dict(counts_ptr=P32, after_ptr=P32, tiles=I32), dict(TILES=512, PDL=pdl))
    for tile in (kp.TILE, 64):
        check(kp._write_kernel, dict(counts_ptr=P32, after_ptr=P32, kept_ptr=P32, tiles=I32, seq_ptr=P64,
                                     cap_fraction_ptr="*fp64", cap_min=I64, first_pos=I64, T=I64, out_ptr=P64,
                                     width=I64),
              dict(TILE=tile, GROUP=kp.WRITE_BLOCK // tile, WBLOCK=512, PDL=pdl))
for keep in (kp.CLAIM_ROWS, kp.TILE):  # (the one-launch claim: a narrow and a full kept row per program)
    check(kp._claim_above_kernel, dict(common, margin="fp32", cap_fraction_ptr="*fp64", cap_min=I64, width=I64,
                                       s2l_ptr=P32, stamp_ptr=P64, clock_ptr=P64, num_slots=I64, spare_ptr=P32,
                                       taken_ptr=P64, num_spare=I64, src_ptr=P64, dst_ptr=P64, ctr_ptr=P32,
                                       kept_ptr=P32, B=I32),
          dict(TILE=kp.TILE, KEEP=keep, ROWS=kp.CLAIM_ROWS))
check(kp._claim_close_kernel, dict(ctr_ptr=P32, B=I32, taken_ptr=P64, num_spare=I64, count_ptr=P64, cnt_ptr=P64),
      dict(C_FETCH_A=int(Counter.PREFETCHED), C_FETCH_B=int(Counter.H2D_ENTRIES), ZERO=128))
check(kp._ema_kernel, dict(kth_ptr=PF, kth_stride=I64, Q=I32, rpi_ptr=P64, thr_ptr=PF, num_rows=I64, B=I32,
                           alpha="fp32", keep="fp32"), dict(BLOCK=128))
check(kp._settle_kernel, dict(src_ptr=P64, dst_ptr=P64, count_ptr=P64, n=I64, s2l_ptr=P32, stamp_ptr=P64,
                              clock_ptr=P64, cnt_ptr=P64), dict(C_USEFUL=11, C_WASTED=12, BLOCK=1024))
# the finish kernel's write-back of this step's tokens (`new_tokens`), and its defaults without
NEW_TOKEN_ARGS = dict(new_loc_ptr=P64, new_rows_ptr=P64, entries_ptr=P32, entry_stride=I64, entry_rows=I64,
                      host_ptr=P32, hot_ptr=P32, cnt_ptr=P64, n_new=I32, new_programs=I32, num_locations=I64)
NEW_TOKEN_CONSTS = dict(NEW=True, WORDS=164, HOST_STRIDE=164, HOT_STRIDE=164, BLOCK_WORDS=256,
                        C_D2H=int(Counter.D2H_ENTRIES), NEW_ROWS=kr.NEW_TOKEN_ROWS)
NO_NEW_TOKEN_INTS = dict(entry_stride=I32, entry_rows=I32, n_new=I32, new_programs=I32, num_locations=I32)
NO_NEW_TOKENS = dict(new_loc_ptr=None, new_rows_ptr=None, entries_ptr=None, host_ptr=None, hot_ptr=None, cnt_ptr=None,
                     NEW=False, WORDS=4, HOST_STRIDE=4, HOT_STRIDE=4, BLOCK_WORDS=4, C_D2H=-1, NEW_ROWS=4)
for refill in (False, True):
    for ages in (LRU_AGES, DECAY_AGES):
        check(kr._ages_kernel, dict(stamp_ptr=P64, clock_ptr=P64, scr_ptr=P32, taken_ptr=P64, num_spare=I64,
                                    num_slots=I64, per=I32, phase=I32, interval=I32),
              dict(REFILL=refill, A=256, SBLOCK=1024, PDL=not refill, **ages))
        check(kr._victims_kernel, dict(stamp_ptr=P64, clock_ptr=P64, scr_ptr=P32, victims_ptr=P32, taken_ptr=P64,
                                       num_spare=I64, num_slots=I64, per=I32, phase=I32, interval=I32),
              dict(REFILL=refill, A=256, BLOCK=512, PDL=not refill, **ages))
    for spare_only, pend, close in ((False, False, True), (False, True, True), (True, True, False), (True, True, True)):
        if refill and (spare_only or pend):
            continue
        for pdl in ((False, True) if spare_only else (not refill,)):  # (a prefetch's finishes: chained or not)
            # (the exact resolve's also with a table of slots + an offset, and with this step's tokens written back
            # in it: the SGLang plugin's)
            for table, new in (((False, False), (True, False), (True, True)) if not (refill or spare_only)
                               else ((False, False),)):
                check(kr._finish_kernel, dict(loc_ptr=P64, out_ptr=P64 if refill else P32, l2s_ptr=P32,
                                              stamp_ptr=P64, clock_ptr=P64, scr_ptr=P32, taken_ptr=P64, num_spare=I64,
                                              n=I64, num_slots=I64, pend_src_ptr=P64, pend_dst_ptr=P64,
                                              pend_count_ptr=P64, table_ptr=P64 if refill else P32, table_offset=I64,
                                              n_sel=I64, **(NEW_TOKEN_ARGS if new else NO_NEW_TOKEN_INTS)),
                      dict(REFILL=refill, SPARE_ONLY=spare_only, PEND=pend, CLOSE=close, STAMP_BACK=0, SCR=512,
                           BLOCK=16 if refill else 1024, PDL=pdl, TABLE=table,
                           **(NEW_TOKEN_CONSTS if new else NO_NEW_TOKENS)))
check(kr._refill_kernel, dict(scr_ptr=P32, victims_ptr=P32, l2s_ptr=P32, s2l_ptr=P32, stamp_ptr=P64, spare_ptr=P32,
                              taken_ptr=P64, cnt_ptr=P64), dict(C_EVICT=8, ROWS=32))
check(kf._copy_rows_masked_kernel, dict(src_ptr=P32, dst_ptr=P32, src_rows_ptr=P64, dst_rows_ptr=P64, n_rows=I64),
      dict(WORDS=164, SRC_STRIDE=164, DST_STRIDE=164, BLOCK_WORDS=256, ROWS=4))
for dot, q_type, q_fp8, chained, tiles, stages in ((ki.DOT_BF16, "*u8", True, False, ki.TILES, ki.STAGES),
                                                   (ki.DOT_BF16, "*bf16", False, False, ki.TILES, ki.STAGES),
                                                   (ki.DOT_BF16, "*u8", True, True, ki.TILES, ki.STAGES),
                                                   (ki.DOT_BF16, "*bf16", False, True, ki.TILES, ki.STAGES),  # stacks'
                                                   (ki.DOT_BF16, "*bf16", False, False, 1, 1),
                                                   (ki.DOT_BF16, "*bf16", False, False, 8, ki.STAGES),  # EIGHT_TILES
                                                   (ki.DOT_BF16, "*bf16", False, False, 8, 3)):
    check(ki._indexer_logits_kernel, dict(q_ptr=q_type, w_ptr=PF, cache_ptr=P32, r2t_ptr=P32, rpi_ptr=P64,
                                          seq_ptr=P64, out_ptr=PF, q_sb=I64, q_sq=I64, q_sh=I64, w_sb=I64, w_sq=I64,
                                          w_sh=I64, r2t_stride=I64, out_sb=I64, out_sq=I64, num_locations=I64,
                                          table_width=I64, table_rows=I64, first_pos=I64, max_len=I64, H=I32, Q=I32),
          dict(HP=64, BLOCK_T=ki.BLOCK_T, TILES=tiles, STAGES=stages, DOT=dot, Q_FP8=q_fp8, CHAINED=chained))
for not_resident, gather in ((13, False), (-1, False), (-1, True)):  # (gather: the SGLang plugin's write-back)
    check(kn._store_reserved_kernel, dict(entries_ptr=P32, host_ptr=P32, hot_ptr=P32, locs_ptr=P64 if gather else P32,
                                         l2s_ptr=P32,
                                         stamp_ptr=P64, clock_ptr=P64, cnt_ptr=P64, slots_out_ptr=P64, n=I64,
                                         num_locations=I64, num_slots=I64, rows_ptr=P64, entry_stride=I64,
                                         entry_rows=I64),
          dict(WORDS=164, HOST_STRIDE=164, HOT_STRIDE=164, BLOCK_WORDS=256, C_D2H=4, C_NOT_RESIDENT=not_resident,
               ROWS=4, GATHER=gather))
for index_type in (P64, P32):  # (the plugin's step rows: SGLang's request rows and lengths as int64 or int32)
    check(ks._step_rows_kernel, dict(rpi_ptr=index_type, lens_ptr=index_type, num_real_ptr=P32, r2h_ptr=P64,
                                     r2h_stride=I64, r2h_rows=I64, width=I64, new_token_base=I64, out_ptr=P64, B=I32),
          dict(BLOCK=256))

sys.exit(1 if FAILED else 0)
