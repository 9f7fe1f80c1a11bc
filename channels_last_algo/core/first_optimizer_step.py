"""The first step of an optimizer that is not torch's own, watched for code that flattens the weights.

A user's or a third party's optimizer may ``p.grad.view(-1)``, ``p.view(n, -1)`` or write through a
``.reshape()`` of a weight, its gradient or its state, which channels-last strides refuse (or turn
into a copy, silently). No list of known classes
(:mod:`~channels_last_algo.core.flattening_optimizers`) can name them all, so the first step of each
such optimizer runs under a :class:`~channels_last_algo.core.view_watch.ViewWatch`: the first such
use makes the weights, their gradients and the optimizer's state contiguous on the spot (``on_view``),
so that this very step goes on as in NCHW, and every later one runs unwatched. torch's own
optimizers (LBFGS excepted, a known row) never flatten. A closure the step is given (the forward and
backward, as Lightning passes them) runs with the watch paused: the guard's own watch follows those.

Example:
    >>> import torch
    >>> class PerFilter(torch.optim.SGD):
    ...     def step(self, closure=None):
    ...         for p in self.param_groups[0]['params']:
    ...             p.grad.view(len(p), -1).div_(2.0)
    ...         return super().step(closure)
    >>> conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    >>> conv(torch.randn(1, 3, 5, 5)).sum().backward()
    >>> from channels_last_algo.core.convert import apply_channels_first
    >>> optimizer, said = PerFilter([conv.weight], lr=0.1), []
    >>> def contiguous(why):                 # what the guard does: the weights, gradients, state
    ...     said.append(why)
    ...     _ = apply_channels_first(conv, optimizers=optimizer)
    >>> with FirstStep(optimizer, contiguous):
    ...     optimizer.step()
    >>> said, conv.weight.is_contiguous()
    (["PerFilter.step: a weight's gradient is viewed at <doctest ...>:4"], True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from channels_last_algo.core.module_calls import exit_mode, on_mode_stack
from channels_last_algo.core.view_watch import ViewWatch

__all__ = ['FirstStep', 'torch_step']


def torch_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s ``step`` is torch's own (a torch optimizer, or a subclass that keeps its step)."""
    defining = next(cls for cls in type(optimizer).__mro__ if 'step' in vars(cls))
    return defining.__module__.startswith('torch.')


class FirstStep:
    """A watch over one optimizer step (``with``, or :meth:`start` and :meth:`stop` from step hooks).

    ``on_view(why)`` is called once, at the first use of a weight, gradient or state tensor that needs
    it channels first, and must make them contiguous before it returns.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, on_view: Callable[[str], None]) -> None:
        self._name = type(optimizer).__name__
        self._params = [p for group in optimizer.param_groups for p in group['params']]
        self._on_view = on_view
        self._heard = False
        self._mode = ViewWatch(self)

    def start(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Watch from now on; the step's arguments (``self`` first, as step hooks get them), with its
        closure (if any) run unwatched."""
        self._mode.__enter__()
        if len(args) > 1 and callable(args[1]):
            return (args[0], self._unwatched(args[1]), *args[2:]), kwargs
        if callable(kwargs.get('closure')):
            return args, {**kwargs, 'closure': self._unwatched(kwargs['closure'])}
        return args, kwargs

    def stop(self) -> None:
        """Stop watching (where the step raised, at the next step or when the watch closes)."""
        exit_mode(self._mode)

    def __enter__(self) -> FirstStep:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _unwatched(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def closure_unwatched(*args: Any, **kwargs: Any) -> Any:
            watching = on_mode_stack(self._mode)
            exit_mode(self._mode)
            try:
                return closure(*args, **kwargs)
            finally:
                if watching:
                    self._mode.__enter__()

        return closure_unwatched

    # what the watch tells its owner: here, any such use is of a weight, its gradient or its state

    def _weights_viewed(self, why: str) -> bool:
        self._contiguous(why)
        return True

    def weight_gradient(self, tensor: torch.Tensor) -> bool:
        return any(tensor is p.grad for p in self._params)

    def _found(self, origins: frozenset, where: str, how: str) -> None:
        self._contiguous(f'a gradient or state tensor is {how}')

    def extension_found(self, name: str, where: str) -> None:
        self._contiguous(f'the extension op {name} at {where} takes 4D/5D weights, gradients or state')

    def _contiguous(self, why: str) -> None:
        if not self._heard:
            self._heard = True
            self._on_view(f'{self._name}.step: {why}')
