"""A measured speedup as the commands print it: the median of paired per-step ratios with its interval, and a
tie where that interval holds 1.0.

``demo`` and ``compare`` print their speedups with these words. The ratios and their intervals are
:meth:`~channels_last_algo.core.timing.Timings.ratio`'s: order statistics of the paired steps, so a run of
too few steps has no interval.

Example:
    >>> interval_words((0.97, 1.08), '--batches'), is_tie((0.97, 1.08)), is_tie((1.02, 1.08))
    ('95% interval 0.97x to 1.08x', True, False)
    >>> interval_words(None, '--steps')
    'too few steps for an interval (--steps 6 or more give one)'
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Optional

from channels_last_algo.core.timing import median_interval

__all__ = ['fewest_steps', 'interval_span', 'interval_words', 'is_tie']


def fewest_steps(confidence: float = 0.95) -> int:
    """The fewest paired steps whose ratios give an interval of their median at ``confidence``.

    Example:
        >>> fewest_steps(), fewest_steps(0.9)
        (6, 5)
    """
    return next(n for n in itertools.count(1) if median_interval([1.0] * n, confidence) is not None)


def interval_span(interval: Sequence[float]) -> str:
    """``(low, high)`` as ``'0.97x to 1.08x'``."""
    low, high = interval
    return f'{low:.2f}x to {high:.2f}x'


def interval_words(interval: Optional[Sequence[float]], steps_option: str, confidence: float = 0.95) -> str:
    """The interval of a speedup, or why there is none and the option (``steps_option``) that gives one."""
    if interval is None:
        return f'too few steps for an interval ({steps_option} {fewest_steps(confidence)} or more give one)'
    return f'{confidence:.0%} interval {interval_span(interval)}'


def is_tie(interval: Optional[Sequence[float]]) -> bool:
    """Whether the interval holds 1.0: at this noise neither side is faster."""
    return interval is not None and interval[0] <= 1.0 <= interval[1]
