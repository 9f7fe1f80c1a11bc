"""Why a layout break happens where no layer swap can help: the kernel torch picks for a convolution, or
a kernel safe path that copies to NCHW on purpose (its ``layout_break_cause``).

Most breaks come from a layer or an op of the model, and the audit's module path is where to look.
Some come from torch itself: for some devices, dtypes and kernel shapes, the convolution kernel torch
picks has no channels-last path and returns channels first (on the CPU in float64, the native
``slow_conv3d`` kernel of a Conv3d with a (t, 1, 1) kernel, or a depthwise 1 x 1 x 1 one). Then the
weight gradient comes channels first too, and is copied into the weight's channels-last layout.
:func:`cause_of` names these, so the audit can say the break is torch's, and what avoids it.

Example:
    >>> import torch
    >>> conv = torch.nn.Conv3d(4, 4, (5, 1, 1))
    >>> cause_of('aten.convolution.default', torch.float64, 'cpu', conv, 'forward').split(';')[0]
    "torch's cpu float64 Conv3d kernel returns channels first"
    >>> cause_of('aten.cat.default', torch.float32, 'cpu', conv, 'forward')
    ''
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ['cause_of']

_CONVOLUTIONS = ('aten.convolution.', 'aten._convolution.', 'aten.convolution_backward.')
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cause_of(op: str, dtype: torch.dtype, device: str, module: Optional[torch.nn.Module], phase: str) -> str:
    """The cause of a break of ``op`` on a ``dtype`` tensor, run by ``module`` in ``phase``, where it is
    torch's convolution kernel or the module's own (``layout_break_cause``: a kernel safe path that copies
    on purpose); '' otherwise."""
    if getattr(module, 'layout_break_cause', ''):
        return module.layout_break_cause
    convolution = isinstance(module, torch.nn.modules.conv._ConvNd)
    if op.startswith(_CONVOLUTIONS):
        kind = type(module).__name__ if convolution else 'convolution'
        hint = (
            '; float32 and bfloat16 run oneDNN, which keeps channels last'
            if device == 'cpu' and dtype not in _ONEDNN_DTYPES
            else ''
        )
        return f"torch's {device} {str(dtype).replace('torch.', '')} {kind} kernel returns channels first{hint}"
    if op.startswith('aten.copy_.') and phase == 'backward' and convolution:
        return (
            "the convolution's backward gave the weight gradient channels first; it is copied into the weight's layout"
        )
    return ''
