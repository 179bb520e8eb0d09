"""A confidence interval for a median from its samples alone: how far to trust a ratio.

A ratio's spread over repetitions (the A/A control's 0.85-1.30 on a noisy machine) says how far
one repetition can be off, not how far the median of many can be. The interval here is the
distribution-free one for a median (order statistics, binomial coverage): with n samples, the
k-th smallest and k-th largest bound the true median with probability 1 - 2 P(Binomial(n, 1/2)
< k), whatever the noise's shape, provided the samples are independent draws of the same
thing. k is the largest for which that probability is at least ``level``; the interval's true
coverage (at least ``level``) is returned with it. Fewer than six samples cannot reach 95%:
None then, rather than an interval that claims what it cannot.

A goal such as "the ring within 1.02x of its floor" is shown where the interval's upper end is
at or below 1.02, and missed where its lower end is above it; an interval that straddles it
means more samples (or a quieter machine). The A/A control (the same work timed twice) should
give an interval around 1.0: where it does not, the harness itself is biased.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb


@dataclass(frozen=True)
class MedianInterval:
    low: float
    high: float
    coverage: float  # the probability the interval holds the true median (>= the level asked)

    def __str__(self) -> str:
        return f"{self.low:.3f}-{self.high:.3f}"


def median_interval(samples: list[float], level: float = 0.95) -> MedianInterval | None:
    """The order-statistic interval for the median of ``samples`` at ``level``, or None when
    there are too few samples for it."""
    n = len(samples)
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    below = 0.0  # P(Binomial(n, 1/2) < k), for the k under test
    k = 0
    while k < n // 2:
        nxt = below + comb(n, k) / 2**n
        if 1 - 2 * nxt < level:
            break
        below, k = nxt, k + 1
    if k == 0:
        return None
    ordered = sorted(samples)
    return MedianInterval(ordered[k - 1], ordered[n - k], 1 - 2 * below)
