"""The SGLang plugin: ``--enable-ess`` on ``python -m sglang.launch_server`` / ``sglang serve``.

This package is the only code in ess-sglang that imports SGLang. SGLang discovers ``register`` through the pip
entry point group ``sglang.srt.plugins`` (name ``ess``) and calls it in every process it starts (launcher,
tokenizer, scheduler, detokenizer, DP controller); ``SGLANG_PLUGINS=ess`` restricts loading to this plugin.

Modules, one job each:

* ``compat``     supported SGLang versions, target checks, the refusal messages;
* ``hooks``      the table of every hook (target, type, function), and the checks that they took effect: the one
                 module that imports the handlers, none of which imports it;
* ``active``     what ESS runs in this process (its coordinator, a PD prefill's window-set sender);
* ``cli_args``   the flags, what they imply, start-up validation;
* ``settings``   where the settings live (bookkeeping attributes of ServerArgs, which survive pickling);
* ``sizing``     the pool layout ESS asks SGLang for;
* ``coordinator`` the ESS replacement of HiSparse's coordinator: the decode seam ``swap_in_selected_pages``;
* ``echo``       ECHO prefetch and spare-slot refills around each decode layer (the layer's data path, top to
                 bottom), and which layers prefetch;
* ``indexer_tap`` the two hooks around each decode layer's top-k: they select as SGLang without ESS does and hand
                 the coordinator the layer's indexer logits and top-k;
* ``decode_topk`` which top-k decode runs with ESS: SGLang's top-k v2 kernel and plan, as without ESS;
* ``admission``  admission control (plain Python) and where it hooks into SGLang's scheduler;
* ``warmup``     capture of the prefill's query-window top-k sets, and warm-up of new requests;
* ``pd_windows`` PD disaggregation: those sets sent from the prefill instance to the decode instance in SGLang's
                 transfer metadata;
* ``metrics``    glue to ``ess_sglang.metrics`` (Prometheus series on SGLang's /metrics).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("ess_sglang.sglang_plugin")


def register() -> None:
    """Entry point (``sglang.srt.plugins``: ``ess``). Registers hooks; enables nothing by itself."""
    from ess_sglang.sglang_plugin import compat, hooks
    from ess_sglang.sglang_plugin.cli_args import ENV_ENABLED

    version = compat.installed_sglang_version()
    problems = [p for p in [compat.check_version(version)] if p]
    cli_problems = compat.check_targets(hooks.CLI_HOOKS, version)
    problems += cli_problems + compat.check_targets(hooks.runtime_hooks_for(version), version)
    report = compat.EnvironmentReport(version, problems)
    compat.set_report(report)
    if problems:
        logger.warning("ESS (ess-sglang) cannot be enabled in this process: %s", "; ".join(problems))
    if not cli_problems:
        hooks.register_cli_hooks()  # so that --enable-ess is refused with a message rather than unknown
    if report.ok and os.environ.get(ENV_ENABLED) == "1":
        hooks.install_runtime_hooks(apply=False)  # SGLang's loader applies them right after this returns
        logger.info("ESS (ess-sglang) plugin loaded: %d hooks registered", len(hooks.all_hooks()))
    else:
        logger.debug("ESS (ess-sglang) plugin loaded; ESS is off unless --enable-ess is given")
