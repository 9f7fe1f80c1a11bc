"""Which nodes of a traced graph use a node's value: reads of its shape, rank, dtype or device (timm's
``_assert(x.ndim == 4)``) aside, since a fused op's output has the same.

Example:
    >>> import torch
    >>> graph = torch.fx.Graph()
    >>> x = graph.placeholder('x')
    >>> rank, relu = graph.call_function(getattr, (x, 'ndim')), graph.call_function(torch.relu, (x,))
    >>> [user.name for user in value_users(x)]
    ['relu']
"""

from __future__ import annotations

from torch import fx

__all__ = ['reads_metadata', 'value_users']

_METADATA_ATTRIBUTES = frozenset({'shape', 'ndim', 'dtype', 'device'})
_METADATA_METHODS = frozenset({'size', 'dim', 'ndimension'})


def reads_metadata(node: fx.Node) -> bool:
    """Whether ``node`` reads only its input's shape, rank, dtype or device, which a fused run's output shares."""
    if node.op == 'call_function' and node.target is getattr:
        return len(node.args) == 2 and node.args[1] in _METADATA_ATTRIBUTES
    return node.op == 'call_method' and node.target in _METADATA_METHODS


def value_users(node: fx.Node) -> list[fx.Node]:
    """The users of ``node`` that read its values."""
    return [user for user in node.users if not reads_metadata(user)]
