"""Fault injection for the stand-in: chosen requests answer an HTTP error, hang, or fail."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Fault:
    """Requests whose path contains ``path`` (``"*"``: any), from the ``nth`` (1-based) on, ``count``
    of them: ``action`` is an HTTP status to answer (429, 500, 503...), ``"hang"`` (hold the
    connection for ``hang_s`` seconds, or until the server stops, then drop it unanswered) or
    ``"request_failed"`` (accept the request, then fail its future with a server error)."""

    path: str
    nth: int = 1
    action: int | str = 500
    count: int = 1
    hang_s: float | None = None
    seen: int = 0
    hits: int = 0

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``PATH:NTH:ACTION[:COUNT]``, e.g. ``forward_backward:2:500`` or ``asample:1:429:3``."""
        parts = text.split(":")
        if len(parts) not in (3, 4) or not all(p.isdigit() and int(p) > 0 for p in parts[1::2]):
            raise ValueError(f"fault '{text}': expected PATH:NTH:ACTION[:COUNT] (NTH, COUNT: positive integers)")
        action: int | str = int(parts[2]) if parts[2].isdigit() else parts[2]
        if action not in ("hang", "request_failed") and not isinstance(action, int):
            raise ValueError(f"fault '{text}': ACTION is an HTTP status, 'hang' or 'request_failed'")
        return cls(parts[0], int(parts[1]), action, int(parts[3]) if len(parts) == 4 else 1)

    def matches(self, path: str) -> bool:
        if self.path != "*" and self.path not in path:
            return False
        self.seen += 1
        if self.nth <= self.seen < self.nth + self.count:
            self.hits += 1
            return True
        return False
