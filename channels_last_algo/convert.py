"""``apply_channels_last``: the functional form of the algorithm.

Restrides every 4D parameter and buffer of a model to ``torch.channels_last`` and every 5D
one to ``torch.channels_last_3d``, in place. The ``Parameter`` objects stay the same (an
optimizer built before stays valid), their gradients and any optimizer state shaped like
them are restrided too, and the ``state_dict`` keys do not change. Ambiguous shapes (1x1 and
depthwise kernels, ``in_channels=1``) get real channels-last strides.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv3d(8, 4, 1))
    >>> summary = apply_channels_last(model)
    >>> summary.converted
    ['0.weight', '1.weight']
    >>> model[0].weight.is_contiguous(memory_format=torch.channels_last)
    True
    >>> apply_channels_last(model).converted        # idempotent
    []
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Iterable, Optional, Sequence, Union

import torch
from torch.nn.parameter import is_lazy

from channels_last_algo.layout import channels_last_format, to_channels_last

__all__ = ['ConversionSummary', 'apply_channels_last']

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ConversionSummary:
    """What :func:`apply_channels_last` changed.

    Attributes:
        converted: names (as in ``state_dict``) of the 4D/5D tensors that were restrided.
        already_channels_last: names of the 4D/5D tensors that needed nothing.
        optimizer_states: how many optimizer state tensors were restrided with their parameter.
        uninitialized: names of lazy-module parameters that have no shape yet and were skipped.
    """

    converted: list[str] = dataclasses.field(default_factory=list)
    already_channels_last: list[str] = dataclasses.field(default_factory=list)
    optimizer_states: int = 0
    uninitialized: list[str] = dataclasses.field(default_factory=list)

    @property
    def channels_last_tensors(self) -> int:
        """How many 4D/5D tensors the model holds, all channels last now."""
        return len(self.converted) + len(self.already_channels_last)

    def __str__(self) -> str:
        return (f'channels last: {len(self.converted)} tensors restrided, '
                f'{len(self.already_channels_last)} already channels last, '
                f'{self.optimizer_states} optimizer state tensors restrided')


def _restride_in_place(tensor: torch.Tensor) -> bool:
    """Give ``tensor`` channels-last strides by swapping its ``.data``; True if it changed."""
    data = tensor.data  # a new alias object on each access: compare against this one
    restrided = to_channels_last(data)
    if restrided is data:
        return False
    tensor.data = restrided
    return True


def _restride_optimizer_state(optimizers: Iterable[torch.optim.Optimizer], params: set[int]) -> int:
    count = 0
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            if id(param) not in params:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    restrided = to_channels_last(value)
                    if restrided is not value:
                        state[key] = restrided
                        count += 1
    return count


def apply_channels_last(
    model: torch.nn.Module,
    optimizers: Optional[Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]] = None,
) -> ConversionSummary:
    """Restride ``model``'s 4D/5D parameters, buffers and gradients to channels last in place.

    Args:
        model: the model to convert. Modified in place and also left usable by any optimizer
            that already holds its parameters.
        optimizers: optimizers whose per-parameter state (momentum, Adam moments) should be
            restrided with their parameters; only needed when they already hold state.

    Returns:
        A :class:`ConversionSummary`. A model with no 4D/5D tensor is left alone with a
        warning, since channels last can do nothing for it.
    """
    summary = ConversionSummary()
    named = list(model.named_parameters()) + list(model.named_buffers())
    for name, tensor in named:
        if is_lazy(tensor):
            summary.uninitialized.append(name)
            continue
        if channels_last_format(tensor) is None:
            continue
        changed = _restride_in_place(tensor)
        grad = getattr(tensor, 'grad', None)
        if grad is not None and channels_last_format(grad) is not None:
            changed = _restride_in_place(grad) or changed
        (summary.converted if changed else summary.already_channels_last).append(name)

    if optimizers is not None:
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        params = {id(p) for _, p in model.named_parameters()}
        summary.optimizer_states = _restride_optimizer_state(optimizers, params)

    if summary.uninitialized:
        warnings.warn(
            f'{type(model).__name__} has uninitialized lazy parameters {summary.uninitialized}, '
            'which were left as they are; run one forward pass to initialize them, then call '
            'apply_channels_last again.',
            stacklevel=2,
        )
    elif summary.channels_last_tensors == 0:
        warnings.warn(
            f'{type(model).__name__} has no 4D or 5D parameter or buffer (no Conv2d/Conv3d), '
            'so channels last cannot change anything; the model was left as it is.',
            stacklevel=2,
        )
    else:
        log.info('%s: %s', type(model).__name__, summary)
    return summary
