"""Optimizers that flatten parameters or gradients with ``.view``, which channels-last strides refuse.

``p.grad.view(-1)`` raises on an NHWC gradient ("view size is not compatible with input tensor's
size and stride"), and a parameter kept as a view of a flat bucket stops being one when it is
restrided, so updates no longer reach the bucket, silently. Where a model is trained by such an
optimizer its weights stay contiguous and only the activations go NHWC
(:mod:`channels_last_algo.core.weight_layout`). :data:`FLATTENING_OPTIMIZERS` lists the known ones;
a subclass of a listed class counts as that class.

Example:
    >>> import torch
    >>> params = [torch.nn.Parameter(torch.zeros(4, 3, 1, 1))]
    >>> flattening(torch.optim.LBFGS(params))
    ('LBFGS gathers the gradients with p.grad.view(-1)', False)
    >>> flattening(torch.optim.SGD(params, lr=0.1)) is None
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Optional

import torch

__all__ = ['FLATTENING_OPTIMIZERS', 'FlatteningOptimizer', 'flattening']


@dataclasses.dataclass(frozen=True)
class FlatteningOptimizer:
    """One row: an optimizer class (by qualified name, so its package need not be installed), how it
    flattens, when (``applies``, given the optimizer), and whether it owns the parameters' storage
    (then nothing may restride them, even back to contiguous)."""

    qualified_name: str
    flattens: str
    applies: Callable[[torch.optim.Optimizer], bool] = lambda optimizer: True
    owns_storage: bool = False


FLATTENING_OPTIMIZERS = (
    FlatteningOptimizer('torch.optim.lbfgs.LBFGS', 'gathers the gradients with p.grad.view(-1)'),
    FlatteningOptimizer(
        'torch.distributed.optim.zero_redundancy_optimizer.ZeroRedundancyOptimizer',
        'keeps the parameters as views of flat buckets (parameters_as_bucket_view=True)',
        lambda optimizer: bool(getattr(optimizer, 'parameters_as_bucket_view', False)),
        owns_storage=True,
    ),
    # Muon (github.com/KellerJordan/Muon) orthogonalises a convolution's update as update.view(len(update), -1)
    *(
        FlatteningOptimizer(f'muon.{name}', 'orthogonalises each update as update.view(len(update), -1)')
        for name in ('Muon', 'SingleDeviceMuon', 'MuonWithAuxAdam', 'SingleDeviceMuonWithAuxAdam')
    ),
)


def flattening(optimizer: torch.optim.Optimizer) -> Optional[tuple[str, bool]]:
    """How ``optimizer`` flattens (naming its class) and whether it owns the parameters' storage;
    None where no row matches."""
    names = {f'{cls.__module__}.{cls.__qualname__}' for cls in type(optimizer).__mro__}
    for row in FLATTENING_OPTIMIZERS:
        if row.qualified_name in names and row.applies(optimizer):
            return f'{type(optimizer).__name__} {row.flattens}', row.owns_storage
    return None
