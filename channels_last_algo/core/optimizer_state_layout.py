"""Optimizer state in its parameter's layout, before every optimizer step while a converted model lives.

torch's fused optimizers on the CPU (``Adam``, ``AdamW``, ``SGD``, ``Adagrad`` with ``fused=True``, torch 2.7
to 2.14 at least) walk each parameter, its gradient and its state in memory order and never compare
their strides: given NHWC weights and an NCHW gradient or momentum they add each to another element,
silently (on CUDA they raise "must have same dtype, device, and layout"). The state and the gradient end
up in other strides than their parameter's whenever the one is restrided without the other:

- ``Optimizer.load_state_dict`` brings a checkpoint's NCHW tensors into a channels-last run (a resume in a
  plain loop that does not call :meth:`~channels_last_algo.core.guard.LayoutGuard.on_load`);
- the weights are made contiguous after the optimizer took state (the guard does so where code first
  ``.view()``s a weight or its gradient in a later step);
- ``apply_channels_last(model)`` runs after the optimizer's first steps, without ``optimizers=``;
- a gradient is summed from a convolution's NHWC one and a channels-first one of code that viewed the weight.

:func:`keep_state_in_weight_layout` installs one process-wide step pre-hook, which restrides (in place,
values unchanged) every gradient and state tensor shaped like its 4D/5D parameter whose strides differ.
For a step that may read memory in order (``fused=True``, or a step that is not torch's own: a third
party's kernels) it does so before every step, and again after the closure the step is given (the
forward and backward that Composer and Lightning pass); that costs a stride comparison per 4D/5D
tensor, 30-100 us a step (``benchmarks/optimizer_state_layout.py``). torch's other steps compute right
on any strides, only slower: for them it does so once after each ``load_state_dict``. Nothing runs once
no converted model lives. A tensor that shares its memory (a view into a flat buffer, DDP's gradient
buckets) keeps it.

Example:
    >>> weight = torch.nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))
    >>> optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    >>> optimizer.state[weight]['momentum_buffer'] = torch.ones(4, 3, 2, 2)   # NCHW, as a checkpoint has it
    >>> match_state_to_weights(optimizer)
    1
    >>> optimizer.state[weight]['momentum_buffer'].stride() == weight.stride()
    True
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.nn.parameter import is_lazy
from torch.optim.optimizer import register_optimizer_step_pre_hook

from channels_last_algo.core.first_optimizer_step import torch_step
from channels_last_algo.core.layout import channels_last_format
from channels_last_algo.core.process_sharing import shared_between_processes

__all__ = ['keep_state_in_weight_layout', 'match_state_to_weights']

_holders = [0]  # converted models alive: the hook does nothing at 0
_hook: list[Any] = []  # its handle, once installed (it stays: torch walks its hook table during a step)
_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> the state object its last step had
_weights_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (its groups, its 4D/5D parameters)


def keep_state_in_weight_layout(model: torch.nn.Module) -> None:
    """While ``model`` lives, every optimizer's state in its parameters' strides before each step."""
    _holders[0] += 1
    weakref.finalize(model, _release)
    if not _hook:
        _hook.append(register_optimizer_step_pre_hook(_before_step))


def _release() -> None:
    _holders[0] -= 1


def _stride_blind(optimizer: torch.optim.Optimizer) -> bool:
    """A step that may read memory in order: torch's fused kernels, or a step that is not torch's own."""
    return not torch_step(optimizer) or any(group.get('fused') for group in optimizer.param_groups)


def _loaded(optimizer: torch.optim.Optimizer) -> bool:
    """``optimizer`` has another state object than at its last step (``load_state_dict`` makes a new one); True for
    an optimizer no weak table can hold (unhashable, or without ``__weakref__``)."""
    try:
        if _states.get(optimizer) is optimizer.state:
            return False
        _states[optimizer] = optimizer.state
    except TypeError:
        pass
    return True


def _before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """Match now where the step is stride-blind or the state was loaded since its last step; for a stride-blind
    step, again after the closure it is given (Composer's and Lightning's forward and backward, which may restride
    the weights or make their gradients). torch's other steps compute right on any strides, only slower."""
    if not _holders[0] or torch.compiler.is_compiling():
        return None
    blind = _stride_blind(optimizer)
    if blind or _loaded(optimizer):
        match_state_to_weights(optimizer)
    closure = kwargs['closure'] if 'closure' in kwargs else args[1] if len(args) > 1 else None  # args[0]: the optimizer
    if not blind or not callable(closure):
        return None

    def closure_then_match(*closure_args: Any, **closure_kwargs: Any) -> Any:
        result = closure(*closure_args, **closure_kwargs)
        match_state_to_weights(optimizer)
        return result

    if 'closure' in kwargs:
        return args, {**kwargs, 'closure': closure_then_match}
    return (args[0], closure_then_match, *args[2:]), kwargs


def match_state_to_weights(optimizer: torch.optim.Optimizer) -> int:
    """Restride, in place, each gradient and state tensor of ``optimizer`` that has its 4D/5D parameter's shape but
    not its strides, to the parameter's strides; how many were."""
    state, count = optimizer.state, 0
    for param in _weights(optimizer):
        stride, grad, values = param.stride(), param.grad, state.get(param)
        if grad.__class__ is torch.Tensor and grad.stride() != stride:
            count += _restride(grad, param)
        for value in values.values() if values else ():
            if value.__class__ is torch.Tensor and value.stride() != stride and value.dim() > 1:  # not Adam's 'step'
                count += _restride(value, param)
    return count


def _weights(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """``optimizer``'s 4D/5D parameters, found again when its groups change or a lazy parameter took a shape."""
    key = tuple((id(group['params']), len(group['params'])) for group in optimizer.param_groups)
    try:
        cached, holdable = _weights_of.get(optimizer), True
    except TypeError:  # no weak table can hold it: found each time
        cached, holdable = None, False
    if cached is not None and cached[0] == key:
        return cached[1]
    params = [p for group in optimizer.param_groups for p in group['params']]
    weights = [p for p in params if not is_lazy(p) and p.dim() in (4, 5)]
    if holdable and not any(is_lazy(p) for p in params):  # a lazy parameter takes its shape in a forward
        _weights_of[optimizer] = (key, weights)
    return weights


def _restride(value: torch.Tensor, param: torch.Tensor) -> int:
    """1 where ``value`` was given ``param``'s strides, in place (see :func:`_restridable`); else 0."""
    if not _restridable(value, param):
        return 0
    restrided = torch.empty_strided(param.shape, param.stride(), dtype=value.dtype, device=value.device)
    value.data = restrided.copy_(value)
    return 1


def _restridable(value: torch.Tensor, param: torch.Tensor) -> bool:
    """``value`` is shaped like ``param``, whose strides are dense, and owns all its memory, shared with no
    other process (A3C's shared Adam state)."""
    if value.shape != param.shape or shared_between_processes(value):
        return False
    if value.untyped_storage().nbytes() != value.numel() * value.element_size():
        return False
    return param.is_contiguous() or param.is_contiguous(memory_format=channels_last_format(param))
