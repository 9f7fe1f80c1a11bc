"""A BatchNorm after a channel concatenation of convolutions (timm's ``MixedConv2d``: a split, a
convolution of each kernel size, a ``torch.cat``), folded slice by slice into each convolution.

BatchNorm is per channel, so ``bn(cat([conv_a(x_a), conv_b(x_b)], 1))`` equals
``cat([bn_a(conv_a(x_a)), bn_b(conv_b(x_b))], 1)``, ``bn_a`` and ``bn_b`` holding the statistics of
the channels each convolution gives. It applies where each convolution is called once and its output
is read by the concatenation alone, and the concatenation's by the BatchNorm alone.

Example:
    >>> import torch
    >>> class Mixed(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b = torch.nn.Conv2d(3, 2, 3, padding=1), torch.nn.Conv2d(3, 4, 5, padding=2)
    ...         self.bn = torch.nn.BatchNorm2d(6).eval()
    ...     def forward(self, x):
    ...         return self.bn(torch.cat([self.a(x), self.b(x)], 1))
    >>> graph_module = fx.symbolic_trace(Mixed())
    >>> fold_through_concatenations(graph_module, prepack=False)
    {'bn': ['a', 'b']}
"""

from __future__ import annotations

import collections
from typing import Optional

import torch
from torch import fx, nn

from channels_last_algo.core.fuse.node_uses import attributes_read, reads_of, value_users
from channels_last_algo.core.fuse.patterns import BATCHNORM, batchnorm_holding, fold_batchnorm
from channels_last_algo.core.fuse.plain_convs import as_plain_conv2d
from channels_last_algo.core.fuse.postops import has_hooks

__all__ = ['concatenated_convolutions', 'fold_through_concatenations', 'module_calls']

_CATS = (torch.cat, torch.concat, torch.concatenate)


def module_calls(graph: fx.Graph) -> collections.Counter:
    """How many nodes of ``graph`` use each module it calls: its calls, and the reads of its attributes outside
    them (:func:`~.node_uses.attributes_read`). A module used once is its call's alone to fuse: folding a
    BatchNorm into a convolution whose weight a tied decoder also reads would change the decoder's result."""
    calls = collections.Counter(node.target for node in graph.nodes if node.op == 'call_module')
    reads = attributes_read(graph)
    return collections.Counter({path: count + reads_of(path, reads) for path, count in calls.items()})


def concatenated_convolutions(node: fx.Node, root: nn.Module, calls: collections.Counter) -> Optional[list[fx.Node]]:
    """The convolution nodes ``node`` concatenates along the channels, where it is such a
    concatenation of plain 2D convolutions, each called once (``calls``: :func:`module_calls`) and
    read by it alone; else None."""
    if node.op != 'call_function' or node.target not in _CATS or not node.args:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get('dim', 0)
    parts = node.args[0]
    if dim != 1 or not isinstance(parts, (list, tuple)) or len(parts) < 2:
        return None
    for part in parts:
        if not (isinstance(part, fx.Node) and part.op == 'call_module' and calls[part.target] == 1):
            return None
        module = root.get_submodule(part.target)
        if as_plain_conv2d(module) is None or has_hooks(module) or value_users(part) != [node]:
            return None
    return list(parts)


def _channels(bn: nn.Module, start: int, stop: int) -> nn.BatchNorm2d:
    """A BatchNorm holding ``bn``'s statistics and affine parameters of channels ``start:stop``."""
    weight, bias = (None if t is None else t[start:stop] for t in (bn.weight, bn.bias))
    return batchnorm_holding(bn.running_mean[start:stop], bn.running_var[start:stop], bn.eps, weight, bias)


def fold_through_concatenations(graph_module: fx.GraphModule, prepack: bool) -> dict[str, list[str]]:
    """Fold each BatchNorm called once on a concatenation of convolutions (:func:`concatenated_convolutions`)
    into them, in place; return each such BatchNorm's path -> the paths of the convolutions it went into."""
    folded = {}
    calls = module_calls(graph_module.graph)
    for node in list(graph_module.graph.nodes):
        if node.op != 'call_module' or calls[node.target] != 1 or len(node.args) != 1 or node.kwargs:
            continue
        bn, source = BATCHNORM.of_module(graph_module.get_submodule(node.target)), node.args[0]
        parts = concatenated_convolutions(source, graph_module, calls) if isinstance(source, fx.Node) else None
        if bn is None or parts is None or value_users(source) != [node]:
            continue
        convs = [as_plain_conv2d(graph_module.get_submodule(part.target)) for part in parts]
        if sum(conv.out_channels for conv in convs) != bn.num_features:
            continue
        start = 0
        for part, conv in zip(parts, convs):
            stop = start + conv.out_channels
            owner, _, name = part.target.rpartition('.')
            setattr(
                graph_module.get_submodule(owner),
                name,
                fold_batchnorm(conv, _channels(bn, start, stop), prepack=prepack),
            )
            start = stop
        node.replace_all_uses_with(source)
        graph_module.graph.erase_node(node)
        folded[node.target] = [part.target for part in parts]
    return folded
