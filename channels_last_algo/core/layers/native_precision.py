"""The dtype a replacement layer computes in and the one it returns: where the native layer rounds, and what it gives.

PyTorch's norm and interpolation kernels read half and bfloat16 tensors, compute in float32 and round
once, on the way out. Autocast adds a policy per op: CUDA's runs ``group_norm`` in float32 (float32
out, even for a half input); ``instance_norm``, ``batch_norm`` and the ``upsample_*`` kernels have no
policy on either device and return their input's dtype. A replacement built of matrix products or
reductions would run them in half precision under autocast (``matmul`` has that policy) and could
return another dtype, which changes every op after it. So the replacements compute with autocast off,
in :func:`compute_dtype`, and return :func:`output_dtype`.

Example:
    >>> x = torch.randn(2, 3, dtype=torch.bfloat16)
    >>> compute_dtype(x), output_dtype(x)
    (torch.float32, torch.bfloat16)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ['compute_dtype', 'output_dtype']

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for a half or bfloat16 ``x`` (what the native kernels accumulate in); ``x.dtype`` otherwise."""
    return torch.float32 if x.dtype in _LOW_PRECISION else x.dtype


def output_dtype(x: torch.Tensor, float32_under_autocast: Sequence[str] = ()) -> torch.dtype:
    """The dtype the native layer returns for ``x``: float32 for a half or bfloat16 ``x`` while autocast is on for
    its device, where that device's autocast runs the op in float32 (``float32_under_autocast``); else ``x.dtype``."""
    device = x.device.type
    if x.dtype in _LOW_PRECISION and device in float32_under_autocast and torch.is_autocast_enabled(device):
        return torch.float32
    return x.dtype
