#!/usr/bin/env bash
# On the GPU test machine, from the repository root: unpack the SGLang bundle that scripts/sglang_bundle.sh built
# (.bundle/site.tar.xz.part-*, copied with the working tree) into $ESS_SITE, install this package there from the working
# tree, and run a command with that folder on the path.
#
#   scripts/sglang_site.sh python3 benchmarks/serving.py ...
#
# The parts may be copied one at a time while the machine keeps its files: each run adds the parts it finds to
# $ESS_SITE.parts, and the site is unpacked once they are all there (scripts/sglang_bundle.sh writes a .count file).
# A command given before that exits 3.
#
# ESS_SAVE_JIT=$OUT/jit.tar.xz scripts/sglang_site.sh ...   then carry its parts as .bundle/jit.tar.xz.part-*
set -euo pipefail
site=${ESS_SITE:-/tmp/ess-sglang-site}
parts=$site.parts
mkdir -p "$parts"
if compgen -G ".bundle/site.tar.xz.part-*" >/dev/null; then
    cp -n .bundle/site.tar.xz.part-* "$parts"/
    cp .bundle/site.count "$parts"/ 2>/dev/null || true
fi
if [ ! -f "$site/.unpacked" ]; then
    want=$(cat "$parts/site.count" 2>/dev/null || echo 0)
    have=$(compgen -G "$parts/site.tar.xz.part-*" | wc -l)
    if [ "$want" -eq 0 ] || [ "$have" -lt "$want" ]; then
        echo "sglang_site: $have of $want bundle parts on this machine; carry the rest (.bundle)" >&2
        exit 3
    fi
    mkdir -p "$site"
    cat "$parts"/site.tar.xz.part-* | xz -d -T0 | tar -x -C "$site"
    touch "$site/.unpacked"
    echo "sglang_site: unpacked $want parts into $site ($(du -sh "$site" | cut -f1))"
fi
# This package, from the working tree (its entry point is how SGLang finds the plugin).
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$site" . \
    >/dev/null
# JIT caches (tvm-ffi, DeepGEMM, flashinfer under ~/.cache, Triton's under ~/.triton) from an earlier machine: a first launch on a
# fresh machine spends about 3 minutes compiling them. ESS_SAVE_JIT=PATH writes them back after the command.
if compgen -G ".bundle/jit.tar.xz.part-*" >/dev/null && [ ! -f ~/.cache/.ess-jit ]; then
    mkdir -p ~/.cache && cat .bundle/jit.tar.xz.part-* | xz -d | tar -C ~ -x && touch ~/.cache/.ess-jit
    echo "sglang_site: JIT caches from .bundle/jit.tar.xz.part-* ($(du -sch ~/.cache ~/.triton | tail -1 | cut -f1))"
fi
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
export PATH=$site/bin:$PATH
export PYTHONUNBUFFERED=1
rc=0
"$@" || rc=$?
if [ -n "${ESS_SAVE_JIT:-}" ]; then  # in parts of 15 MiB (a file that comes back from the machine is at most 16)
    dirs=(); for d in .cache .triton; do [ -d ~/$d ] && dirs+=("$d"); done
    tar -C ~ --exclude=.cache/pip --exclude=.cache/.ess-jit -cf - "${dirs[@]}" | xz -3 -T0 |
        split -b 15M -d - "$ESS_SAVE_JIT.part-"
    echo "sglang_site: JIT caches saved to $ESS_SAVE_JIT.part-* ($(cat "$ESS_SAVE_JIT".part-* | wc -c) bytes)"
fi
exit $rc
