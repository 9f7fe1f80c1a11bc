"""Auto mode: time real training steps in both layouts and keep NCHW only where the evidence
says channels last is slower.

Channels last is not always faster (grouped convolutions on some cuDNN versions, fp32 on GPUs
without tensor cores, ConvNeXt on this kind of CPU). :func:`decide_layout` measures instead of
guessing: on the user's own model, device, precision and batch it times forward + backward
passes (no optimizer update) in NCHW and in channels last, in paired interleaved rounds (NCHW as the
model ran before its conversion: its swapped layers as their original classes,
:mod:`~channels_last_algo.core.layout_switch`), and
repeats rounds until the order-statistics interval of the median per-round ratio lies outside
the tie band ``[1 / (1 + margin), 1 + margin]`` (or inside it), at most ``max_rounds`` rounds
and ``max_seconds``. Channels last, the algorithm's purpose, is the default: NCHW is kept only
on evidence that channels last is slower; a tie, or no evidence within the bound, keeps
channels last and is recorded as a tie (docs/auto.md argues the choice). Everything a trial
step touches is put back: gradients, buffers (BatchNorm running statistics), what the modules count or
collect in attributes of their own (``self.calls += 1``, a list of losses, a metric's state), and the torch,
CUDA, Python and NumPy random states;
parameters and optimizer state are never updated, only restrided.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    >>> x = torch.randn(4, 3, 16, 16)
    >>> def step(channels_last):
    ...     inputs = x.to(memory_format=torch.channels_last) if channels_last else x
    ...     model(inputs).sum().backward()
    >>> decision = decide_layout(model, step, max_rounds=2)
    >>> decision.rounds, decision.tie, decision.stopped_by, model[1].num_batches_tracked.item()
    (2, True, 'max_rounds', 0)
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from channels_last_algo.core.convert import Optimizers, refuse_under_ddp
from channels_last_algo.core.layout import MemoryFormat
from channels_last_algo.core.layout_switch import LayoutSwitch
from channels_last_algo.core.saved_state import SavedState
from channels_last_algo.core.timing import Timings, synchronizer, time_interleaved

__all__ = ['LayoutDecision', 'decide_layout']

_FIRST, _LAST = MemoryFormat.CHANNELS_FIRST, MemoryFormat.CHANNELS_LAST


@dataclasses.dataclass
class LayoutDecision:
    """Which layout auto mode kept, the evidence it was decided on, and what deciding cost.

    Attributes:
        channels_last: True when channels last was kept, False for NCHW.
        tie: True when channels last was kept as the default, without evidence that it is
            faster: the interval lay inside the tie band, or the bound was reached first.
        interval: the interval of the median per-round speedup (NCHW time over channels-last
            time) at ``confidence``; None when the bound allowed too few rounds for one.
        nchw_seconds, channels_last_seconds: the step times of each paired round.
        margin: the tie band is speedups within ``[1 / (1 + margin), 1 + margin]``.
        confidence: the coverage of ``interval``.
        stopped_by: ``'evidence'``, ``'max_rounds'`` or ``'max_seconds'``.
        cost_seconds: wall time the decision took, warm-up and restoring included.
    """

    channels_last: bool
    tie: bool
    interval: Optional[tuple[float, float]]
    nchw_seconds: list[float]
    channels_last_seconds: list[float]
    margin: float
    confidence: float
    stopped_by: str
    cost_seconds: float

    @property
    def rounds(self) -> int:
        """Paired rounds timed."""
        return min(len(self.nchw_seconds), len(self.channels_last_seconds))

    @property
    def speedup(self) -> float:
        """The median over rounds of NCHW step time over channels-last step time."""
        return statistics.median(n / c for n, c in zip(self.nchw_seconds, self.channels_last_seconds))

    @property
    def layout(self) -> MemoryFormat:
        """The memory format kept."""
        return _LAST if self.channels_last else _FIRST

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayoutDecision:
        fields = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict) or sorted(data) != sorted(fields):
            raise ValueError(f'a layout decision needs exactly the keys {fields}, got {data!r}')
        interval = data['interval']
        return cls(**{**data, 'interval': None if interval is None else tuple(interval)})

    def __str__(self) -> str:
        interval = (
            'no interval yet'
            if self.interval is None
            else (f'{self.confidence:.0%} interval [{self.interval[0]:.2f}, {self.interval[1]:.2f}]')
        )
        why = (
            f'no evidence beyond the {self.margin:.0%} tie band, the default'
            if self.tie
            else f'beyond the {self.margin:.0%} tie band'
        )
        return (
            f'auto layout: kept {self.layout} ({why}); channels last {self.speedup:.2f}x vs channels first, {interval} '
            f'over {self.rounds} paired rounds, stopped by {self.stopped_by}; deciding took '
            f'{self.cost_seconds:.1f} s'
        )


@dataclasses.dataclass
class _Snapshot:
    grads: list[tuple[torch.nn.Parameter, Optional[torch.Tensor]]]
    state: SavedState  # random states, buffers, parameters a forward writes, what the step counts or collects

    @classmethod
    def take(cls, model: torch.nn.Module) -> _Snapshot:
        grads = [(p, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
        return cls(grads=grads, state=SavedState(model))

    def restore(self) -> None:
        with torch.no_grad():
            for p, grad in self.grads:
                p.grad = None if grad is None else torch.empty_like(p).copy_(grad)  # in p's layout
        self.state.restore()


@dataclasses.dataclass(frozen=True)
class _Rule:
    """What bounds the timing and what the evidence decides: rounds, time, the tie band."""

    warmup: int
    max_rounds: int
    max_seconds: float
    margin: float
    confidence: float

    def __post_init__(self) -> None:
        if self.max_rounds < 1 or self.warmup < 0 or not 0 <= self.margin < 1 or not 0 < self.confidence < 1:
            raise ValueError(
                f'need max_rounds >= 1, warmup >= 0, 0 <= margin < 1 and 0 < confidence < 1; got '
                f'max_rounds={self.max_rounds}, warmup={self.warmup}, margin={self.margin}, '
                f'confidence={self.confidence}'
            )

    def verdict(self, timings: Timings) -> str:
        """Channels last against NCHW: ``'faster'``, ``'slower'``, ``'tie'`` or ``'unclear'``."""
        return timings.ratio(_FIRST, _LAST, self.confidence).verdict(self.margin)

    def decided(self, timings: Timings) -> bool:
        return self.verdict(timings) != 'unclear'

    def decision(self, timings: Timings, cost_seconds: float) -> LayoutDecision:
        """The decision ``timings`` are evidence for; NCHW only when channels last is slower."""
        verdict = self.verdict(timings)
        stopped_by = {'stop': 'evidence', 'rounds': 'max_rounds'}.get(timings.stopped_by, timings.stopped_by)
        return LayoutDecision(
            channels_last=verdict != 'slower',
            tie=verdict in ('tie', 'unclear'),
            interval=timings.ratio(_FIRST, _LAST, self.confidence).interval,
            nchw_seconds=timings.seconds[_FIRST],
            channels_last_seconds=timings.seconds[_LAST],
            margin=self.margin,
            confidence=self.confidence,
            stopped_by=stopped_by,
            cost_seconds=cost_seconds,
        )


class _Trials:
    """The trial steps of one decision: the model put in either layout between them, the clock read
    after a CUDA device's queue drains, and everything a trial touches put back."""

    def __init__(self, model: torch.nn.Module, optimizers: Optimizers, timer: Callable[[], float]) -> None:
        refuse_under_ddp(model)  # once: the trials restride the weights in every round
        self.model, self.timer = model, timer
        self.layouts = LayoutSwitch(model, optimizers, outside_ddp=True)
        self.sync = synchronizer(next((p.device for p in model.parameters()), torch.device('cpu')))

    def now(self) -> float:
        if self.sync is not None:
            self.sync()
        return self.timer()

    def prepare(self, layout: str) -> None:
        """Drop the gradients and put the model (its weights, optimizer state and swapped layers) in ``layout``."""
        for p in self.model.parameters():
            p.grad = None
        self.layouts.put(layout == _LAST)

    def time(self, run_step: Callable[[bool], Any], rule: _Rule) -> Timings:
        """Both layouts timed until ``rule`` stops; the model left in the layout kept, as it was otherwise."""
        snapshot = _Snapshot.take(self.model)
        try:
            timings = time_interleaved(
                {_FIRST: lambda: run_step(False), _LAST: lambda: run_step(True)},
                rounds=rule.max_rounds,
                warmup=rule.warmup,
                prepare=self.prepare,
                synchronize=self.sync,
                stop=rule.decided,
                max_seconds=rule.max_seconds,
                timer=self.timer,
            )
            self.prepare(_FIRST if rule.verdict(timings) == 'slower' else _LAST)
        except BaseException:  # a step raised, or found the weights viewed: the swapped layers as they came
            self.layouts.swap(True)
            raise
        finally:
            snapshot.restore()
        return timings


def decide_layout(
    model: torch.nn.Module,
    run_step: Callable[[bool], Any],
    *,
    optimizers: Optimizers = None,
    warmup: int = 1,
    max_rounds: int = 60,
    max_seconds: float = 60.0,
    margin: float = 0.02,
    confidence: float = 0.95,
    timer: Callable[[], float] = time.perf_counter,
) -> LayoutDecision:
    """Time ``run_step(channels_last)`` in both layouts until the evidence decides; leave ``model`` in the layout kept.

    Args:
        model: the model; put in each layout between trials (restrided, its swapped layers swapped in for
            channels last and taken back for NCHW: :mod:`~channels_last_algo.core.layout_switch`) and left in the
            chosen one.
        run_step: runs one forward + loss + backward with the input in channels last when its argument is
            True, NCHW otherwise. It must not step the optimizer.
        optimizers: optimizers whose state is restrided with the parameters.
        warmup: untimed rounds first (allocator, oneDNN/cuDNN algorithm choice).
        max_rounds: paired rounds at most (at 95% confidence, 6 are needed for an interval).
        max_seconds: no new round starts after this much time (one round is always taken), so deciding
            costs a bounded time: at most this plus one round.
        margin: speedups within ``[1 / (1 + margin), 1 + margin]`` are a tie.
        confidence: the coverage of the interval of the median per-round speedup.
        timer: the clock; a CUDA model is synchronised before each reading.

    Returns:
        The :class:`LayoutDecision`; the model is left in its layout and otherwise as before.
    """
    rule = _Rule(warmup, max_rounds, max_seconds, margin, confidence)  # ValueError on bounds out of range
    trials = _Trials(model, optimizers, timer)
    begin = trials.now()
    timings = trials.time(run_step, rule)
    return rule.decision(timings, cost_seconds=trials.now() - begin)
