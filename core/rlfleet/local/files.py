"""Files that hold credentials."""

from __future__ import annotations

from pathlib import Path


def write_secret(path: Path, text: str) -> None:
    """Writes a file only its owner can read: credentials, keys, tokens."""
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(text)
