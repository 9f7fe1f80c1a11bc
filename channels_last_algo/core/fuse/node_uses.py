"""Which nodes of a traced graph use a node's value: reads of its shape, rank, dtype or device (timm's
``_assert(x.ndim == 4)``) aside, since a fused op's output has the same; and which of a module's attributes
the graph reads outside its calls, which folding a BatchNorm into its weight would change for them too.

Example:
    >>> import torch
    >>> graph = torch.fx.Graph()
    >>> x = graph.placeholder('x')
    >>> rank, relu = graph.call_function(getattr, (x, 'ndim')), graph.call_function(torch.relu, (x,))
    >>> [user.name for user in value_users(x)]
    ['relu']
    >>> weight = graph.get_attr('enc.weight')
    >>> tied = graph.call_function(torch.nn.functional.conv_transpose2d, (relu, weight))
    >>> attributes_read(graph), reads_of('enc', attributes_read(graph)), reads_of('dec', attributes_read(graph))
    (['enc.weight'], 1, 0)
"""

from __future__ import annotations

from torch import fx

__all__ = ['attributes_read', 'reads_metadata', 'reads_of', 'value_users']

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


def attributes_read(graph: fx.Graph) -> list[str]:
    """The targets of ``graph``'s ``get_attr`` nodes whose values a node reads: a module's parameter read outside
    its own call (a tied decoder's ``F.conv_transpose2d(h, self.enc.weight)``), or a module passed whole; not
    ``self.conv.weight.dtype``."""
    return [str(node.target) for node in graph.nodes if node.op == 'get_attr' and value_users(node)]


def reads_of(path: str, reads: list[str]) -> int:
    """How many of ``reads`` (:func:`attributes_read`) reach into the module at ``path``: its attributes, the
    module itself, or a module holding it."""
    return sum(read == path or read.startswith(f'{path}.') or path.startswith(f'{read}.') for read in reads)
