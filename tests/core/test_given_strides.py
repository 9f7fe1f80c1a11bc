"""Strides given to ``.as_strided()`` are told apart as written for NCHW's memory or built from the tensor's own,
over the window shapes code writes: from the map's shape (``(c * h * w, h * w, w, 1, w, 1)``, kernel or output
positions first), Opacus's (batch and channel strides from ``x.stride()``, the rest written for NCHW), and windows
and pools built from ``z.stride()`` alone, for every stride and dilation on maps whose strides coincide or not."""

from __future__ import annotations

import itertools

import pytest
import torch

from channels_last_algo.core.given_strides import written_for_nchw

SHAPES = [(2, c, h, w) for c in (2, 3, 8, 10, 16) for h, w in ((4, 4), (8, 8), (5, 7), (16, 16))]


def _windows(z: torch.Tensor, twin: torch.Tensor, step: int, dilation: int) -> dict[str, tuple[tuple, bool]]:
    """Each window's strides and whether they are written for NCHW."""
    (sn, sc, sh, sw), (on, oc, oh, ow), width = twin.stride(), z.stride(), z.shape[-1]
    return {
        'shape, kernel first': ((sn, sc, sh * dilation, sw * dilation, sh * step, sw * step), True),
        'shape, positions first': ((sn, sc, sh * step, sw * step, sh * dilation, sw * dilation), True),
        'shape, pooled': ((sn, sc, sh * step, sw * step), True),
        'opacus': ((on, oc, width * dilation, dilation, width * step, step), True),
        'own, kernel first': ((on, oc, oh * dilation, ow * dilation, oh * step, ow * step), False),
        'own, positions first': ((on, oc, oh * step, ow * step, oh * dilation, ow * dilation), False),
        'own, pooled': ((on, oc, oh * step, ow * step), False),
    }


@pytest.mark.parametrize('shape', SHAPES, ids=lambda shape: 'x'.join(map(str, shape)))
def test_strides_written_for_nchw_are_told_from_the_tensors_own(shape):
    z, twin = torch.empty(shape).to(memory_format=torch.channels_last), torch.empty(shape, device='meta')
    built_from_own = {
        strides
        for s, d in itertools.product(range(1, 7), repeat=2)
        for strides, nchw in _windows(z, twin, s, d).values()
        if not nchw
    }
    for step, dilation in itertools.product((1, 2), (1, 2, 3)):
        for name, (strides, for_nchw) in _windows(z, twin, step, dilation).items():
            if for_nchw and strides in built_from_own:
                continue  # the strides of a window built from z.stride() too (2 channels, a dilation of 2): either
            assert written_for_nchw(twin, z, strides) == for_nchw, f'{name}, step {step}, dilation {dilation}'
