"""Interleaved timing: time several ways of doing the same work, round by round, and compare
them by paired per-round ratios with an interval that says how far the noise reaches.

:func:`time_interleaved` runs warm-up rounds, then timed rounds; each round calls every
variant once (``repeat`` times in a row, timed together), in an order rotated from round to
round, so that load from other work on the machine and the cost of following another
variant fall on all of them alike. The clock is read after ``synchronize`` (the GPU's queue,
or a barrier across ranks). :meth:`Timings.ratio` pairs the rounds of two variants: the
median of the per-round ratios, half their interquartile range as the noise, and a
distribution-free interval of the median from order statistics (no random resampling, so
measuring leaves the random state alone).

Example (a fake clock: ``fast`` takes 1 s, ``slow`` 2 s):
    >>> clock = FakeClock()
    >>> calls = {'slow': lambda: clock.advance(2.0), 'fast': lambda: clock.advance(1.0)}
    >>> timings = time_interleaved(calls, rounds=6, warmup=1, timer=clock)
    >>> timings.median('slow'), timings.min('fast'), timings.rounds
    (2.0, 1.0, 6)
    >>> ratio = timings.ratio('slow', 'fast')    # above 1: 'fast' is faster than 'slow'
    >>> ratio.median, ratio.interval, ratio.verdict(margin=0.02)
    (2.0, (2.0, 2.0), 'faster')
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch

__all__ = ['FakeClock', 'Ratio', 'Timings', 'median_interval', 'synchronizer', 'time_interleaved']


class FakeClock:
    """A clock for tests and examples: it stands still until :meth:`advance` moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __call__(self) -> float:
        return self.now


def median_interval(values: list[float], confidence: float = 0.95) -> Optional[tuple[float, float]]:
    """The order-statistics interval ``(x_(k), x_(n+1-k))`` that holds the median of the
    distribution ``values`` were drawn from with probability at least ``confidence``; None when
    there are too few values for that (fewer than 6 at 95%, 5 at 90%).

    Example:
        >>> median_interval([1.0, 2.0, 3.0, 4.0, 5.0])
        >>> median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
        (1.0, 6.0)
        >>> median_interval(list(range(20)))
        (5, 14)
    """
    if not 0 < confidence < 1:
        raise ValueError(f'confidence must be between 0 and 1, got {confidence}')
    n, ordered = len(values), sorted(values)
    tail, below, k = (1 - confidence) / 2, 0.0, 0
    while k < n // 2:  # largest k with P(Binomial(n, 1/2) <= k - 1) <= tail
        below += math.comb(n, k) / 2**n
        if below > tail:
            break
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k else None


@dataclasses.dataclass(frozen=True)
class Ratio:
    """Paired per-round ratios ``reference / other`` of step times (above 1: other is faster).

    Attributes:
        median: the median of the per-round ratios.
        noise: half their interquartile range.
        interval: the interval of the median at ``confidence`` (None: too few rounds).
        rounds: the number of paired rounds.
    """

    median: float
    noise: float
    interval: Optional[tuple[float, float]]
    rounds: int
    confidence: float

    @classmethod
    def of(cls, ratios: list[float], confidence: float = 0.95) -> Ratio:
        if not ratios:
            raise ValueError('no paired rounds to compare')
        low, high = statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else (ratios[0], ratios[0])
        return cls(
            statistics.median(ratios), (high - low) / 2, median_interval(ratios, confidence), len(ratios), confidence
        )

    def verdict(self, margin: float) -> str:
        """``'faster'`` or ``'slower'`` (the other against the reference) when the interval lies
        beyond the tie band ``[1 / (1 + margin), 1 + margin]``; ``'tie'`` when it lies inside;
        ``'unclear'`` when it straddles an edge of the band or there are too few rounds.

        Example:
            >>> Ratio(1.3, 0.1, (1.1, 1.5), 9, 0.95).verdict(0.02), Ratio(1.0, 0.1, (0.9, 1.1), 9, 0.95).verdict(0.02)
            ('faster', 'unclear')
        """
        if margin < 0:
            raise ValueError(f'margin must be >= 0, got {margin}')
        if self.interval is None:
            return 'unclear'
        low, high = self.interval
        if low > 1 + margin:
            return 'faster'
        if high < 1 / (1 + margin):
            return 'slower'
        if low >= 1 / (1 + margin) and high <= 1 + margin:
            return 'tie'
        return 'unclear'

    def __str__(self) -> str:
        spread = '' if self.interval is None else f' [{self.interval[0]:.2f}, {self.interval[1]:.2f}]'
        return f'{self.median:.2f}x{spread}'


@dataclasses.dataclass
class Timings:
    """What :func:`time_interleaved` measured: seconds per call of each variant, one entry per
    timed round, and the error of any variant that raised (with ``catch=True``)."""

    seconds: dict[str, list[float]]
    errors: dict[str, str]
    warmup: int
    repeat: int
    stopped_by: str  # 'rounds', 'stop' (the caller's rule) or 'max_seconds'

    @property
    def rounds(self) -> int:
        """Timed rounds (those of a variant that failed may be fewer)."""
        return max((len(s) for s in self.seconds.values()), default=0)

    def min(self, name: str) -> float:
        return min(self.seconds[name])

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def ratios(self, reference: str, other: str) -> list[float]:
        """``reference``'s time over ``other``'s in each round both were timed."""
        return [r / o for r, o in zip(self.seconds[reference], self.seconds[other])]

    def ratio(self, reference: str, other: str, confidence: float = 0.95) -> Ratio:
        """The paired comparison of ``other`` against ``reference`` (above 1: ``other`` is faster)."""
        return Ratio.of(self.ratios(reference, other), confidence)


def synchronizer(device: Any) -> Optional[Callable[[], None]]:
    """What to call before reading the clock on ``device``: CUDA's queue must drain first.

    Example:
        >>> synchronizer('cpu') is None
        True
    """
    device = torch.device(device)
    return (lambda: torch.cuda.synchronize(device)) if device.type == 'cuda' else None


class _Interleaved:
    """One interleaved timing under way: the variants, how a turn of one is prepared, run and
    clocked, and the timings so far."""

    def __init__(
        self,
        calls: Mapping[str, Callable[[], Any]],
        timings: Timings,
        prepare: Optional[Callable[[str], Any]],
        synchronize: Optional[Callable[[], Any]],
        catch: bool,
        timer: Callable[[], float],
    ) -> None:
        self.calls, self.names, self.timings = calls, list(calls), timings
        self.prepare, self.synchronize, self.catch, self.timer = prepare, synchronize, catch, timer

    def read(self) -> float:
        """The clock, after ``synchronize``."""
        if self.synchronize is not None:
            self.synchronize()
        return self.timer()

    def turn(self, name: str) -> Optional[float]:
        """Seconds per call of ``name`` in one turn; None when it raised and ``catch`` recorded the error."""
        if self.prepare is not None:
            self.prepare(name)
        start = self.read()
        try:
            for _ in range(self.timings.repeat):
                self.calls[name]()
        except Exception as error:
            if not self.catch:
                raise
            self.timings.errors[name] = f'{type(error).__name__}: {error}'.splitlines()[0][:300]
            return None
        return (self.read() - start) / self.timings.repeat

    def round(self, index: int, timed: bool) -> None:
        """Every variant that has not failed, once, in an order rotated by ``index``; kept when ``timed``."""
        shift = index % len(self.names)
        for name in self.names[shift:] + self.names[:shift]:
            if name not in self.timings.errors:
                elapsed = self.turn(name)
                if timed and elapsed is not None:
                    self.timings.seconds[name].append(elapsed)

    def run(self, rounds: int, stop: Optional[Callable[[Timings], bool]], max_seconds: Optional[float]) -> Timings:
        """The warm-up rounds, then timed rounds until ``rounds``, ``stop`` or ``max_seconds`` ends them."""
        timings, warmup = self.timings, self.timings.warmup
        begin = self.read()
        for index in range(warmup + rounds):
            timed = index >= warmup
            if timed and index > warmup and max_seconds is not None and self.read() - begin > max_seconds:
                timings.stopped_by = 'max_seconds'
                break
            self.round(index, timed)
            if timed and stop is not None and stop(timings):
                timings.stopped_by = 'stop'
                break
        return timings


def time_interleaved(
    calls: Mapping[str, Callable[[], Any]],
    *,
    rounds: int,
    warmup: int = 1,
    repeat: int = 1,
    prepare: Optional[Callable[[str], Any]] = None,
    synchronize: Optional[Callable[[], Any]] = None,
    stop: Optional[Callable[[Timings], bool]] = None,
    max_seconds: Optional[float] = None,
    catch: bool = False,
    timer: Callable[[], float] = time.perf_counter,
) -> Timings:
    """Time every call in ``calls``, interleaved, for ``rounds`` rounds after ``warmup`` rounds.

    Args:
        calls: the variants by name; each call does the work once.
        rounds: timed rounds at most; round ``i`` starts at variant ``i mod len(calls)``.
        warmup: untimed rounds first (allocator, oneDNN/cuDNN algorithm choice, caches).
        repeat: calls per variant and round, timed together; the time recorded is per call.
        prepare: called untimed with the variant's name before each of its turns.
        synchronize: called before each clock reading (see :func:`synchronizer`).
        stop: called with the timings after each timed round; True ends the timing.
        max_seconds: no new round starts once this much time has passed since the start,
            warm-up included (one timed round is always taken).
        catch: a variant that raises is recorded in ``errors`` and left out from then on,
            instead of the error propagating.
        timer: the clock.
    """
    if rounds < 1 or warmup < 0 or repeat < 1 or not calls:
        raise ValueError(
            f'need variants, rounds >= 1, warmup >= 0 and repeat >= 1; got {len(calls)} variants, '
            f'rounds={rounds}, warmup={warmup}, repeat={repeat}'
        )
    timings = Timings({name: [] for name in calls}, {}, warmup, repeat, 'rounds')
    return _Interleaved(calls, timings, prepare, synchronize, catch, timer).run(rounds, stop, max_seconds)
