"""``ess simulate``: run a scenario, print the table, write JSON and a plot.

    ess simulate                                   # the ESS paper's setup (configs/scenarios/paper-32k.yaml)
    ess simulate --scenario configs/scenarios/paper-128k.yaml --out results/
    ess simulate --batches 64,128 --plain --no-plot
    ess simulate --validate benchmarks/results/serving/h200_32k/serving.json   # against a real server's steps
    ess simulate --validate                        # every stored serving run (benchmarks/results/serving/*/)

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
    parser.add_argument("--validate", type=Path, nargs="*", default=None, metavar="SERVING_JSON",
                        help="predict every decode step measured by benchmarks/serving.py (its serving.json files; "
                             "none named: every benchmarks/results/serving/*/serving.json of the checkout) and print "
                             "prediction, measurement and error, instead of running a scenario")
    parser.add_argument("--model-config", type=Path, default=None,
                        help="with --validate: the served model's config.json (default: "
                             "configs/models/deepseek-v32-small/config.json)")
    parser.add_argument("--hardware", default=None,
                        help="with --validate: hardware preset or YAML file (default: the preset of the GPU each "
                             "serving.json names, h200 or h100)")
    parser.add_argument("--routing", choices=("identical", "uniform"), default="identical",
                        help="with --validate: how the served model routes a batch's tokens to experts (default: "
                             "identical, what the serving runs' dummy weights do; uniform: a real model's)")


def run_validate(args: argparse.Namespace) -> int:
    from ess_sglang.simulator.calibration import FP8_WEIGHT_EFFICIENCY, KERNEL_EFFICIENCY
    from ess_sglang.simulator.errors import SimulatorConfigError
    from ess_sglang.simulator.hardware import load_hardware
    from ess_sglang.simulator.validate import arch_from_hf_config, print_checks, validate_serving

    root = Path(__file__).resolve().parents[2]
    model = args.model_config or root / "configs" / "models" / "deepseek-v32-small" / "config.json"
    sources = list(args.validate) or sorted((root / "benchmarks" / "results" / "serving").glob("*/serving.json"))
    if not sources:
        print("ess simulate: --validate: no serving.json named and none stored in the checkout", file=sys.stderr)
        return 2
    try:
        arch = arch_from_hf_config(model)
        hw = load_hardware(args.hardware) if args.hardware else None
        checks = validate_serving(sources, arch, hw, KERNEL_EFFICIENCY, args.routing)
    except SimulatorConfigError as exc:
        print(f"ess simulate: {exc}", file=sys.stderr)
        return 2
    print(f"model {model} ({arch.num_layers} layers, {arch.num_routed_experts} experts, "
          f"{'fp8' if arch.weight_bytes == 1 else 'bf16'} weights, {args.routing} routing), hardware "
          f"{hw.name if hw else 'per run'}, compute efficiency {KERNEL_EFFICIENCY}")
    print_checks(checks)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "validate.json"
    path.write_text(json.dumps(dict(model=str(model), hardware=hw.name if hw else None, routing=args.routing,
                                    kernel_efficiency=KERNEL_EFFICIENCY, fp8_weight_efficiency=FP8_WEIGHT_EFFICIENCY,
                                    sources=[str(p) for p in sources],
                                    checks=[c.to_dict() for c in checks]), indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    from ess_sglang.simulator.errors import SimulatorConfigError

    if args.validate is not None:
        return run_validate(args)
    from ess_sglang.simulator.report import plot, print_report
    from ess_sglang.simulator.scenario import load_scenario
    from ess_sglang.simulator.simulate import run_scenario

    try:  # the scenario's files, then its miss profile (read when the simulator is built)
        loaded = load_scenario(args.scenario)
        if args.batches:
            loaded.scenario = loaded.scenario.model_copy(update={"batches": args.batches})
        result = run_scenario(loaded)
    except SimulatorConfigError as exc:
        print(f"ess simulate: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
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
