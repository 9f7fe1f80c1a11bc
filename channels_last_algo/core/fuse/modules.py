"""The module route, for models that symbolic tracing cannot follow: apply
:data:`~.patterns.FUSION_PATTERNS` to the children of plain ``nn.Sequential`` containers (as
torchvision's ``Conv2dNormActivation``), then to the children each other module's own forward
calls one into the next (``self.act(self.bn(self.conv(x)))``, found by tracing that forward alone,
its children as leaves), then to every other convolution alone.

A run is a convolution and the children after it, stepping over eval-mode identities
(Identity, Dropout); each absorbed child is replaced by ``nn.Identity``. A convolution that
appears at several places in the model, or whose weight a traced forward reads (a tied decoder's
``F.conv_transpose2d(h, self.block[0].weight)``), is left alone, and a run ends before a child its forward
calls twice. Residual adds are calls in some ``forward``, never children, so the patterns
with an add do not match here.

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
from collections.abc import Callable
from typing import Any, Optional

from torch import fx, nn

from channels_last_algo.core.fuse.node_uses import attributes_read, reads_of
from channels_last_algo.core.fuse.patterns import (
    LONGEST_PATTERN,
    Element,
    Match,
    batchnorm_paths,
    fuse_chain,
    is_eval_identity,
)
from channels_last_algo.core.fuse.summary import FusionSummary
from channels_last_algo.core.fuse.tracing import shell_of, trace_wrapping_failures

__all__ = ['CONTAINERS', 'fuse_modules']

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
"""Modules that only hold others: code reads their items, no forward of theirs calls them."""


def _plain_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


class _ChildrenAsLeaves(fx.Tracer):
    """fx's tracer for one module's own forward: every child call is a leaf (the functions failing
    on proxies too: :func:`~.tracing.trace_wrapping_failures`)."""

    def __init__(self, autowrap_functions: tuple[Callable[..., Any], ...] = ()) -> None:
        super().__init__(autowrap_functions=autowrap_functions)

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return True


def _called_children(module: nn.Module) -> Optional[fx.Graph]:
    """The graph of ``module``'s own forward, its children as leaves; None where it does not trace.
    It traces a shallow copy, so that what the forward assigns to attributes (a proxy) stays there."""
    try:
        return trace_wrapping_failures(_ChildrenAsLeaves, shell_of(module))[1]
    except Exception:  # any forward can fail on proxies (control flow on values, list arguments)
        return None


def _runs_of_children(graph: fx.Graph) -> list[list[str]]:
    """The runs of children a module's forward (its ``graph``: :func:`_called_children`) calls one into the next,
    by name: each call the only user of the one before, and each child called only there (a ReLU called twice
    ends a run)."""
    calls = [node for node in graph.nodes if node.op == 'call_module']
    counts = collections.Counter(node.target for node in calls)

    def once(node: fx.Node) -> bool:  # its slot is this call's alone (a grandchild's is not this module's)
        return node.op == 'call_module' and counts[node.target] == 1 and '.' not in str(node.target)

    runs, absorbed = [], set()
    for node in calls:
        if node in absorbed or not once(node):
            continue
        run = [node]
        while len(run[-1].users) == 1 and once(user := next(iter(run[-1].users))):
            run.append(user)
        absorbed.update(run)
        if len(run) > 1:
            runs.append([str(step.target) for step in run])
    return runs


class _ModuleFuser:
    """One module-route pass over ``model``: how often each module appears in it, and the fusion
    at a slot of a plain ``nn.Sequential`` or at one module alone."""

    def __init__(self, model: nn.Module, prepack: bool, reads: list[str]) -> None:
        self.model = model
        self.prepack = prepack
        self.uses = collections.Counter()  # appearances, and reads of its attributes by a forward (a tied weight)
        for path, module in model.named_modules(remove_duplicate=False):
            self.uses[id(module)] += 1 + reads_of(path, reads)

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


def _traced(module: nn.Module) -> bool:
    """Whether the runs of ``module``'s children, and its reads of their weights, are found by tracing its forward:
    a module with children of its own, not a plain ``nn.Sequential`` (its children are one run) or a container."""
    return bool(module._modules) and not _plain_sequential(module) and not isinstance(module, CONTAINERS)


def _inside(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == prefix or path.startswith(f'{prefix}.') for prefix in prefixes)


def fuse_modules(model: nn.Module, prepack: bool, traced: bool = True, done: tuple[str, ...] = ()) -> FusionSummary:
    """Fold and fuse the patterns in ``model``'s ``nn.Sequential`` containers and, ``traced``, in the runs of
    children each other module's forward calls, and turn every other convolution into a
    :class:`~channels_last_algo.core.fuse.conv.FusedConv2d`, in place; not inside the submodules at the
    paths ``done`` (fused already)."""
    summary = FusionSummary(route='modules')
    modules = [(path, module) for path, module in model.named_modules() if not _inside(path, done)]
    runs = [(prefix, list(container._modules)) for prefix, container in modules if _plain_sequential(container)]
    graphs = [(prefix, _called_children(module)) for prefix, module in modules if traced and _traced(module)]
    graphs = [(prefix, graph) for prefix, graph in graphs if graph is not None]
    runs += [(prefix, run) for prefix, graph in graphs for run in _runs_of_children(graph)]
    reads = [f'{prefix}.{read}' if prefix else read for prefix, graph in graphs for read in attributes_read(graph)]
    fuser = _ModuleFuser(model, prepack, reads)
    for prefix, names in runs:
        slots = model.get_submodule(prefix)._modules
        for index, name in enumerate(names):
            description = fuser.fuse_slot(slots, names, index)
            if description is not None:
                summary.fused[f'{prefix}.{name}' if prefix else name] = description
    for path, _ in list(model.named_modules())[1:]:  # not the model itself: it has no slot to replace
        if _inside(path, done):
            continue
        description = fuser.fuse_alone(path)
        if description is not None:
            summary.fused[path] = description
    summary.unfused = batchnorm_paths(model)
    return summary
