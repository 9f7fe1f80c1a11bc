"""Functional convolutions and BatchNorms in a traced graph as module calls, so that the fusion
patterns, which match ``nn.Conv2d`` and ``nn.BatchNorm2d`` calls, see them.

A ``conv2d`` (``conv3d``) call on weights that are constant in eval mode becomes a call of an
``nn.Conv2d`` (``nn.Conv3d``) computing exactly it: of the module that owns the weight where the
call is that module's own forward (Composer's ``BlurConv2d`` calls its ``.conv`` through
``.forward``), else of a new one holding the tensors, put in the owner (timm's ``Conv2dSame`` pads,
then calls ``conv2d``). A weight computed from parameters alone (weight standardization: timm's
``StdConv2d`` and ``ScaledStdConv2d``, BiT's ``WeightStandardizedConv2d``) is computed once, here.
An eval-mode ``batch_norm`` of a convolution's output on one module's own statistics (timm's
``BatchNormAct2d``) becomes a call of an ``nn.BatchNorm2d`` holding them.

Example:
    >>> import torch
    >>> class Std(torch.nn.Conv2d):
    ...     def forward(self, x):
    ...         weight = (self.weight - self.weight.mean(dim=(1, 2, 3), keepdim=True)) * 2
    ...         return F.conv2d(x, weight, self.bias, self.stride, self.padding)
    >>> model = torch.nn.Sequential(Std(3, 8, 3))
    >>> graph_module = fx.symbolic_trace(model)
    >>> call_convolutions_as_modules(graph_module, model)
    >>> [node.target for node in graph_module.graph.nodes if node.op == 'call_module']
    ['0.conv2d']
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import fx, nn

from channels_last_algo.core.fuse.concatenations import concatenated_convolutions, module_calls
from channels_last_algo.core.fuse.patterns import batchnorm_holding
from channels_last_algo.core.fuse.plain_convs import as_plain_conv2d, integer_padding, keeps_conv_forward, plain_conv
from channels_last_algo.core.fuse.postops import has_hooks

__all__ = ['batch_norm_arguments', 'call_batchnorms_as_modules', 'call_convolutions_as_modules']

_CONV_PARAMETERS = ('input', 'weight', 'bias', 'stride', 'padding', 'dilation', 'groups')
_CONV_DEFAULTS = dict(bias=None, stride=1, padding=0, dilation=1, groups=1)
_CONV_DIMS = {torch.conv2d: 2, torch.conv3d: 3}
_BATCH_NORM_ARGUMENTS = inspect.signature(F.batch_norm)


def _attribute(root: nn.Module, target: str) -> Any:
    path, _, name = target.rpartition('.')
    return getattr(root.get_submodule(path), name)


def _free_name(root: nn.Module, owner: str, stem: str) -> str:
    """``<owner>.<stem>``, numbered where the owner has that attribute already."""
    module, index = root.get_submodule(owner), 0
    while hasattr(module, f'{stem}{index or ""}'):
        index += 1
    return f'{owner}.{stem}{index or ""}' if owner else f'{stem}{index or ""}'


def _call_module_instead(graph_module: fx.GraphModule, node: fx.Node, path: str, source: fx.Node) -> None:
    with graph_module.graph.inserting_after(node):
        call = graph_module.graph.call_module(path, (source,))
    node.replace_all_uses_with(call)
    graph_module.graph.erase_node(node)


def _conv_arguments(node: fx.Node) -> Optional[dict[str, Any]]:
    """The arguments of a ``conv2d`` or ``conv3d`` call node by name, defaults filled in, and its number of
    spatial dimensions (``dims``); None for other nodes."""
    dims = _CONV_DIMS.get(node.target) if node.op == 'call_function' else None
    if dims is None or len(node.args) > len(_CONV_PARAMETERS):
        return None
    given = {**_CONV_DEFAULTS, **dict(zip(_CONV_PARAMETERS, node.args)), **node.kwargs}
    return {**given, 'dims': dims} if set(given) == set(_CONV_PARAMETERS) else None


_IN_PLACE_OPERATORS = frozenset(
    getattr(operator, f'i{name}') for name in ('add', 'sub', 'mul', 'truediv', 'floordiv', 'mod', 'pow', 'matmul')
) | frozenset(getattr(operator, f'i{name}') for name in ('and', 'or', 'xor', 'lshift', 'rshift'))


def _writes(node: fx.Node) -> bool:
    """Whether ``node`` may write into one of its inputs (``add_``, ``+=``, ``inplace=True``, ``out=``)."""
    if node.op not in ('call_method', 'call_function'):
        return False
    name = node.target if node.op == 'call_method' else getattr(node.target, '__name__', '')
    trailing = isinstance(name, str) and name.endswith('_') and not name.endswith('__')
    flagged = node.kwargs.get('inplace') is True or 'out' in node.kwargs
    return trailing or flagged or (node.op == 'call_function' and node.target in _IN_PLACE_OPERATORS)


def _evaluate(nodes: list[fx.Node], root: nn.Module) -> Any:
    """The value of the last of ``nodes`` (in graph order, each reading only those before it)."""
    values: dict[fx.Node, Any] = {}
    for node in nodes:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
        if node.op == 'get_attr':
            values[node] = _attribute(root, node.target)
        elif node.op == 'call_function':
            values[node] = node.target(*args, **kwargs)
        else:
            values[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
    return values[nodes[-1]]


_VIEWS = frozenset(
    {
        'view',
        'view_as',
        'reshape',
        'reshape_as',
        'flatten',
        'unflatten',
        'squeeze',
        'unsqueeze',
        'transpose',
        't',
        'permute',
        'expand',
        'expand_as',
        'narrow',
        'select',
        'split',
        'chunk',
        'unbind',
        'detach',
        'as_strided',
        'movedim',
        'getitem',
        'contiguous',
    }
)


def _written_attributes(graph: fx.Graph) -> set[str]:
    """The parameters and buffers the graph may write into: those a writing node reads through views."""
    written, stack = set(), [node.args[0] for node in graph.nodes if _writes(node) and node.args]
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node):
            continue
        if node.op == 'get_attr':
            written.add(node.target)
        elif node.op in ('call_method', 'call_function') and node.args:
            name = node.target if node.op == 'call_method' else getattr(node.target, '__name__', '')
            if name in _VIEWS:
                stack.append(node.args[0])
    return written


def _storage(root: nn.Module, target: str) -> Optional[int]:
    """Where the tensor at ``target`` keeps its elements (None for another value)."""
    value = _attribute(root, target)
    return value.untyped_storage().data_ptr() if isinstance(value, torch.Tensor) else None


class _Constants:
    """The values in a traced graph computed from its model's parameters and buffers alone, by
    functions and methods that write nothing, from tensors nothing in the graph writes (into them or
    into a tensor sharing their storage)."""

    def __init__(self, graph_module: fx.GraphModule) -> None:
        self.graph_module = graph_module
        self.position = {node: index for index, node in enumerate(graph_module.graph.nodes)}
        self.written = {_storage(graph_module, target) for target in _written_attributes(graph_module.graph)}

    def sources(self, node: Optional[fx.Node]) -> Optional[list[fx.Node]]:
        """The nodes ``node`` is computed from, itself included, in graph order; None where it is not a constant."""
        seen, stack = set(), [node]
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            if current.op not in ('get_attr', 'call_function', 'call_method') or _writes(current):
                return None
            if current.op == 'get_attr' and _storage(self.graph_module, current.target) in self.written:
                return None  # a view fx made a constant of shares it: the storage says
            seen.add(current)
            stack.extend(current.all_input_nodes)
        return sorted(seen, key=self.position.__getitem__)

    def value(self, node: Optional[fx.Node]) -> Optional[torch.Tensor]:
        """``node``'s value, computed here twice (a random draw would differ); None where it is not a constant."""
        if node is None:
            return None
        sources = self.sources(node)
        if sources is None:
            return None
        try:
            with torch.no_grad():
                first, second = _evaluate(sources, self.graph_module), _evaluate(sources, self.graph_module)
        except Exception:  # any function may refuse what it is given outside the model's forward
            return None
        same = isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and torch.equal(first, second)
        return first.detach() if same else None


def _owner(sources: list[fx.Node]) -> str:
    return next((node.target.rpartition('.')[0] for node in sources if node.op == 'get_attr'), '')


def _as_module_call(node: fx.Node, given: dict[str, Any], constants: _Constants, modules: dict[str, nn.Module]) -> None:
    """Put a module call in place of the ``conv2d`` / ``conv3d`` call ``node``, where its weights are constants."""
    graph_module, dims = constants.graph_module, given['dims']
    weight, bias = given['weight'], given['bias']
    if not isinstance(weight, fx.Node) or (bias is not None and not isinstance(bias, fx.Node)):
        return
    if weight.op == 'get_attr' and weight.target.endswith('.weight'):
        path = weight.target[: -len('.weight')]
        module = modules.get(path)
        own_bias = getattr(bias, 'target', None) == f'{path}.bias' if bias is not None else module.bias is None
        settings = [given[key] for key in ('stride', 'padding', 'dilation', 'groups')]
        if keeps_conv_forward(module) and module.weight.dim() == dims + 2 and not has_hooks(module) and own_bias:
            if settings == [module.stride, module.padding, module.dilation, module.groups]:
                graph_module.add_submodule(path, module)  # the traced copy holds only the tensors it read
                return _call_module_instead(graph_module, node, path, given['input'])
    values = constants.value(weight), constants.value(bias)
    if values[0] is None or values[0].dim() != dims + 2 or (bias is not None and values[1] is None):
        return
    padding = integer_padding(given['padding'], values[0].shape[2:], given['dilation'], given['stride'], dims)
    settings = (given[key] for key in ('stride', 'dilation', 'groups'))
    if padding is None or not all(isinstance(setting, (int, tuple, list)) for setting in settings):
        return
    conv = plain_conv(values[0], values[1], given['stride'], padding, given['dilation'], given['groups'])
    sources = constants.sources(weight) + (constants.sources(bias) if bias is not None else [])
    name = _free_name(graph_module, _owner(sources), f'conv{dims}d')
    graph_module.add_submodule(name, conv)
    _call_module_instead(graph_module, node, name, given['input'])
    for source in sorted(set(sources), key=constants.position.__getitem__, reverse=True):
        if not source.users:  # what computed the weights for this call alone
            graph_module.graph.erase_node(source)


def call_convolutions_as_modules(graph_module: fx.GraphModule, model: nn.Module) -> None:
    """Replace each ``conv2d`` (``conv3d``) call on weights constant in eval mode with a call of an
    ``nn.Conv2d`` (``nn.Conv3d``) computing exactly it, in ``graph_module``, traced from ``model`` (see the
    module's description)."""
    constants, modules = _Constants(graph_module), dict(model.named_modules())
    for node in list(graph_module.graph.nodes):
        given = _conv_arguments(node)
        if given is not None:
            _as_module_call(node, given, constants, modules)


def batch_norm_arguments(node: fx.Node) -> Optional[dict[str, Any]]:
    """The arguments of an ``F.batch_norm`` call node by name; None for other nodes."""
    if node.op != 'call_function' or node.target is not F.batch_norm:
        return None
    try:
        return _BATCH_NORM_ARGUMENTS.bind(*node.args, **node.kwargs).arguments
    except TypeError:
        return None


def call_batchnorms_as_modules(graph_module: fx.GraphModule) -> dict[str, str]:
    """Replace each eval-mode ``F.batch_norm`` of a convolution's output, on one module's own running
    statistics and affine parameters, with a call of an ``nn.BatchNorm2d`` holding them, put in that
    module; return each such module's path -> the path of the module whose statistics it holds."""
    owners, calls = {}, module_calls(graph_module.graph)
    for node in list(graph_module.graph.nodes):
        given = batch_norm_arguments(node)
        if given is None:
            continue
        source = given['input']
        of_conv = (
            source.op == 'call_module' and as_plain_conv2d(graph_module.get_submodule(source.target)) is not None
        ) or (concatenated_convolutions(source, graph_module, calls) is not None)
        reads = [given.get(key) for key in ('running_mean', 'running_var', 'weight', 'bias')]
        constants = all(getattr(read, 'op', None) == 'get_attr' for read in reads[:2]) and all(
            read is None or getattr(read, 'op', None) == 'get_attr' for read in reads[2:]
        )
        owner = {read.target.rpartition('.')[0] for read in reads if read is not None}
        plain = given.get('training', False) is False and isinstance(given.get('eps', 1e-5), float)
        if not (of_conv and constants and plain and len(owner) == 1 and (reads[2] is None) == (reads[3] is None)):
            continue
        mean, var, weight, bias = (None if read is None else _attribute(graph_module, read.target) for read in reads)
        batch_norm = batchnorm_holding(mean, var, given.get('eps', 1e-5), weight, bias)
        name = _free_name(graph_module, owner.pop(), 'batch_norm')
        graph_module.add_submodule(name, batch_norm)
        owners[name] = name.rpartition('.')[0]
        _call_module_instead(graph_module, node, name, source)
    return owners
