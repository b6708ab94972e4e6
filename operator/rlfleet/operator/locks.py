"""A lock per key, made on first use: per object in the handlers, per namespace in a region."""

from __future__ import annotations

import threading
from collections import defaultdict


class KeyedLocks:
    def __init__(self) -> None:
        self._locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._guard = threading.Lock()

    def of(self, key: str) -> threading.Lock:
        with self._guard:
            return self._locks[key]
