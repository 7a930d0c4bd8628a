"""Summary statistics the runtime reports (ControlLoop's p50/p99) and the bench reuses.

It lives in the runtime, not in bench/, so that `import capsule` never loads the bench
package (or tqdm): bench imports from here, never the other way round.
"""
from __future__ import annotations

import math
from typing import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); no interpolation, so p99 of few samples is the max."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in 0..100, got {q}")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
