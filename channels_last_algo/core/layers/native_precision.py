"""The dtype a replacement layer computes in and the one it returns: where the native layer rounds, and what it gives.

PyTorch's norm and interpolation kernels read half and bfloat16 tensors, compute in float32 and round
once, on the way out. Autocast adds a policy per op: CUDA's runs ``group_norm`` in float32 (float32
out, even for a half input); ``instance_norm``, ``batch_norm`` and the ``upsample_*`` kernels have no
policy on either device and return their input's dtype. A replacement built of matrix products or
reductions would run them in half precision under autocast (``matmul`` has that policy) and could
return another dtype, which changes every op after it. So the replacements compute in
:func:`compute_dtype` under :func:`autocast_off` and return :func:`output_dtype`. A device with no
autocast (``meta``, where shape inference runs models) has none to turn off.

Example:
    >>> x = torch.randn(2, 3, dtype=torch.bfloat16)
    >>> with autocast_off(x):
    ...     compute_dtype(x), output_dtype(x)
    (torch.float32, torch.bfloat16)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

__all__ = ['autocast_off', 'compute_dtype', 'output_dtype']

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for a half or bfloat16 ``x`` (what the native kernels accumulate in); ``x.dtype`` otherwise."""
    return torch.float32 if x.dtype in _LOW_PRECISION else x.dtype


def output_dtype(x: torch.Tensor, float32_under_autocast: Sequence[str] = ()) -> torch.dtype:
    """The dtype the native layer returns for ``x``: float32 for a half or bfloat16 ``x`` while autocast is on for
    its device, where that device's autocast runs the op in float32 (``float32_under_autocast``); else ``x.dtype``."""
    device = x.device.type
    if x.dtype in _LOW_PRECISION and device in float32_under_autocast and _has_autocast(device):
        return torch.float32 if torch.is_autocast_enabled(device) else x.dtype
    return x.dtype


def autocast_off(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast turned off on ``x``'s device, for the replacement's own ops; nothing where the device has none."""
    device = x.device.type
    return torch.autocast(device, enabled=False) if _has_autocast(device) else contextlib.nullcontext()


def _has_autocast(device: str) -> bool:
    """Whether ``device`` has autocast (``meta`` has not). Graph capture runs on a real device, and dynamo
    cannot trace the availability check."""
    return torch.compiler.is_compiling() or torch.amp.is_autocast_available(device)
