"""``ess simulate``: run a scenario, print the table, write JSON and a plot.

    ess simulate                                   # the ESS paper's setup (configs/scenarios/paper-32k.yaml)
    ess simulate --scenario configs/scenarios/paper-128k.yaml --out results/
    ess simulate --batches 64,128 --plain --no-plot

Writes ``<out>/<scenario name>.json`` (every row with its time breakdown, the capacity arithmetic, the sweep
and the comparison with the scenario's reference numbers) and ``<out>/<scenario name>.png`` (throughput
against batch, with and without ESS). Top level imports stay light: no torch, matplotlib only when plotting.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _batches(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes like 52,64,96 (got {text!r})") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers (got {text!r})")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", type=Path, default=None,
                        help="scenario YAML (default: configs/scenarios/paper-32k.yaml, the ESS paper's setup)")
    parser.add_argument("--out", type=Path, default=Path("simulate_out"),
                        help="folder for <scenario>.json and <scenario>.png (default: ./simulate_out)")
    parser.add_argument("--batches", type=_batches, default=None,
                        help="comma-separated batches (requests per GPU) for the table, instead of the scenario's")
    parser.add_argument("--plain", action="store_true", help="plain-text table (no rich)")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")


def run(args: argparse.Namespace) -> int:
    from ess_sglang.simulator.errors import SimulatorConfigError
    from ess_sglang.simulator.report import plot, print_report
    from ess_sglang.simulator.scenario import load_scenario
    from ess_sglang.simulator.simulate import run_scenario

    try:
        loaded = load_scenario(args.scenario)
    except SimulatorConfigError as exc:
        print(f"ess simulate: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    if args.batches:
        loaded.scenario = loaded.scenario.model_copy(update={"batches": args.batches})
    result = run_scenario(loaded)
    print_report(result, plain=args.plain)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    name = loaded.scenario.name
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {json_path}")
    if not args.no_plot:
        try:
            png = plot(result, out / f"{name}.png")
        except ImportError:
            print("matplotlib is not installed (pip install matplotlib): no plot written", file=sys.stderr)
        else:
            print(f"wrote {png}")
    return 0
