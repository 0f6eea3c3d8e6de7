"""The `ess` command: `ess demo`, `ess plan`, `ess simulate`.

Each subcommand lives in its own module, which provides `add_arguments(parser)` and `run(args) -> int`;
this file only wires them, and imports a module only when its subcommand runs (torch is slow to import).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "demo": ("ess_sglang.demo", "decode a small DSA model with and without ESS and check bit-identical outputs"),
    "plan": ("ess_sglang.capacity", "how many long-context requests fit, with and without ESS"),
    "simulate": ("ess_sglang.simulator.cli", "DeepSeek-V3.2 decode simulator: throughput and bottlenecks"),
    "profile": ("ess_sglang.profile_cmd", "per-layer misses from a top-k trace -> overlap profile (sync / DA / DBA)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ess", description="ESS: lossless latent-cache offload for DSA decode")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
