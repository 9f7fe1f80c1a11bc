"""The fx route inside a model whose own forward does not trace: each largest submodule whose forward
traces runs its fused graph as its forward, so that its residual adds and the BatchNorms after its
containers fuse as on the fx route; the module route (:mod:`.modules`) fuses the rest.

transformers' models take flags (``return_dict``, ``output_hidden_states``) that their forward and
their encoder's branch on, which a trace cannot follow; their stages take a tensor alone, and trace.
A submodule is taken only where it appears once in the model, no forward hook watches it (its graph
would not call the hooks of what it inlines), and it holds a convolution; containers and plain
``nn.Sequential`` are looked into (code iterates them). The submodule stays the object it was, of its
class, with its attributes, properties and methods (a parent's ``self.encoder.output_stride`` reads
the same): the graph's code becomes its forward, the fused convolutions take their paths in it, and
the layers fused into them become ``nn.Identity``. The fused copy is checked on the example input,
and made again without graphs where it fails or differs there.

Example:
    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
    ...     def forward(self, x):
    ...         return (self.bn(self.conv(x)) + x).relu()
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.block = Block()
    ...     def forward(self, x, flag=False):
    ...         return x if flag else self.block(x)   # a branch on an argument: the model does not trace
    >>> net = Net().eval()
    >>> fuse_subgraphs(net, prepack=False).fused
    {'block.conv': 'conv+bn+add+relu'}
    >>> type(net.block).__name__, type(net.block.conv).__name__, type(net.block.bn).__name__
    ('Block', 'FusedConv2d', 'Identity')
"""

from __future__ import annotations

import collections
from collections import Counter
from collections.abc import Iterator
from typing import Any, Optional

from torch import fx, nn

from channels_last_algo.core.fuse.graph import fuse_graph, optional_inputs_used, trace
from channels_last_algo.core.fuse.modules import CONTAINERS
from channels_last_algo.core.fuse.postops import has_hooks
from channels_last_algo.core.fuse.summary import FusionSummary
from channels_last_algo.core.fuse.tracing import shell_of

__all__ = ['fuse_subgraphs']

_CONTAINERS = (*CONTAINERS, nn.Sequential)  # code iterates a Sequential too (YOLO's layers)


def _worth_tracing(module: nn.Module, uses: int) -> bool:
    """Whether ``module`` may become a graph: it appears once, no hook watches it, it is no container
    or ``torch.nn`` layer (a plain ``nn.Sequential``'s children are one run already), and it holds a
    convolution."""
    layer = type(module).__module__.startswith('torch.nn.')
    return (
        uses == 1
        and not has_hooks(module)
        and not layer
        and not isinstance(module, _CONTAINERS)
        and any(isinstance(child, nn.Conv2d) for child in module.modules())
    )


def _traced(module: nn.Module) -> Optional[fx.GraphModule]:
    """``module``'s graph; None where its forward does not trace, or the graph computes with an argument that
    defaults to None (a caller passing None would fail in it)."""
    try:
        graph_module = trace(shell_of(module))
    except Exception:  # any forward can fail on proxies (control flow on an argument or a value)
        return None
    return None if optional_inputs_used(graph_module) else graph_module


def _largest_traceable(model: nn.Module, uses: Counter) -> Iterator[tuple[str, fx.GraphModule]]:
    """Each largest submodule of ``model`` (not ``model`` itself) worth tracing whose forward traces,
    by path, with its graph; the submodules of one that does not trace are tried in its place."""
    pending = list(model.named_children())
    while pending:
        path, module = pending.pop(0)
        graph_module = _traced(module) if _worth_tracing(module, uses[id(module)]) else None
        if graph_module is None:
            pending[:0] = [(f'{path}.{name}', child) for name, child in module.named_children()]
        else:
            yield path, graph_module


def _modules_read(graph_module: fx.GraphModule) -> set[str]:
    """The paths of the modules ``graph_module``'s graph calls or reads as objects (a padding from a convolution's
    settings: transformers' ``apply_tf_padding(features, self.convolution)``)."""
    return {
        node.target
        for node in graph_module.graph.nodes
        if node.op == 'call_module' or (node.op == 'get_attr' and isinstance(_at(graph_module, node.target), nn.Module))
    }


def _at(module: nn.Module, path: str) -> object:
    owner, _, name = path.rpartition('.')
    return getattr(module.get_submodule(owner), name)


class _GraphForward:
    """A module's forward that runs a fused graph's code on the module itself, so that it reads the module's
    tensors as they are now (after ``.to()``); it pickles and deep-copies as its module and graph (a
    GraphModule regenerates its code)."""

    def __init__(self, module: nn.Module, graph_module: fx.GraphModule) -> None:
        self.module = module
        self.graph_module = graph_module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.graph_module).forward(self.module, *args, **kwargs)


def _graph_as_forward(module: nn.Module, graph_module: fx.GraphModule, read: set[str], uses: Counter) -> bool:
    """Make ``graph_module``'s code ``module``'s forward: the modules its fused graph reads put at their
    paths in ``module``, those it ``read`` before fusing and reads no more (fused into a convolution)
    made ``nn.Identity`` where they appear once in the model. False (nothing changed) where the graph
    reads a tensor that ``module`` does not hold at that path."""
    now = _modules_read(graph_module)
    for node in graph_module.graph.nodes:
        if node.op == 'get_attr' and node.target not in now:
            try:
                held = _at(module, node.target)
            except AttributeError:
                return False
            if held is not _at(graph_module, node.target):
                return False
    for path in sorted(now) + sorted(read - now):
        parent, _, name = path.rpartition('.')
        if path in now:
            setattr(module.get_submodule(parent), name, graph_module.get_submodule(path))
        elif uses[id(module.get_submodule(path))] == 1 and not any(target.startswith(f'{path}.') for target in now):
            setattr(module.get_submodule(parent), name, nn.Identity())
    module.forward = _GraphForward(module, graph_module)
    return True


def fuse_subgraphs(model: nn.Module, prepack: bool) -> FusionSummary:
    """Make each largest submodule of ``model`` whose forward traces run its fused graph
    (:func:`~.graph.fuse_graph`), in place; the fused convolutions by their paths in ``model``, and the
    submodules that run a graph in ``graphs``."""
    summary = FusionSummary(route='modules')
    uses = collections.Counter(id(module) for _, module in model.named_modules(remove_duplicate=False))
    for path, graph_module in list(_largest_traceable(model, uses)):
        read = _modules_read(graph_module)
        inner = fuse_graph(graph_module, prepack)
        if not _graph_as_forward(model.get_submodule(path), graph_module, read, uses):
            continue
        summary.fused.update({f'{path}.{conv}': kernel for conv, kernel in inner.fused.items()})
        summary.split.update(
            {f'{path}.{norm}': [f'{path}.{conv}' for conv in convs] for norm, convs in inner.split.items()}
        )
        summary.graphs.append(path)
    return summary
