"""The scripts under tools/ are not a package: their tests load one by path."""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as a module (executed afresh on every call)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
