"""Strides given outright to ``.as_strided()``: written for NCHW's memory, or built from the tensor's own.

Code that slides windows over a map through ``z.as_strided(size, stride)`` often writes the strides
for NCHW memory from the shape (``(c * h * w, h * w, w, 1, w, 1)``), or takes the batch and channel
strides from ``z.stride()`` and writes the spatial ones so (Opacus's ``unfold2d``). On an NHWC ``z``
either reads other elements, silently. :func:`written_for_nchw` tells such strides from ones built
from ``z.stride()`` alone (which read the same elements in either layout), and :func:`read_as_in_nchw`
gives the strides the code would have given in NCHW, where it read the tensor's own. A read of one
element at the tensor's start (:func:`first_element_only`: torchdiffeq's ``torch.as_strided(param, (), ())``)
is the same in either layout, whatever the strides.

Example:
    >>> import torch
    >>> z = torch.empty(2, 4, 6, 6).to(memory_format=torch.channels_last)
    >>> twin = torch.empty(2, 4, 6, 6, device='meta')
    >>> strides = (*z.stride()[:2], 6, 1, 6, 1)
    >>> written_for_nchw(twin, z, strides), read_as_in_nchw(twin, z, strides)
    (True, (144, 36, 6, 1, 6, 1))
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ['first_element_only', 'read_as_in_nchw', 'written_for_nchw']


def first_element_only(tensor: torch.Tensor, size: Any, storage_offset: Optional[int]) -> bool:
    """Whether ``tensor.as_strided(size, strides, storage_offset)`` reads at most the tensor's first element,
    which is the same in either layout: sizes of one (or an empty read), from the tensor's own start.

    Example:
        >>> z = torch.empty(2, 4, 6, 6).to(memory_format=torch.channels_last)
        >>> first_element_only(z, (), None), first_element_only(z, (1, 1), 0), first_element_only(z, (1, 2), None)
        (True, True, False)
    """
    return math.prod(size) <= 1 and storage_offset in (None, tensor.storage_offset())


def written_for_nchw(twin: torch.Tensor, tensor: torch.Tensor, strides: Any) -> bool:
    """Whether ``strides`` (given to ``tensor.as_strided()``) were written for the NCHW memory of
    ``twin`` rather than built from ``tensor.stride()``: by which layout's strides divide them
    dimension by dimension (a window's dimensions past the tensor's taking its spatial strides in
    turn), as given or with the leading ones taken from ``tensor.stride()`` put as NCHW's
    (:func:`read_as_in_nchw`: Opacus's windows, whose dilation and stride multiply NCHW's strides
    into values NHWC's has); where both or neither do, by the stride values only one layout has
    (8 channels on 8 x 8 maps have the same values); else by their falling as NCHW strides do.

    Example:
        >>> z = torch.empty(2, 4, 6, 6).to(memory_format=torch.channels_last)
        >>> twin = torch.empty(2, 4, 6, 6, device='meta')
        >>> written_for_nchw(twin, z, (144, 36, 6, 1)), written_for_nchw(twin, z, z.stride())
        (True, False)
        >>> square, square_twin = torch.empty(2, 8, 8, 8).to(memory_format=torch.channels_last), torch.empty(2, 8, 8, 8)
        >>> windows = (512, 64, 8, 1, 8, 1)
        >>> written_for_nchw(square_twin, square, windows), written_for_nchw(square_twin, square, square.stride())
        (True, False)
        >>> written_for_nchw(square_twin, square, (*square.stride()[:2], 8, 1, 8, 1))
        True
    """
    for candidate in (strides, read_as_in_nchw(twin, tensor, strides)):  # as given; as NCHW's code would give them
        fit_nchw, fit_own = _divide(candidate, twin.stride()), _divide(candidate, tensor.stride())
        if fit_nchw != fit_own:
            return fit_nchw
    given, own, nchw = set(strides) - {0}, set(tensor.stride()), set(twin.stride())
    only_nchw, only_own = bool(given & (nchw - own)), bool(given & (own - nchw))
    if only_nchw != only_own:
        return only_nchw
    leading = list(strides[: tensor.dim()])
    return leading == sorted(leading, reverse=True)


def _divide(strides: Any, reference: tuple) -> bool:
    """Whether each of ``strides`` is a multiple of ``reference``'s in its dimension; a dimension past the
    reference's takes its spatial ones in turn (windows ``(n, c, kh, kw, oh, ow)`` step along H, W, H, W)."""
    spatial = reference[2:]
    cycled = [*reference, *(spatial[d % len(spatial)] for d in range(max(0, len(strides) - len(reference))))]
    return all(r == 0 or s % r == 0 for s, r in zip(strides, cycled))


def read_as_in_nchw(twin: torch.Tensor, tensor: torch.Tensor, strides: Any) -> tuple:
    """``strides`` written for NCHW's memory, with each leading one the code took from ``tensor.stride()``
    (``x.as_strided(size, x.stride()[:2] + (w, 1))``) put as ``twin`` has it: in NCHW the code read
    the twin's.

    Example:
        >>> z = torch.empty(2, 4, 6, 6).to(memory_format=torch.channels_last)
        >>> twin = torch.empty(2, 4, 6, 6, device='meta')
        >>> read_as_in_nchw(twin, z, (*z.stride()[:2], 6, 1, 6, 1)), read_as_in_nchw(twin, z, (144, 36, 6, 1))
        ((144, 36, 6, 1, 6, 1), (144, 36, 6, 1))
    """
    own, nchw = tensor.stride(), twin.stride()
    return tuple(nchw[d] if d < len(own) and s == own[d] != nchw[d] else s for d, s in enumerate(strides))
