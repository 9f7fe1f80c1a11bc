"""Extension kernels for the tests: ops that read raw memory, as a kernel written for contiguous tensors does.

:func:`ramp_over_memory` scales each element by its position in memory. The ``channels_last_tests``
operators are registered with ``torch.library`` once, on import: a forward, its backward (an op of its
own) and an op that writes its input in place.
"""

from __future__ import annotations

import torch


def ramp_over_memory(t: torch.Tensor) -> torch.Tensor:
    """Each element times 1 + its position in ``t``'s memory / numel, read from raw memory as an
    extension kernel reads a contiguous tensor: other numbers for an NHWC tensor."""
    flat = torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())
    ramp = 1 + torch.arange(t.numel(), dtype=t.dtype, device=t.device) / t.numel()
    return (flat * ramp).view(t.shape)


@torch.library.custom_op('channels_last_tests::ramp', mutates_args=())
def registered_ramp(x: torch.Tensor) -> torch.Tensor:
    """An extension op registered with ``torch.library`` whose kernel reads raw memory without making its
    input contiguous: it is in NCHW, so the kernel's author never had to."""
    return ramp_over_memory(x)


@registered_ramp.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op('channels_last_tests::ramp_backward', mutates_args=())
def registered_ramp_backward(grad: torch.Tensor) -> torch.Tensor:
    """The extension's backward kernel, an op of its own, reading raw memory too."""
    return ramp_over_memory(grad)


@registered_ramp_backward.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


registered_ramp.register_autograd(lambda ctx, grad: registered_ramp_backward(grad))


@torch.library.custom_op('channels_last_tests::ramp_in_place', mutates_args=('x',))
def ramp_in_place(x: torch.Tensor) -> None:
    """An extension op that writes its input in place through raw memory."""
    x.copy_(ramp_over_memory(x))
