"""Canonical checkpoints: what a channels-last run saves holds contiguous (NCHW / NCDHW) tensors.

``model.state_dict()`` returns the model's own tensors (detached aliases), so after
:func:`~channels_last_algo.core.convert.apply_channels_last` its 4D/5D entries have NHWC strides,
as PyTorch's do after ``model.to(memory_format=torch.channels_last)``. That stays so on purpose:
EMA implementations (timm's ``ModelEmaV2``, Composer's ``compute_ema``) update a model *through*
its ``state_dict()`` entries in place, which a copy would silently break. Written to a file as
they are, though, NHWC strides reach every consumer of the checkpoint: ``.view()``-based code
(BatchNorm fusion, converters) raises on them, and ``dist.broadcast`` sends a tensor's bytes in
storage order, so a receiving rank that allocated NCHW gets the weights permuted (as
``set_model_state_dict(..., broadcast_from_rank0=True)`` does on a distributed restart).

So the state is made canonical where it is *saved*: :func:`canonical_state` copies every 4D/5D
tensor that is not NCHW-contiguous, anywhere in a nested checkpoint (model, optimizer state,
EMA weights), leaving every other value and the live state alone. The Composer algorithm, the
Lightning callback and the ``channels-last train`` run folder save through it; a plain loop
calls it before ``torch.save``. Loading needs nothing for the model (``load_state_dict`` copies
into the existing channels-last tensors); the optimizer state that ``Optimizer.load_state_dict``
brings in NCHW is put back in its parameters' layout by
:meth:`~channels_last_algo.core.guard.LayoutGuard.on_load` (``restride`` with the optimizers).

Example:
    >>> import torch
    >>> from channels_last_algo.core.convert import apply_channels_last
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3))
    >>> _ = apply_channels_last(model)
    >>> model.state_dict()['0.weight'].is_contiguous()
    False
    >>> saved = canonical_state({'model': model.state_dict(), 'step': 3})
    >>> saved['model']['0.weight'].is_contiguous(), saved['step']
    (True, 3)
    >>> saved['model']['0.weight'].view(8, -1).shape
    torch.Size([8, 27])
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch.utils._pytree import tree_map_only

from channels_last_algo.core.argument_checks import require_state
from channels_last_algo.core.layout import to_channels_first

__all__ = ['canonical_state', 'is_canonical']

State = TypeVar('State')


def canonical_state(state: State) -> State:
    """``state`` (a tensor, or dicts, lists and tuples of them and other values) with every 4D/5D
    tensor in the default contiguous order: a copy where it was not, itself where it was. The
    containers are new, so the live state (an optimizer's per-parameter dicts) is not touched."""
    require_state(state, 'canonical_state')
    return tree_map_only(torch.Tensor, _canonical_tensor, state)


def _canonical_tensor(tensor: torch.Tensor) -> torch.Tensor:
    canonical = to_channels_first(tensor)
    if canonical is not tensor and isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(canonical, requires_grad=tensor.requires_grad)
    return canonical


def is_canonical(state: object) -> bool:
    """True when every 4D/5D tensor in ``state`` is NCHW / NCDHW contiguous (what
    :func:`canonical_state` makes).

    Example:
        >>> is_canonical({'w': torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)})
        False
    """
    tensors: list[torch.Tensor] = []
    tree_map_only(torch.Tensor, tensors.append, state)
    return all(to_channels_first(tensor) is tensor for tensor in tensors)
