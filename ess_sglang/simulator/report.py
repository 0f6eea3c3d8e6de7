"""Printing the table (rich or plain text) and plotting throughput against batch (matplotlib, imported late)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TextIO

HEADERS = ["batch", "pool ratio", "throughput tok/s", "per-request tok/s", "step ms", "hit rate", "bottleneck"]
REF_HEADERS = ["paper ratio", "paper tok/s", "paper per-req", "err tok/s", "err per-req"]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = list(HEADERS)
    reference = (result.get("scenario") or {}).get("reference")
    published = {r["batch"]: r for r in reference["rows"]} if reference else {}
    errors = {c["batch"]: c for c in result.get("reference", {}).get("rows", []) if c.get("fits", True)}
    if published:
        headers += REF_HEADERS
    lines = []
    for r in result["rows"]:
        if not r["fits"]:
            line = [str(r["batch"]), "does not fit", "-", "-", "-", "-", f"limit: {r['limit']}"]
        else:
            line = [str(r["batch"]), _fmt(r["ratio"], ".2f"), _fmt(r["throughput"], ",.0f"),
                    _fmt(r["per_request"], ".2f"), _fmt(r["step_ms"], ".1f"),
                    _fmt(r["hit_rate"], ".2%") if r["ess"] else "-", r["bottleneck"]]
        if published:
            ref, err = published.get(r["batch"]), errors.get(r["batch"])
            line += ([f"{ref['ratio']:.2f}", f"{ref['throughput']:,.0f}", f"{ref['per_request']:.2f}"]
                     if ref else ["-"] * 3)
            line += ([f"{err['throughput_error']:+.1%}", f"{err['per_request_error']:+.1%}"] if err else ["-"] * 2)
        lines.append(line)
    return headers, lines


def summary_lines(result: dict[str, Any]) -> list[str]:
    cap, sc = result["capacity"], result["scenario"]
    hw = result["hardware"]
    out = [
        f"scenario {sc['name']}: {sc['description']}",
        f"hardware {hw['name']} ({hw['description']}); compute efficiency {result['kernel_efficiency']:.4f}, "
        f"fp8 weight-streaming efficiency {result.get('fp8_weight_efficiency', float('nan')):.4f}; "
        f"throughput is output tokens/s per node ({hw['gpus_per_node']} GPUs), batch is requests per GPU",
        f"per GPU: weights {cap['weights_gib']:.1f} GiB, KV budget {cap['kv_budget_gib']:.1f} GiB, "
        f"{sc['serving']['context_tokens']:,}-token request = {cap['latent_per_request_gib']:.3f} GiB latent + "
        f"{cap['indexer_per_request_gib']:.3f} GiB indexer",
        f"largest batch without ESS: {cap['max_batch_without_ess']} (HBM capacity; continuous bound "
        f"{cap['requests_without_ess_continuous']:.2f})"
        + (f"; paper: {result['reference']['max_batch_without_ess_ref']}"
           if result.get("reference", {}).get("max_batch_without_ess_ref") else ""),
    ]
    if sc["ess"]["enabled"]:
        bounds = ", ".join(f"{k} {v}" for k, v in cap["ess_bounds"].items())
        out.append(f"largest batch with ESS: {cap['max_batch_with_ess']} (limited by "
                   f"{cap['max_batch_with_ess_limited_by']}; bounds: {bounds}; hot-pool floor ratio "
                   f"{cap['ratio_min']:.3f})")
    return out


def print_report(result: dict[str, Any], plain: bool = False, file: TextIO | None = None,
                 width: int | None = None) -> None:
    """The table and the capacity summary: a rich table on a terminal wide enough for it, else plain text."""
    import sys

    file = file or sys.stdout
    headers, lines = table_rows(result)
    widths = [max(len(h), *(len(r[i]) for r in lines)) for i, h in enumerate(headers)]
    console = None
    if not plain and hasattr(file, "isatty") and file.isatty():
        try:
            from rich.console import Console
        except ImportError:
            pass
        else:
            console = Console(file=file, width=width)
            if console.width < sum(widths) + 3 * len(widths) + 1:
                console = None  # too narrow: a squeezed table is unreadable
    if console is None:
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)), file=file)
        for r in lines:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)), file=file)
        for s in summary_lines(result):
            print(s, file=file)
        return
    from rich.table import Table

    table = Table(title=f"ess simulate: {result['scenario']['name']}")
    for h in headers:
        table.add_column(h, justify="right", no_wrap=True)
    for r in lines:
        table.add_row(*r)
    console.print(table)
    for s in summary_lines(result):
        console.print(s, highlight=False, soft_wrap=True)


def plot(result: dict[str, Any], path: Path) -> Path:
    """Throughput (tokens/s per node) against batch, without and with ESS, with the paper's points if any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    plain = result["sweep"]["without_ess"]
    ess = result["sweep"]["with_ess"]
    if ess:
        ax.plot([p["batch"] for p in ess], [p["throughput"] for p in ess], "-", color="tab:blue", label="with ESS")
    ideal = result["sweep"].get("without_ess_unlimited_hbm", [])
    if ideal:
        ax.plot([p["batch"] for p in ideal], [p["throughput"] for p in ideal], ":", color="tab:gray",
                label="without ESS if HBM were unlimited (ESS's cost is the gap)")
    if plain:
        ax.plot([p["batch"] for p in plain], [p["throughput"] for p in plain], "-", color="tab:gray", lw=2.5,
                label="without ESS (stops at the HBM capacity)")
        last = plain[-1]
        ax.plot([last["batch"]], [last["throughput"]], "o", color="tab:gray")
    ref = result.get("scenario", {}).get("reference")
    if ref:
        ax.plot([r["batch"] for r in ref["rows"]], [r["throughput"] for r in ref["rows"]], "x", color="tab:red",
                ms=8, label="paper")
    rows = [r for r in result["rows"] if r["fits"]]
    if rows:
        ax.plot([r["batch"] for r in rows], [r["throughput"] for r in rows], ".", color="black", ms=7,
                label="simulated table rows")
    ax.set_xlabel("batch (requests per GPU)")
    ax.set_ylabel("output tokens/s per node")
    sc = result["scenario"]
    ax.set_title(f"{sc['name']}: {sc['serving']['context_tokens'] // 1024}K context, {result['hardware']['name']}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
