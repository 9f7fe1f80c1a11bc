"""Random numbers drawn in memory order: ops whose numbers land on other elements of an NHWC tensor than of NCHW's.

torch's CPU generators fill a tensor in its memory order, so ``F.dropout(x)`` (its noise is
``empty_like(x)``), ``torch.randn_like(x)`` and ``x.uniform_()`` give each element another number when
``x`` is laid out otherwise than in NCHW, for the same seed: an NHWC map, or the tokens
``z.flatten(2).permute(0, 2, 1)`` (a DETR encoder's input), contiguous here and transposed in NCHW. The
distribution is the same; the numbers, and so a float64 run's every step, are not. :func:`nchw_draw_order`
says in which order of dimensions an op would draw in NCHW, given the tensor's twin there
(:mod:`~channels_last_algo.core.nchw_twins`), where that differs, and :func:`drawn_in` runs the op so that
it draws in that order.
``F.dropout2d``, ``torch.bernoulli(p)``, ``torch.normal(mean, std)``, ``F.rrelu`` and ``F.gumbel_softmax``
draw into contiguous memory whatever the layout, and are none of these.

Example:
    >>> import torch
    >>> x = torch.rand(2, 3, 4, 4)
    >>> nhwc = x.contiguous(memory_format=torch.channels_last)
    >>> _ = torch.manual_seed(0); nchw_noise = torch.randn_like(x)
    >>> order = nchw_draw_order(torch.randn_like, (nhwc,), {}, torch.empty(2, 3, 4, 4, device='meta'))
    >>> order, draw_order(torch.randn_like, nhwc)
    ((0, 1, 2, 3), (0, 2, 3, 1))
    >>> _ = torch.manual_seed(0); noise = drawn_in(torch.randn_like, (nhwc,), {}, order)
    >>> torch.equal(noise, nchw_noise)
    True
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = ['DRAWS', 'draw_order', 'drawn_in', 'memory_order', 'nchw_draw_order', 'same_order']

_FILLS = frozenset(
    getattr(torch.Tensor, name)
    for name in ('bernoulli_', 'uniform_', 'normal_', 'exponential_', 'random_', 'geometric_', 'cauchy_', 'log_normal_')
)  # draw into the tensor itself, in its memory order
_DROPOUTS = frozenset({F.dropout, torch.dropout, F.alpha_dropout, torch.alpha_dropout})  # noise: empty_like(input)
_LIKE = _DROPOUTS | {torch.rand_like, torch.randn_like, torch.randint_like}  # draw into empty_like(the tensor)
DRAWS = _FILLS | _LIKE
"""The ops whose random numbers follow the memory order of their first argument."""


def memory_order(strides: tuple) -> tuple:
    """The dimensions from outermost to innermost in memory, as ``torch.empty_permuted`` takes them.

    Example:
        >>> memory_order((48, 1, 12, 3))
        (0, 2, 3, 1)
    """
    return tuple(sorted(range(len(strides)), key=lambda d: (-strides[d], d)))


def _draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the call draws in the memory order of its first argument: a dropout in training with p > 0, a
    ``*_like`` op without a memory format of its own, or a fill."""
    if func in _DROPOUTS:
        p = kwargs.get('p', args[1] if len(args) > 1 else 0.5)
        training = kwargs.get('training', kwargs.get('train', args[2] if len(args) > 2 else True))
        return bool(training) and p > 0.0
    return kwargs.get('memory_format', torch.preserve_format) is torch.preserve_format


def draw_order(func: Any, tensor: torch.Tensor) -> tuple:
    """The order of dimensions in which ``func`` (one of :data:`DRAWS`) draws for ``tensor`` (a meta twin or
    a real tensor): its own memory order for a fill, that of ``empty_like(tensor)`` for the others."""
    laid_out = tensor if func in _FILLS else torch.empty_like(tensor, device='meta')
    return memory_order(laid_out.stride())


def nchw_draw_order(func: Any, args: tuple, kwargs: dict, twin: torch.Tensor) -> Optional[tuple]:
    """The order in which ``func(*args, **kwargs)`` would draw in NCHW, whose first argument there is ``twin``;
    None where it draws nothing or puts the same numbers on the same elements here.

    Example:
        >>> z = torch.rand(2, 3, 4, 4).to(memory_format=torch.channels_last)
        >>> nchw_draw_order(F.dropout, (z, 0.5), {}, torch.empty(2, 3, 4, 4, device='meta'))
        (0, 1, 2, 3)
        >>> nchw_draw_order(F.dropout, (z, 0.5), {'training': False}, torch.empty(2, 3, 4, 4, device='meta'))
    """
    if not _draws(func, args, kwargs):
        return None
    order = draw_order(func, twin)
    return None if same_order(tuple(twin.shape), order, draw_order(func, args[0])) else order


def same_order(shape: tuple, order: tuple, other: tuple) -> bool:
    """Whether two memory orders of a tensor of ``shape`` lay its elements out alike: the same order of the
    dimensions longer than 1.

    Example:
        >>> same_order((2, 3, 1, 1), (0, 1, 2, 3), (0, 2, 3, 1)), same_order((2, 3, 4, 4), (0, 1, 2, 3), (0, 2, 3, 1))
        (True, False)
    """
    return [d for d in order if shape[d] > 1] == [d for d in other if shape[d] > 1]


def drawn_in(func: Any, args: tuple, kwargs: dict, order: tuple) -> Any:
    """``func(*args, **kwargs)`` with its numbers drawn in ``order``: into a buffer so laid out, copied into a
    filled tensor; from a copy so laid out of the input of a ``*_like`` op or dropout, whose result is written
    back where the dropout was in place."""
    tensor = args[0]
    laid_out = torch.empty_permuted(tensor.shape, order, dtype=tensor.dtype, device=tensor.device)
    if func in _FILLS:
        func(laid_out, *args[1:], **kwargs)
        return tensor.copy_(laid_out)
    result = func(laid_out.copy_(tensor), *args[1:], **kwargs)
    in_place = func in _DROPOUTS and kwargs.get('inplace', len(args) > 3 and args[3])  # (x, p, training, inplace)
    return tensor.copy_(result) if in_place else result
