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


class _ModuleFuser:
    """One module-route pass over ``model``: how often each module appears in it, and the fusion
    at a slot of a plain ``nn.Sequential`` or at one module alone."""

    def __init__(self, model: nn.Module, prepack: bool) -> None:
        self.model = model
        self.prepack = prepack
        self.uses = collections.Counter(id(module) for _, module in model.named_modules(remove_duplicate=False))

    def value_of(self, element: Element, module: nn.Module, previous: Optional[nn.Module]) -> Any:
        """What ``element`` accepts of ``module``; a convolution that appears twice is left alone."""
        return element.of_module(module) if previous is not None or self.uses[id(module)] == 1 else None

    def fuse_slot(self, slots: dict[str, nn.Module], names: list[str], index: int) -> Optional[str]:
        """Fuse the run of children from ``names[index]``; absorbed children become ``nn.Identity``."""

        def run_at() -> list[str]:  # slot names
            steps = [name for name in names[index + 1 :] if not is_eval_identity(slots[name])]
            return [names[index], *steps[: LONGEST_PATTERN - 1]]

        def slot_value(element: Element, slot: str, previous: Optional[str]) -> Any:
            return self.value_of(element, slots[slot], None if previous is None else slots[previous])

        def replace(match: Match, module: nn.Module) -> None:
            first, *absorbed = match.items
            slots[first] = module
            self.uses[id(module)] = 1  # a folded convolution is matched again
            for slot in absorbed:
                slots[slot] = nn.Identity()

        return fuse_chain(run_at, slot_value, replace, self.prepack)

    def fuse_alone(self, path: str) -> Optional[str]:
        """Fuse the module at ``path`` by itself (a convolution into a ``FusedConv2d``)."""
        parent, _, name = path.rpartition('.')

        def replace(match: Match, module: nn.Module) -> None:
            setattr(self.model.get_submodule(parent), name, module)

        return fuse_chain(lambda: [self.model.get_submodule(path)], self.value_of, replace, self.prepack)


def fuse_modules(model: nn.Module, prepack: bool) -> FusionSummary:
    """Fold and fuse the patterns in ``model``'s ``nn.Sequential`` containers and turn every
    other convolution into a :class:`~channels_last_algo.core.fuse.conv.FusedConv2d`, in place."""
    summary = FusionSummary(route='modules')
    fuser = _ModuleFuser(model, prepack)
    for prefix, container in list(model.named_modules()):
        if not _plain_sequential(container):
            continue
        names = list(container._modules)
        for index, name in enumerate(names):
            description = fuser.fuse_slot(container._modules, names, index)
            if description is not None:
                summary.fused[f'{prefix}.{name}' if prefix else name] = description
    for path, _ in list(model.named_modules())[1:]:  # not the model itself: it has no slot to replace
        description = fuser.fuse_alone(path)
        if description is not None:
            summary.fused[path] = description
    summary.unfused = batchnorm_paths(model)
    return summary
