"""Auto mode: time real training steps in both layouts and keep channels last only where it wins.

Channels last is not always faster (grouped convolutions on some cuDNN versions, fp32 on GPUs
without tensor cores, ConvNeXt on this kind of CPU). :func:`decide_layout` measures instead
of guessing: on the user's own model, device, precision and batch it times a few forward +
backward passes (no optimizer update) in NCHW and in channels last, interleaved, and leaves
the model in channels last only when that is faster by more than ``margin``. Everything a
trial step touches is put back: gradients, buffers (BatchNorm running statistics), and the
torch, CUDA, Python and NumPy random states; parameters and optimizer state are never
updated, only restrided.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    >>> x = torch.randn(4, 3, 16, 16)
    >>> def step(channels_last):
    ...     inputs = x.to(memory_format=torch.channels_last) if channels_last else x
    ...     model(inputs).sum().backward()
    >>> decision = decide_layout(model, step, steps=2)
    >>> decision.steps, model[1].num_batches_tracked.item()
    (2, 0)
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from channels_last_algo.core.convert import restride

__all__ = ['LayoutDecision', 'decide_layout']

Optimizers = Optional[Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]]


@dataclasses.dataclass
class LayoutDecision:
    """Which layout auto mode kept, and the timings it was decided from.

    Attributes:
        channels_last: True when channels last was kept, False for NCHW.
        nchw_seconds, channels_last_seconds: the timed steps of each layout.
        margin: how much faster channels last had to be (0.02: 2%) to be kept.
        cost_seconds: wall time the decision took, warm-up and restoring included.
    """

    channels_last: bool
    nchw_seconds: list[float]
    channels_last_seconds: list[float]
    margin: float
    cost_seconds: float

    @property
    def steps(self) -> int:
        """Timed steps per layout."""
        return min(len(self.nchw_seconds), len(self.channels_last_seconds))

    @property
    def speedup(self) -> float:
        """Median NCHW step time over median channels-last step time."""
        return statistics.median(self.nchw_seconds) / statistics.median(self.channels_last_seconds)

    @property
    def layout(self) -> str:
        return 'channels last' if self.channels_last else 'NCHW'

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> 'LayoutDecision':
        fields = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict) or sorted(data) != sorted(fields):
            raise ValueError(f'a layout decision needs exactly the keys {fields}, got {data!r}')
        return cls(**data)

    def __str__(self) -> str:
        nchw, cl = statistics.median(self.nchw_seconds), statistics.median(self.channels_last_seconds)
        return (f'auto layout: kept {self.layout}; channels last {self.speedup:.2f}x vs NCHW '
                f'(median step {cl * 1e3:.1f} ms vs {nchw * 1e3:.1f} ms over {self.steps} steps each, '
                f'margin {self.margin:.0%}); deciding took {self.cost_seconds:.1f} s')


@dataclasses.dataclass
class _Snapshot:
    grads: list[Optional[torch.Tensor]]
    buffers: list[torch.Tensor]
    rng: tuple[Any, ...]

    @classmethod
    def take(cls, model: torch.nn.Module) -> '_Snapshot':
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return cls(
            grads=[None if p.grad is None else p.grad.clone() for p in model.parameters()],
            buffers=[b.clone() for b in model.buffers()],
            rng=(torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()),
        )

    def restore(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for p, grad in zip(model.parameters(), self.grads):
                p.grad = None if grad is None else torch.empty_like(p).copy_(grad)  # in p's layout
            for buffer, saved in zip(model.buffers(), self.buffers):
                buffer.copy_(saved)
        torch_rng, cuda_rng, python_rng, numpy_rng = self.rng
        torch.set_rng_state(torch_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)


def decide_layout(
    model: torch.nn.Module,
    run_step: Callable[[bool], Any],
    *,
    optimizers: Optimizers = None,
    steps: int = 3,
    warmup: int = 1,
    margin: float = 0.02,
    max_seconds: float = 120.0,
    timer: Callable[[], float] = time.perf_counter,
) -> LayoutDecision:
    """Time ``run_step(channels_last)`` in both layouts and leave ``model`` in the faster.

    Args:
        model: the model; restrided in place between trials and left in the chosen layout.
        run_step: runs one forward + loss + backward with the input in channels last when
            its argument is True, NCHW otherwise. It must not step the optimizer.
        optimizers: optimizers whose state is restrided with the parameters.
        steps: timed steps per layout, interleaved NCHW / channels last.
        warmup: untimed steps per layout first (allocator, oneDNN/cuDNN algorithm choice).
        margin: channels last is kept only when its median step is this much faster.
        max_seconds: stop timing once this much time has passed (at least one timed step
            per layout is always taken), so deciding costs a bounded time.
        timer: the clock; a CUDA model is synchronised before each reading.

    Returns:
        The :class:`LayoutDecision`; the model is left in its layout and otherwise as before.
    """
    if steps < 1 or warmup < 0 or not 0 <= margin < 1:
        raise ValueError(f'need steps >= 1, warmup >= 0 and 0 <= margin < 1; got steps={steps}, '
                         f'warmup={warmup}, margin={margin}')
    cuda = any(p.is_cuda for p in model.parameters())

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize()
        return timer()

    def trial(channels_last: bool) -> float:
        restride(model, channels_last, optimizers)
        start = clock()
        run_step(channels_last)
        elapsed = clock() - start
        for p in model.parameters():
            p.grad = None
        return elapsed

    begin = clock()
    snapshot = _Snapshot.take(model)
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(warmup):
            trial(False)
            trial(True)
        for index in range(steps):
            if index and clock() - begin > max_seconds:
                break
            for layout in (False, True):
                times[layout].append(trial(layout))
        keep = statistics.median(times[True]) < (1 - margin) * statistics.median(times[False])
        restride(model, keep, optimizers)
    finally:
        snapshot.restore(model)
    return LayoutDecision(channels_last=keep, nchw_seconds=times[False], channels_last_seconds=times[True],
                          margin=margin, cost_seconds=clock() - begin)
