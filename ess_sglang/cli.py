"""The `ess` command: `ess demo`, `ess plan`, `ess simulate`, `ess profile`.

Each subcommand lives in its own module, which provides `add_arguments(parser)` and `run(args) -> int`; this file
wires them. Subcommand modules keep their top-level imports light (torch is imported inside `run`).

Bad input never ends in a traceback: a bad flag value (argparse, or a subcommand's own check raising `FlagError`)
prints one line, ``ess <command>: <flag>: <what is wrong and what to change>``, on stderr, and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys

from ess_sglang import __version__

SUBCOMMANDS = {
    "demo": ("ess_sglang.demo", "decode a small DSA model with and without ESS and check bit-identical outputs"),
    "plan": ("ess_sglang.capacity", "how many long-context requests fit, with and without ESS"),
    "simulate": ("ess_sglang.simulator.cli", "DeepSeek-V3.2 decode simulator: throughput and bottlenecks"),
    "profile": ("ess_sglang.profile_cmd", "per-layer misses from a top-k trace -> overlap profile (sync / DBA)"),
}

USAGE_ERROR = 2


class FlagError(Exception):
    """A bad flag value or an impossible combination of flags; ``flag`` as the user types it (``--ratio``)."""

    def __init__(self, flag: str | None, message: str):
        self.flag, self.message = flag, message
        super().__init__(f"{flag}: {message}" if flag else message)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and names the help command."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        message = " ".join(message.replace("argument ", "", 1).split())
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see '{self.prog} --help')\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help text already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in text.lower():
            return text
        if action.nargs == 0:  # store_true / store_false
            shown = "on" if action.default else "off"
        elif action.default is None:
            shown = "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


# ------------------------------------------------------------------------------------- argparse value types

def _number(kind, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") \
            from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_at_least(low: int):
    """argparse type: an integer >= low."""

    def parse(text: str) -> int:
        value = _number(int, text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return value

    return parse


def int_in(low: int, high: int):
    """argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        value = _number(int, text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got {text}")
        return value

    return parse


def float_in(low: float, high: float | None = None, low_open: bool = False):
    """argparse type: a finite number >= low (> low with low_open), <= high when given."""

    def parse(text: str) -> float:
        value = _number(float, text)
        if value < low or (low_open and value == low) or (high is not None and value > high):
            lo = f"{'(' if low_open else '['}{low:g}"
            need = f"in {lo}, {high:g}]" if high is not None else (f"> {low:g}" if low_open else f">= {low:g}")
            raise argparse.ArgumentTypeError(f"must be {need}, got {text}")
        return value

    return parse


# ------------------------------------------------------------------------------------- the command

def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ess", description="ESS: lossless latent-cache offload for DSA decode",
                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"ess {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}",
                                parser_class=_Parser)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except FlagError as exc:
        print(f"ess {args.command}: {exc}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
