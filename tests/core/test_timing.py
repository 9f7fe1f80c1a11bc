"""The interleaved timing helper, on a fake clock: order, warm-up, repeats, synchronisation,
stopping rules, errors, and the paired ratios with their interval."""

import random
import statistics

import pytest

from channels_last_algo.core.timing import FakeClock, Ratio, median_interval, synchronizer, time_interleaved


def _calls(clock, costs, log=None):
    def call(name):
        def run():
            if log is not None:
                log.append(name)
            clock.advance(costs[name])

        return run

    return {name: call(name) for name in costs}


def test_rounds_rotate_the_order_and_warmup_is_not_timed():
    clock, log = FakeClock(), []
    timings = time_interleaved(_calls(clock, {'a': 1.0, 'b': 2.0, 'c': 3.0}, log), rounds=3, warmup=2, timer=clock)
    assert log == list('abcbcacababcbca')
    assert timings.seconds == {'a': [1.0] * 3, 'b': [2.0] * 3, 'c': [3.0] * 3}
    assert (timings.rounds, timings.warmup, timings.stopped_by) == (3, 2, 'rounds')


def test_repeat_reports_seconds_per_call_and_prepare_is_untimed():
    clock, prepared = FakeClock(), []

    def prepare(name):
        prepared.append(name)
        clock.advance(100.0)  # e.g. restriding the model: must not count

    timings = time_interleaved(
        _calls(clock, {'a': 1.0, 'b': 3.0}), rounds=2, warmup=0, repeat=4, prepare=prepare, timer=clock
    )
    assert timings.seconds == {'a': [1.0, 1.0], 'b': [3.0, 3.0]} and timings.repeat == 4
    assert prepared == ['a', 'b', 'b', 'a']


def test_the_clock_is_read_after_synchronising():
    clock, events = FakeClock(), []

    def timer():
        events.append('read')
        return clock()

    time_interleaved(
        {'a': lambda: events.append('call')}, rounds=1, warmup=0, synchronize=lambda: events.append('sync'), timer=timer
    )
    assert events == ['sync', 'read', 'sync', 'read', 'call', 'sync', 'read']  # start of all, then one turn
    assert synchronizer('cpu') is None


def test_a_stop_rule_and_max_seconds_end_the_timing():
    clock = FakeClock()
    calls = _calls(clock, {'a': 1.0, 'b': 1.0})
    timings = time_interleaved(calls, rounds=50, warmup=0, stop=lambda t: t.rounds == 4, timer=clock)
    assert (timings.rounds, timings.stopped_by) == (4, 'stop')
    timings = time_interleaved(calls, rounds=50, warmup=1, max_seconds=9.5, timer=clock)
    assert (timings.rounds, timings.stopped_by) == (4, 'max_seconds')  # warm-up counts; 2 s a round
    timings = time_interleaved(calls, rounds=50, warmup=5, max_seconds=0, timer=clock)
    assert timings.rounds == 1  # one timed round is always taken


def test_a_failing_variant_is_recorded_and_dropped_when_caught():
    clock, calls_of_b = FakeClock(), []

    def broken():
        raise RuntimeError('oneDNN could not create a primitive\nmore lines')

    calls = {'a': lambda: clock.advance(1.0), 'b': lambda: calls_of_b.append(1) or broken()}
    timings = time_interleaved(calls, rounds=3, warmup=1, catch=True, timer=clock)
    assert timings.errors == {'b': 'RuntimeError: oneDNN could not create a primitive'}
    assert timings.seconds == {'a': [1.0] * 3, 'b': []} and len(calls_of_b) == 1
    with pytest.raises(RuntimeError, match='oneDNN'):
        time_interleaved(calls, rounds=1, timer=clock)
    with pytest.raises(ValueError, match='rounds >= 1'):
        time_interleaved(calls, rounds=0)


def test_paired_ratios_follow_the_rounds():
    clock = FakeClock()
    slow = iter([2.0, 8.0, 2.0, 2.0, 2.0, 2.0])  # a burst of load in round 2 hits both variants
    fast = iter([1.0, 4.0, 1.0, 1.0, 1.0, 1.0])
    timings = time_interleaved(
        {'slow': lambda: clock.advance(next(slow)), 'fast': lambda: clock.advance(next(fast))},
        rounds=6,
        warmup=0,
        timer=clock,
    )
    assert timings.ratios('slow', 'fast') == [2.0] * 6
    ratio = timings.ratio('slow', 'fast')
    assert (ratio.median, ratio.noise, ratio.interval, ratio.rounds) == (2.0, 0.0, (2.0, 2.0), 6)
    assert str(ratio) == '2.00x [2.00, 2.00]'
    assert timings.median('slow') == 2.0 and timings.min('fast') == 1.0


@pytest.mark.parametrize('n,confidence', [(6, 0.95), (11, 0.95), (30, 0.95), (30, 0.99), (9, 0.9)])
def test_the_median_interval_covers_the_median_as_often_as_it_claims(n, confidence):
    rng = random.Random(n)
    trials = 4000
    covered = sum(
        low <= 0.0 <= high
        for low, high in (median_interval([rng.gauss(0, 1) for _ in range(n)], confidence) for _ in range(trials))
    )
    assert covered / trials >= confidence - 0.01  # distribution-free: at least the claimed coverage
    assert median_interval([0.0] * (n - 1) + [1.0], confidence)[0] == 0.0


def test_the_median_interval_needs_enough_values():
    assert median_interval([1.0] * 5, 0.95) is None and median_interval([1.0] * 5, 0.9) == (1.0, 1.0)
    with pytest.raises(ValueError, match='confidence'):
        median_interval([1.0], 1.0)


@pytest.mark.parametrize(
    'interval,verdict',
    [
        ((1.03, 1.2), 'faster'),
        ((0.8, 0.97), 'slower'),
        ((0.99, 1.01), 'tie'),
        ((1.0, 1.1), 'unclear'),
        (None, 'unclear'),
    ],
)
def test_verdict_against_the_tie_band(interval, verdict):
    assert Ratio(1.0, 0.0, interval, 9, 0.95).verdict(margin=0.02) == verdict
    with pytest.raises(ValueError, match='margin'):
        Ratio(1.0, 0.0, interval, 9, 0.95).verdict(margin=-0.1)


def test_ratio_noise_is_half_the_interquartile_range():
    values = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7]
    q1, _, q3 = statistics.quantiles(values, n=4)
    assert Ratio.of(values).noise == pytest.approx((q3 - q1) / 2)
    with pytest.raises(ValueError, match='no paired rounds'):
        Ratio.of([])
