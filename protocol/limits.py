"""Per-tenant submission limits kept in Redis, shared by every producer of a tenant.

- ``{p}:tenant:{t}:bucket``   hash: tokens, at (a token bucket, ``take.lua``)
"""

from __future__ import annotations

from .scripts import StoreBase


class Limits(StoreBase):
    def take_tokens(
        self, tenant: str, n: int, rate: float, burst: int, now: float | None = None
    ) -> float:
        """Take ``n`` submissions from ``tenant``'s token bucket (shared by all its producers):
        0 if taken, else the seconds to wait before asking again. ``now``: a clock of the
        caller's (tests); by default Redis's own, the same for every producer."""
        key = f"{self.prefix}:tenant:{tenant}:bucket"
        args = [rate, burst, n, "" if now is None else repr(now)]
        return int(self.lua["take"](keys=[key], args=args)) / 1000
