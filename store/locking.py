"""The store backends' method lock: one re-entrant lock per store object serialises its calls."""

from __future__ import annotations

import functools


def locked(method):
    """Run ``method`` holding ``self._lock`` (re-entrant: locked methods call each other)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper
