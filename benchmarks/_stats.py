"""The one summary every benchmark reports: per-round ratios to a baseline."""

from __future__ import annotations

import statistics


def ratio_summary(times: list[float], base: list[float], digits: int = 3) -> str:
    """`median [min, max]` of the per-round ratios `times[i] / base[i]`."""
    r = [a / b for a, b in zip(times, base, strict=True)]
    return (
        f"{statistics.median(r):.{digits}f} [{min(r):.{digits}f}, {max(r):.{digits}f}]"
    )
