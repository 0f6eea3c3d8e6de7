"""Validation of the simulator's YAML files: one error type whose lines name the offending field."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class SimulatorConfigError(ValueError):
    """A bad hardware or scenario file. Each line of the message starts with the field's dotted path."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def _path(root: str, loc: tuple[Any, ...]) -> str:
    out = root
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def validate(model: type[M], data: Any, root: str) -> M:
    """``model.model_validate(data)``, with every problem reported as ``<root>.<field>: <message>``."""
    if isinstance(data, model):
        return data
    if not isinstance(data, Mapping):
        raise SimulatorConfigError(f"{root}: expected a mapping, got {type(data).__name__}")
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown field (check the spelling; unknown fields are errors)"
            elif err["type"] == "missing":
                msg = "required field is missing"
            msg = msg.removeprefix("Value error, ")
            if "input" in err and err["type"] not in ("missing", "extra_forbidden") and "got" not in msg:
                msg += f" (got {err['input']!r})"
            lines.append(f"{_path(root, loc)}: {msg}")
        raise SimulatorConfigError(lines) from None


def read_yaml(path: str | Path, root: str) -> dict[str, Any]:
    """Load a YAML mapping; a missing file or a non-mapping top level is a SimulatorConfigError."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SimulatorConfigError(f"{root}: cannot read {p}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SimulatorConfigError(f"{root}: {p} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SimulatorConfigError(f"{root}: {p} must hold a mapping at the top level")
    return data
