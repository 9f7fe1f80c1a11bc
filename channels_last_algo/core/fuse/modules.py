"""The module route, for models that symbolic tracing cannot follow: apply
:data:`~.patterns.FUSION_PATTERNS` to the children of plain ``nn.Sequential`` containers (as
torchvision's ``Conv2dNormActivation``), then to every other convolution alone.

A run is a convolution and the children after it, stepping over eval-mode identities
(Identity, Dropout); each absorbed child is replaced by ``nn.Identity``. A module that appears
at several places in the model is left alone. Residual adds are calls in some ``forward``,
never children, so the patterns with an add do not match here.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    >>> fuse_modules(net, prepack=True).fused
    {'0': 'conv+bn+relu'}
    >>> [type(child).__name__ for child in net]
    ['FusedConv2d', 'Identity', 'Identity']
"""

from __future__ import annotations

import collections
from typing import Any, Optional

from torch import nn

from channels_last_algo.core.fuse.patterns import (
    LONGEST_PATTERN,
    Element,
    Match,
    batchnorm_paths,
    fuse_chain,
    is_eval_identity,
)
from channels_last_algo.core.fuse.summary import FusionSummary

__all__ = ['fuse_modules']


def _plain_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def fuse_modules(model: nn.Module, prepack: bool) -> FusionSummary:
    """Fold and fuse the patterns in ``model``'s ``nn.Sequential`` containers and turn every
    other convolution into a :class:`~channels_last_algo.core.fuse.conv.FusedConv2d`, in place."""
    summary = FusionSummary(route='modules')
    uses = collections.Counter(id(module) for _, module in model.named_modules(remove_duplicate=False))

    def value_of(element: Element, module: nn.Module, previous: Optional[nn.Module]) -> Any:
        return element.of_module(module) if previous is not None or uses[id(module)] == 1 else None

    def fuse_slot(slots: dict[str, nn.Module], names: list[str], index: int) -> Optional[str]:
        def run_at() -> list[str]:  # slot names
            steps = [name for name in names[index + 1 :] if not is_eval_identity(slots[name])]
            return [names[index], *steps[: LONGEST_PATTERN - 1]]

        def slot_value(element: Element, slot: str, previous: Optional[str]) -> Any:
            return value_of(element, slots[slot], None if previous is None else slots[previous])

        def replace(match: Match, module: nn.Module) -> None:
            first, *absorbed = match.items
            slots[first] = module
            uses[id(module)] = 1  # a folded convolution is matched again
            for slot in absorbed:
                slots[slot] = nn.Identity()

        return fuse_chain(run_at, slot_value, replace, prepack)

    for prefix, container in list(model.named_modules()):
        if not _plain_sequential(container):
            continue
        names = list(container._modules)
        for index, name in enumerate(names):
            description = fuse_slot(container._modules, names, index)
            if description is not None:
                summary.fused[f'{prefix}.{name}' if prefix else name] = description

    def fuse_alone(path: str) -> Optional[str]:
        parent, _, name = path.rpartition('.')

        def replace(match: Match, module: nn.Module) -> None:
            setattr(model.get_submodule(parent), name, module)

        return fuse_chain(lambda: [model.get_submodule(path)], value_of, replace, prepack)

    for path, _ in list(model.named_modules())[1:]:  # not the model itself: it has no slot to replace
        description = fuse_alone(path)
        if description is not None:
            summary.fused[path] = description
    summary.unfused = batchnorm_paths(model)
    return summary
