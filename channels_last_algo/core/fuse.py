"""Fused NHWC inference: fold BatchNorm into convolutions, fuse activations and residual adds.

:func:`fuse_for_inference` returns an eval-only copy of a conv net (the model given is never
modified) in which

* every ``Conv2d -> BatchNorm2d`` pair is folded into one convolution (computed in float64,
  weights kept channels last);
* every plain ``Conv2d`` becomes a :class:`FusedConv2d` that absorbs the activation after it
  (ReLU, ReLU6/Hardtanh, SiLU, Hardswish, Sigmoid, Hardsigmoid, Tanh, GELU, LeakyReLU) or the
  residual add after it and a ReLU after that add. On CPU it runs as one oneDNN primitive
  with the activation or add as a post-op (``torch.ops.mkldnn._convolution_pointwise`` and its
  ``.binary`` form) on weights prepacked once into oneDNN's blocked format; on CUDA,
  conv + ReLU and conv + add + ReLU run as ``torch.cudnn_convolution_relu`` and
  ``torch.cudnn_convolution_add_relu``. Other devices, dtypes and shapes fall back to the
  plain NHWC ops, with the same math;
* everything else stays as it was, restrided to channels last.

The patterns are matched on a ``torch.fx`` symbolic trace (every torchvision classification
model traces). Where tracing fails, a module-level pass folds and fuses ``Conv2d``,
``BatchNorm2d`` and activation modules that follow each other in an ``nn.Sequential`` (as in
torchvision's ``Conv2dNormActivation``) and turns every other ``Conv2d`` into a
:class:`FusedConv2d`; :attr:`InferenceModel.summary` says which route was taken and what was
fused.

Contract: the model must be in eval mode (a submodule in train mode is refused with
``ValueError``: BatchNorm would use batch statistics and cannot be folded). The copy holds no
parameter that requires grad; calling it in train mode, or with an input that requires grad
while grad mode is on, raises ``RuntimeError`` (it has no backward: gradients belong to the
training model). Under CPU autocast (bfloat16) the fused convolutions run in the autocast
dtype like ``conv2d`` would; a bfloat16 copy (``fused.to(torch.bfloat16)``) works too and is
no faster (within 4% on five torchvision models, ``benchmarks/inference.py``), so autocast,
which keeps float32 weights and is what Composer's ``amp_bf16`` evaluation uses, is the way.

:func:`export_for_inference` saves the fused model with ``torch.export`` (a ``.pt2`` file);
``torch.export.load(path).module()`` runs it in any process with torch >= 2.7, without this
package (TorchScript, in maintenance, is not used). The saved program has plain weights and
out-of-place adds, which is what ``torch.export`` can trace, and runs slower than the
in-process copy (ResNet-50: 1.38x over NCHW eager against 1.74x, same benchmark).

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    >>> fused = fuse_for_inference(net)
    >>> fused.summary.fused
    {'0': 'conv+bn+relu'}
    >>> x = torch.randn(2, 3, 16, 16)
    >>> torch.testing.assert_close(fused(x), net(x), rtol=1e-4, atol=1e-5)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import operator
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.utils.fusion import fuse_conv_bn_weights
from torch.utils._pytree import tree_flatten

from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.layers import RULES
from channels_last_algo.core.guard import batch_to_channels_last
from channels_last_algo.core.layout import to_channels_last

__all__ = [
    'FusedConv2d',
    'FusedEvaluation',
    'FusionSummary',
    'InferenceModel',
    'PostOp',
    'export_for_inference',
    'fuse_for_inference',
]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Post-ops: the activations a fused convolution applies to its output
# --------------------------------------------------------------------------------------------

_EAGER_POST_OPS: dict[str, Callable[[torch.Tensor, tuple, str], torch.Tensor]] = {
    'relu': lambda x, scalars, algorithm: torch.relu(x),
    'hardtanh': lambda x, scalars, algorithm: F.hardtanh(x, *scalars),
    'swish': lambda x, scalars, algorithm: F.silu(x),
    'hardswish': lambda x, scalars, algorithm: F.hardswish(x),
    'sigmoid': lambda x, scalars, algorithm: torch.sigmoid(x),
    'hardsigmoid': lambda x, scalars, algorithm: F.hardsigmoid(x),
    'tanh': lambda x, scalars, algorithm: torch.tanh(x),
    'gelu': lambda x, scalars, algorithm: F.gelu(x, approximate=algorithm),
    'leaky_relu': lambda x, scalars, algorithm: F.leaky_relu(x, *scalars),
}


@dataclasses.dataclass(frozen=True)
class PostOp:
    """An elementwise activation run on a convolution's output inside the fused kernel.

    Attributes:
        attr: its oneDNN name, as ``torch.ops.mkldnn._convolution_pointwise`` takes it.
        scalars: its parameters (Hardtanh bounds, LeakyReLU slope).
        algorithm: GELU's approximation (``'none'`` or ``'tanh'``), else empty.

    Example:
        >>> PostOp('hardtanh', (0.0, 6.0)).eager(torch.tensor([-1.0, 3.0, 9.0]))
        tensor([0., 3., 6.])
    """

    attr: str
    scalars: tuple[float, ...] = ()
    algorithm: str = ''

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        """The activation as plain PyTorch ops: the fallback, and the reference."""
        return _EAGER_POST_OPS[self.attr](x, self.scalars, self.algorithm)

    def __str__(self) -> str:
        return {'hardtanh': 'relu6' if self.scalars == (0.0, 6.0) else 'hardtanh', 'swish': 'silu'}.get(
            self.attr, self.attr)


_RELU = PostOp('relu')

# Activation modules (exact types: a subclass may change the math) -> their post-op.
_MODULE_POST_OPS: dict[type, Callable[[nn.Module], PostOp]] = {
    nn.ReLU: lambda m: _RELU,
    nn.ReLU6: lambda m: PostOp('hardtanh', (0.0, 6.0)),
    nn.Hardtanh: lambda m: PostOp('hardtanh', (float(m.min_val), float(m.max_val))),
    nn.SiLU: lambda m: PostOp('swish'),
    nn.Hardswish: lambda m: PostOp('hardswish'),
    nn.Sigmoid: lambda m: PostOp('sigmoid'),
    nn.Hardsigmoid: lambda m: PostOp('hardsigmoid'),
    nn.Tanh: lambda m: PostOp('tanh'),
    nn.GELU: lambda m: PostOp('gelu', algorithm=m.approximate),
    nn.LeakyReLU: lambda m: PostOp('leaky_relu', (float(m.negative_slope),)),
}

# Activation functions and tensor methods called on the conv output alone (only an
# ``inplace`` flag besides it) -> their post-op.
_FUNCTION_POST_OPS: dict[Any, PostOp] = {
    F.relu: _RELU, torch.relu: _RELU, torch.relu_: _RELU, F.relu_: _RELU,
    F.relu6: PostOp('hardtanh', (0.0, 6.0)),
    F.silu: PostOp('swish'),
    F.hardswish: PostOp('hardswish'),
    torch.sigmoid: PostOp('sigmoid'), F.sigmoid: PostOp('sigmoid'),
    F.hardsigmoid: PostOp('hardsigmoid'),
    torch.tanh: PostOp('tanh'), F.tanh: PostOp('tanh'),
    F.gelu: PostOp('gelu', algorithm='none'),
}
_METHOD_POST_OPS: dict[str, PostOp] = {
    'relu': _RELU, 'relu_': _RELU,
    'sigmoid': PostOp('sigmoid'), 'sigmoid_': PostOp('sigmoid'),
    'tanh': PostOp('tanh'), 'tanh_': PostOp('tanh'),
}

# Residual adds: out-of-place ones in either order; in-place ones only onto the conv output
# (``identity += conv(x)`` mutates ``identity``, which other nodes may still read).
_ADD_FUNCTIONS = (operator.add, torch.add)
_INPLACE_ADD_FUNCTIONS = (operator.iadd,)
_ADD_METHODS = ('add',)
_INPLACE_ADD_METHODS = ('add_',)


# --------------------------------------------------------------------------------------------
# The fused convolution
# --------------------------------------------------------------------------------------------


@functools.cache
def _onednn_supports(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


_CUDNN_DTYPES = (torch.float32, torch.float16)


def _scalars(post_op: Optional[PostOp]) -> list:
    # A one-element [None] for post-ops without parameters: oneDNN ignores it, and
    # torch.export's serializer cannot write an empty Scalar?[] list.
    return list(post_op.scalars) if post_op is not None and post_op.scalars else [None]


class FusedConv2d(nn.Module):
    """A ``Conv2d`` (BatchNorm folded in) with its activation and residual add in one kernel.

    ``forward(x)`` computes ``post_op(conv(x))``; with ``add=True``, ``forward(x, other)``
    computes ``post_op(conv(x) + other)`` (``post_op`` is then None or ReLU). Weight and bias
    are buffers, the weight channels last.

    Kernels, chosen per call from the input's device and dtype (the autocast dtype when
    autocast is on):

    * CPU, float32 / bfloat16 / float16 where oneDNN supports it: one oneDNN convolution with
      the activation (or the add and ReLU) as post-ops; with ``add_in_place`` (set by
      :func:`fuse_for_inference` where nothing reads ``other`` afterwards) the result is
      written into ``other``. With ``prepack`` the weight is
      reordered once per dtype into oneDNN's blocked format for the first input's shape, and
      reused (:meth:`torch.nn.Module.to` and friends drop the packed copies).
    * CUDA, float32 / float16, ReLU after the conv or the add: cuDNN's fused
      convolution + bias (+ add) + ReLU.
    * otherwise (and when ``other`` does not have the output's shape and dtype, or ``x``
      needs a gradient): ``conv2d``, add and activation as separate NHWC ops.

    Args:
        conv: a plain ``nn.Conv2d`` with zero padding given as integers; its weight and bias
            are copied.
        post_op: the activation after the conv (or after the add), or None.
        add: whether ``forward`` takes a residual ``other`` to add before the activation.
        prepack: reorder the weight once into oneDNN's format on CPU. Off for
            ``torch.export``, which needs plain tensors.

    Example:
        >>> conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        >>> fused = FusedConv2d(conv, PostOp('relu'), add=True)
        >>> x, other = torch.randn(2, 8, 8, 8), torch.randn(2, 8, 8, 8)
        >>> with torch.no_grad():
        ...     torch.testing.assert_close(fused(x, other), torch.relu(conv(x) + other))
    """

    def __init__(self, conv: nn.Conv2d, post_op: Optional[PostOp] = None, add: bool = False,
                 prepack: bool = True) -> None:
        super().__init__()
        if not _fusable_conv(conv):
            raise ValueError(f'FusedConv2d needs a plain nn.Conv2d with zero padding given as integers, got {conv}')
        if add and post_op not in (None, _RELU):
            raise ValueError(f'a residual add can only be followed by ReLU in one kernel, got {post_op}')
        self.register_buffer('weight', to_channels_last(conv.weight.detach().clone()))
        self.register_buffer('bias', None if conv.bias is None else conv.bias.detach().clone())
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = tuple(conv.kernel_size)
        self.stride, self.padding, self.dilation = list(conv.stride), list(conv.padding), list(conv.dilation)
        self.groups = conv.groups
        self.post_op = post_op
        self.add = add
        self.add_in_place = False
        self.prepack = prepack
        self._packed: dict[torch.dtype, tuple[torch.Tensor, Optional[torch.Tensor]]] = {}

    def extra_repr(self) -> str:
        parts = [f'{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}',
                 f'stride={tuple(self.stride)}']
        if any(self.padding):
            parts.append(f'padding={tuple(self.padding)}')
        if any(d != 1 for d in self.dilation):
            parts.append(f'dilation={tuple(self.dilation)}')
        if self.groups != 1:
            parts.append(f'groups={self.groups}')
        parts.append(f'bias={self.bias is not None}')
        if self.add:
            parts.append('add')
        if self.post_op is not None:
            parts.append(f'post_op={self.post_op}')
        return ', '.join(parts)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state['_packed'] = {}  # oneDNN's opaque tensors neither copy nor pickle
        return state

    def _apply(self, fn, recurse=True):
        self._packed = {}
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.add != (other is not None):
            expected, given = ('(x, other)' if add else '(x)' for add in (self.add, other is not None))
            raise TypeError(f'{type(self).__name__}(add={self.add}) takes {expected}, got {given}')
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        needs_grad = x.requires_grad and torch.is_grad_enabled()
        if (x.dim() != 4 or not (autocast or self.weight.dtype == dtype) or needs_grad
                or (other is not None and not self._fits(x, other, dtype))):
            return self._eager(x, other)
        if device == 'cpu' and _onednn_supports(dtype):
            return self._onednn(x.to(dtype), other, dtype)
        if device == 'cuda' and dtype in _CUDNN_DTYPES and self.post_op == _RELU:
            return self._cudnn(x.to(dtype), other, dtype)
        return self._eager(x, other)

    def _fits(self, x: torch.Tensor, other: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether ``other`` has exactly the conv output's shape and the compute dtype."""
        spatial = [(size + 2 * pad - dil * (k - 1) - 1) // stride + 1
                   for size, pad, dil, k, stride in zip(x.shape[2:], self.padding, self.dilation,
                                                        self.kernel_size, self.stride)]
        return other.dtype == dtype and tuple(other.shape) == (x.shape[0], self.out_channels, *spatial)

    def _weights(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Weight and bias in ``dtype``; on CPU with ``prepack``, the weight reordered for
        oneDNN, once per dtype."""
        cached = self._packed.get(dtype)
        if cached is not None:
            return cached
        weight = self.weight.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        if not (self.prepack and x.device.type == 'cpu'):
            return weight, bias
        weight = torch.ops.mkldnn._reorder_convolution_weight(weight, self.padding, self.stride, self.dilation,
                                                               self.groups, list(x.shape))
        self._packed[dtype] = (weight, bias)
        return weight, bias

    def _onednn(self, x: torch.Tensor, other: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        weight, bias = self._weights(x, dtype)
        post_op = self.post_op
        if other is None:
            return torch.ops.mkldnn._convolution_pointwise(
                x, weight, bias, self.padding, self.stride, self.dilation, self.groups,
                'none' if post_op is None else post_op.attr, _scalars(post_op),
                '' if post_op is None else post_op.algorithm)
        other = to_channels_last(other)
        args = (weight, bias, self.padding, self.stride, self.dilation, self.groups, 'add', 1.0,
                None if post_op is None else post_op.attr, _scalars(post_op), '')
        if self.add_in_place:
            return torch.ops.mkldnn._convolution_pointwise_.binary(other, x, *args)
        return torch.ops.mkldnn._convolution_pointwise.binary(x, other, *args)

    def _cudnn(self, x: torch.Tensor, other: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        weight, bias = self._weights(x, dtype)
        if other is None:
            return torch.cudnn_convolution_relu(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)
        return torch.cudnn_convolution_add_relu(x, weight, to_channels_last(other), 1.0, bias, self.stride,
                                                self.padding, self.dilation, self.groups)

    def _eager(self, x: torch.Tensor, other: Optional[torch.Tensor]) -> torch.Tensor:
        y = F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        if other is not None:
            y = y + other
        return y if self.post_op is None else self.post_op.eager(y)


def _fusable_conv(module: Any) -> bool:
    return (type(module) is nn.Conv2d and module.padding_mode == 'zeros'
            and not isinstance(module.padding, str))


def _fold_batchnorm(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A copy of ``conv`` with ``bn`` (eval mode: running statistics) folded in, in float64."""
    dtype = conv.weight.dtype
    args = [None if t is None else t.detach().double()
            for t in (conv.weight, conv.bias, bn.running_mean, bn.running_var)]
    affine = [None if t is None else t.detach().double() for t in (bn.weight, bn.bias)]
    weight, bias = fuse_conv_bn_weights(*args, bn.eps, *affine)
    folded = copy.deepcopy(conv)
    folded.weight = nn.Parameter(to_channels_last(weight.detach().to(dtype)), requires_grad=False)
    folded.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
    return folded


def _foldable_batchnorm(module: Any) -> bool:
    return (type(module) in (nn.BatchNorm2d, nn.SyncBatchNorm) and module.track_running_stats
            and module.running_mean is not None and not _has_hooks(module))


def _describe(folded: bool, add: bool, post_op: Optional[PostOp]) -> str:
    parts = ['conv'] + (['bn'] if folded else []) + (['add'] if add else []) + ([str(post_op)] if post_op else [])
    return '+'.join(parts)


# --------------------------------------------------------------------------------------------
# What was fused
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class FusionSummary:
    """What :func:`fuse_for_inference` did.

    Attributes:
        route: ``'fx'`` (patterns matched on a symbolic trace) or ``'modules'`` (the
            module-level fallback, when tracing failed or its result did not match).
        fused: module path of each convolution (in the original model) -> what its fused
            kernel computes, e.g. ``'conv+bn+add+relu'``.
        trace_error: why the fx route was not taken, if it was not.
    """

    route: str
    fused: dict[str, str] = dataclasses.field(default_factory=dict)
    trace_error: Optional[str] = None

    def count(self, part: str) -> int:
        """How many fused convolutions include ``part`` (``'bn'``, ``'add'``, ``'relu'``...)."""
        return sum(part in kernel.split('+') for kernel in self.fused.values())

    def __str__(self) -> str:
        activations = sum(kernel.split('+')[-1] not in ('conv', 'bn', 'add') for kernel in self.fused.values())
        text = (f'{self.route}: {len(self.fused)} convolutions fused, {self.count("bn")} with BatchNorm folded, '
                f'{activations} with an activation, {self.count("add")} with a residual add')
        return text if self.trace_error is None else f'{text} (fx route not taken: {self.trace_error})'


# --------------------------------------------------------------------------------------------
# The fx route
# --------------------------------------------------------------------------------------------


def _single_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _activation_of(source: fx.Node, node: Optional[fx.Node], modules: dict[str, nn.Module]) -> Optional[PostOp]:
    """The post-op ``node`` computes from ``source`` alone, or None."""
    if node is None or not node.args or node.args[0] is not source:
        return None
    if node.op == 'call_module':
        module = modules[node.target]
        make = _MODULE_POST_OPS.get(type(module))
        return make(module) if make is not None and not _has_hooks(module) else None
    extra = list(node.args[1:]) + [v for k, v in node.kwargs.items() if k != 'approximate']
    if not all(isinstance(v, bool) for v in extra) or set(node.kwargs) - {'inplace', 'approximate'}:
        return None
    if node.op == 'call_function' and node.target in _FUNCTION_POST_OPS:
        post_op = _FUNCTION_POST_OPS[node.target]
        if post_op.attr == 'gelu':
            return PostOp('gelu', algorithm=node.kwargs.get('approximate', 'none'))
        return None if 'approximate' in node.kwargs else post_op
    if node.op == 'call_method' and node.target in _METHOD_POST_OPS and not node.kwargs:
        return _METHOD_POST_OPS[node.target]
    return None


def _residual_of(conv_node: fx.Node, node: Optional[fx.Node]) -> Optional[fx.Node]:
    """The other operand when ``node`` adds a tensor to ``conv_node``'s output, else None."""
    if node is None or node.kwargs or len(node.args) != 2:
        return None
    first, second = node.args
    inplace = ((node.op == 'call_function' and node.target in _INPLACE_ADD_FUNCTIONS)
               or (node.op == 'call_method' and node.target in _INPLACE_ADD_METHODS))
    out_of_place = ((node.op == 'call_function' and node.target in _ADD_FUNCTIONS)
                    or (node.op == 'call_method' and node.target in _ADD_METHODS))
    if not (inplace or out_of_place) or not isinstance(first, fx.Node) or not isinstance(second, fx.Node):
        return None
    if first is conv_node and second is not conv_node:
        return second
    if second is conv_node and first is not conv_node and out_of_place:
        return first
    return None


def _eval_identity_functions() -> dict[Any, int]:
    """Functions that return their input when their ``training`` argument (at this
    position) is False."""
    functions: dict[Any, int] = {F.dropout: 2, F.dropout1d: 2, F.dropout2d: 2, F.dropout3d: 2, F.alpha_dropout: 2}
    try:
        from torchvision.ops import stochastic_depth
    except ImportError:
        return functions
    functions[stochastic_depth] = 3
    return functions


_EVAL_IDENTITY_MODULES = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                          nn.FeatureAlphaDropout)


def _drop_eval_identities(graph: fx.Graph, modules: dict[str, nn.Module]) -> None:
    """Remove the nodes that are the identity in eval mode (Dropout, StochasticDepth,
    Identity), so that a conv and the add after them can fuse."""
    functions = _eval_identity_functions()
    for node in list(graph.nodes):
        if node.op == 'call_module':
            identity = type(modules[node.target]) in _EVAL_IDENTITY_MODULES and not _has_hooks(modules[node.target])
        elif node.op == 'call_function' and node.target in functions:
            position = functions[node.target]
            training = node.args[position] if len(node.args) > position else node.kwargs.get('training', True)
            identity = training is False
        else:
            identity = False
        if identity and node.args and isinstance(node.args[0], fx.Node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition('.')
    setattr(root.get_submodule(parent), name, module)


def _fuse_graph(graph_module: fx.GraphModule, traceable: bool) -> FusionSummary:
    """Fold BatchNorms and fuse convolutions in ``graph_module``, in place."""
    graph = graph_module.graph
    modules = dict(graph_module.named_modules())
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == 'call_module':
            calls[node.target] = calls.get(node.target, 0) + 1

    def conv_at(node: Any) -> Optional[nn.Conv2d]:
        """The fusable, hook-free Conv2d ``node`` calls, if it is its only call."""
        if not isinstance(node, fx.Node) or node.op != 'call_module' or calls[node.target] != 1:
            return None
        module = modules[node.target]
        return module if _fusable_conv(module) and not _has_hooks(module) else None

    _drop_eval_identities(graph, modules)
    folded: set[str] = set()
    for node in list(graph.nodes):
        if node.op != 'call_module' or not _foldable_batchnorm(modules[node.target]):
            continue
        conv_node = node.args[0] if len(node.args) == 1 and not node.kwargs else None
        conv = conv_at(conv_node)
        if conv is None or len(conv_node.users) != 1:
            continue
        modules[conv_node.target] = _fold_batchnorm(conv, modules[node.target])
        _set_submodule(graph_module, conv_node.target, modules[conv_node.target])
        folded.add(conv_node.target)
        node.replace_all_uses_with(conv_node)
        graph.erase_node(node)

    summary = FusionSummary(route='fx')
    for conv_node in list(graph.nodes):
        conv = conv_at(conv_node)
        if conv is None or len(conv_node.args) != 1 or conv_node.kwargs:
            continue
        absorbed = [conv_node]
        user = _single_user(conv_node)
        other = _residual_of(conv_node, user)
        if other is not None:
            absorbed.append(user)
            post_op = _activation_of(user, _single_user(user), modules)
            post_op = post_op if post_op == _RELU else None
        else:
            post_op = _activation_of(conv_node, user, modules)
        if post_op is not None:
            absorbed.append(_single_user(absorbed[-1]))
        fused = FusedConv2d(conv, post_op, add=other is not None, prepack=not traceable)
        _set_submodule(graph_module, conv_node.target, fused)
        last = absorbed[-1]
        with graph.inserting_after(last):
            args = (conv_node.args[0],) if other is None else (conv_node.args[0], other)
            fused_node = graph.call_module(conv_node.target, args)
        last.replace_all_uses_with(fused_node)
        for node in reversed(absorbed):
            graph.erase_node(node)
        summary.fused[conv_node.target] = _describe(conv_node.target in folded, fused.add, post_op)
    if not traceable:
        _mark_in_place_adds(graph, dict(graph_module.named_modules()))
    graph.lint()
    graph_module.delete_all_unused_submodules()
    graph_module.recompile()
    return summary


def _mark_in_place_adds(graph: fx.Graph, modules: dict[str, nn.Module]) -> None:
    """Let a fused conv + add write into its residual input instead of a new tensor where
    that is safe: the residual is a convolution's output (a fresh tensor, or one only aliasing
    tensors that are dead already) and nothing reads it after the add. On CPU this skips
    allocating (and page-faulting) one activation-sized output per residual block."""
    position = {node: index for index, node in enumerate(graph.nodes)}
    for node in graph.nodes:
        fused = modules.get(node.target) if node.op == 'call_module' else None
        if not isinstance(fused, FusedConv2d) or not fused.add:
            continue
        other = node.args[1]
        producer = modules.get(other.target) if other.op == 'call_module' else None
        fresh = isinstance(producer, FusedConv2d) or _fusable_conv(producer)
        fused.add_in_place = (fresh and other is not node.args[0]
                              and all(position[user] <= position[node] for user in other.users))


# --------------------------------------------------------------------------------------------
# The module route
# --------------------------------------------------------------------------------------------


def _plain_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _fuse_modules(model: nn.Module, traceable: bool) -> FusionSummary:
    """Fold and fuse ``Conv2d -> BatchNorm2d -> activation`` runs inside plain
    ``nn.Sequential`` containers, and turn every other ``Conv2d`` into a
    :class:`FusedConv2d`, in place."""
    summary = FusionSummary(route='modules')
    uses: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        uses[id(module)] = uses.get(id(module), 0) + 1

    def fusable(module: nn.Module) -> bool:
        return _fusable_conv(module) and uses[id(module)] == 1 and not _has_hooks(module)

    for prefix, container in list(model.named_modules()):
        if not _plain_sequential(container):
            continue
        names = list(container._modules)
        index = 0
        while index < len(names):
            conv = container._modules[names[index]]
            if not fusable(conv):
                index += 1
                continue
            path = f'{prefix}.{names[index]}' if prefix else names[index]
            following = [container._modules[name] for name in names[index + 1:index + 3]]
            bn = following[0] if following and _foldable_batchnorm(following[0]) else None
            if bn is not None:
                conv = _fold_batchnorm(conv, bn)
                following = following[1:]
            activation = following[0] if following else None
            make = _MODULE_POST_OPS.get(type(activation))
            post_op = make(activation) if make is not None and not _has_hooks(activation) else None
            container._modules[names[index]] = FusedConv2d(conv, post_op, prepack=not traceable)
            absorbed = (bn is not None) + (post_op is not None)
            for name in names[index + 1:index + 1 + absorbed]:
                container._modules[name] = nn.Identity()
            summary.fused[path] = _describe(bn is not None, False, post_op)
            index += 1 + absorbed

    for path, module in list(model.named_modules()):
        if fusable(module):
            _set_submodule(model, path, FusedConv2d(module, prepack=not traceable))
            summary.fused[path] = 'conv'
    return summary


# --------------------------------------------------------------------------------------------
# The public functions
# --------------------------------------------------------------------------------------------


class InferenceModel(nn.Module):
    """The eval-only fused copy :func:`fuse_for_inference` returns.

    ``forward`` takes what the original model took; 4D and 5D input tensors are put in NHWC
    first (no copy when they already are). It refuses to run in train mode or on an input
    that requires grad while grad mode is on.

    Attributes:
        module: the fused network (a ``torch.fx.GraphModule`` on the fx route).
        summary: the :class:`FusionSummary`.
    """

    def __init__(self, module: nn.Module, summary: FusionSummary) -> None:
        super().__init__()
        self.module = module
        self.summary = summary

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training:
            raise RuntimeError(
                'this fused inference copy is in train mode; it is eval-only (BatchNorm is folded, it has no '
                'backward). Call .eval() on it, or train the original model and fuse it again afterwards.')
        if torch.is_grad_enabled() and any(
                isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in tree_flatten((args, kwargs))[0]):
            raise RuntimeError(
                'an input to the fused inference copy requires grad; it has no backward (the fused kernels have '
                'no gradient and its weights are detached copies). Run it under torch.no_grad() or '
                'torch.inference_mode(), or differentiate the original model.')
        args, kwargs = batch_to_channels_last((args, kwargs))
        return self.module(*args, **kwargs)


def _max_relative_error(actual: Any, expected: Any) -> float:
    errors = []
    for a, e in zip(tree_flatten(actual)[0], tree_flatten(expected)[0]):
        if isinstance(e, torch.Tensor) and e.is_floating_point():
            scale = e.detach().abs().max().item() or 1.0
            errors.append((a.detach().float() - e.detach().float()).abs().max().item() / scale)
    return max(errors, default=0.0)


def _first_training_module(model: nn.Module) -> Optional[tuple[str, nn.Module]]:
    return next(((name, m) for name, m in model.named_modules() if m.training), None)


_REPAIRED_LAYERS = tuple(rule.replacement for rule in RULES if rule.original.__module__.startswith('torch.nn.'))


class _Tracer(fx.Tracer):
    """fx's tracer, keeping repaired ``torch.nn`` layers (:mod:`channels_last_algo.core.layers`) as
    leaves, as the built-in layers they replace are: their forwards branch on the input's shape,
    which symbolic tracing cannot follow."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, _REPAIRED_LAYERS) or super().is_leaf_module(module, qualified_name)


def fuse_for_inference(model: nn.Module, example_input: Any = None, *, traceable: bool = False,
                       rtol: float = 1e-4) -> InferenceModel:
    """An eval-only, NHWC, fused copy of ``model`` (see the module docstring for what is fused).

    Args:
        model: a conv net in eval mode. Not modified. Its parameters may require grad: the
            copy's do not.
        example_input: an input (a tensor, or a tuple of positional arguments) the copy is
            checked on: the fx route's output must match ``model``'s within ``rtol`` of the
            largest output magnitude, else the module route is taken, and its output must
            match too, else ``RuntimeError``. It also prepacks the weights for its shape. When
            None, nothing is run.
        traceable: keep plain weights (no oneDNN prepacking) and out-of-place residual adds,
            as ``torch.export`` needs them; slower in eager mode.
        rtol: the tolerance of the ``example_input`` check, relative to the largest output.

    Returns:
        An :class:`InferenceModel` (eval mode, no parameter requiring grad) with the
        :class:`FusionSummary` in ``.summary``.

    Raises:
        ValueError: when ``model`` or a submodule of it is in train mode.
    """
    training = _first_training_module(model)
    if training is not None:
        name, module = training
        where = f'its submodule {name!r} ({type(module).__name__})' if name else 'it'
        raise ValueError(
            f'fuse_for_inference needs {type(model).__name__} in eval mode, but {where} is in train mode, where '
            'BatchNorm uses batch statistics (nothing to fold) and Dropout is active; call model.eval() first. '
            'The fused copy is for inference only; keep training the original model.')
    inputs = example_input if isinstance(example_input, tuple) or example_input is None else (example_input,)

    def finish(network: nn.Module, summary: FusionSummary) -> InferenceModel:
        with torch.no_grad():
            apply_channels_last(network)
        fused = InferenceModel(network, summary).eval()
        fused.requires_grad_(False)
        return fused

    expected = []  # the model's output on the example input, computed once

    def mismatch(fused: InferenceModel) -> Optional[float]:
        if inputs is None:
            return None
        with torch.no_grad():
            if not expected:
                expected.append(model(*inputs))
            error = _max_relative_error(fused(*inputs), expected[0])
        return error if not error <= rtol else None

    trace_error = None
    try:
        root = copy.deepcopy(model)
        graph_module = fx.GraphModule(root, _Tracer().trace(root))
    except Exception as error:  # any model code can fail under symbolic tracing
        trace_error = f'{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ""}'
    else:
        fused = finish(graph_module, _fuse_graph(graph_module, traceable))
        error = mismatch(fused)
        if error is None:
            log.info('%s: %s', type(model).__name__, fused.summary)
            return fused
        trace_error = f'the traced graph output differs from the model by {error:.2e} (relative)'

    network = copy.deepcopy(model)
    fused = finish(network, _fuse_modules(network, traceable))
    fused.summary.trace_error = trace_error
    error = mismatch(fused)
    if error is not None:
        raise RuntimeError(f'the fused copy of {type(model).__name__} differs from it by {error:.2e} relative to its '
                           f'largest output (> rtol={rtol}) on the example input; please report this model')
    log.info('%s: %s', type(model).__name__, fused.summary)
    return fused


class FusedEvaluation:
    """Evaluate on a fused copy: swap it in for the network an owner module holds, then back.

    :meth:`start` replaces ``owner.<attribute>`` by :func:`fuse_for_inference` of that network
    as it is at that moment (its current weights: EMA's, say, when they are swapped in),
    checked on an example input when one is given; it does nothing while a copy is in.
    :meth:`end` puts the original object back (and does nothing when none is out), so anything
    that saves the owner afterwards saves the training network.

    Example:
        >>> holder = torch.nn.Module()
        >>> holder.net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
        >>> original = holder.net
        >>> evaluation = FusedEvaluation()
        >>> evaluation.start(holder, 'net')
        >>> type(holder.net).__name__, evaluation.active
        ('InferenceModel', True)
        >>> evaluation.end()
        >>> holder.net is original
        True
    """

    def __init__(self) -> None:
        self._swapped: Optional[tuple[nn.Module, str, nn.Module]] = None

    @property
    def active(self) -> bool:
        """Whether a fused copy is swapped in now."""
        return self._swapped is not None

    def start(self, owner: nn.Module, attribute: str = 'module', example_input: Any = None) -> None:
        """Swap a fused copy of ``owner.<attribute>`` in (see :func:`fuse_for_inference` for
        ``example_input``)."""
        if self._swapped is not None:
            return
        network = getattr(owner, attribute, None)
        if not isinstance(network, nn.Module):
            raise ValueError(f'{type(owner).__name__}.{attribute} is {type(network).__name__}, not the nn.Module to '
                             'fuse; name the attribute that holds the network')
        fused = fuse_for_inference(network, example_input)
        setattr(owner, attribute, fused)
        self._swapped = (owner, attribute, network)

    def end(self) -> None:
        """Put the original network back."""
        if self._swapped is None:
            return
        owner, attribute, network = self._swapped
        setattr(owner, attribute, network)
        self._swapped = None


_FAKE_BINARY_REGISTERED = False


def _register_fake_binary_convolution() -> None:
    """Give ``mkldnn::_convolution_pointwise.binary`` the shape function ``torch.export``
    needs (torch 2.7 ships one for the unary form only). The output has ``other``'s shape;
    a saved program runs without it."""
    global _FAKE_BINARY_REGISTERED
    if _FAKE_BINARY_REGISTERED:
        return
    try:
        torch.library.register_fake('mkldnn::_convolution_pointwise.binary')(
            lambda x, other, *args: torch.empty_like(other, memory_format=torch.channels_last))
    except RuntimeError as error:  # a torch that has its own
        log.debug('mkldnn::_convolution_pointwise.binary keeps its fake kernel: %s', error)
    _FAKE_BINARY_REGISTERED = True


def export_for_inference(model: nn.Module, path: Union[str, Path], example_input: torch.Tensor,
                         dynamic_batch: bool = True) -> tuple[torch.export.ExportedProgram, FusionSummary]:
    """Fuse ``model`` for inference and save it with ``torch.export`` to ``path`` (``.pt2``).

    The saved program holds the folded NHWC weights and calls the fused oneDNN kernels
    (``mkldnn::_convolution_pointwise``) directly, so it loads and runs without this package:
    ``torch.export.load(path).module()(images)``. Weights are not prepacked in it (oneDNN
    reorders them on each call), so it runs somewhat slower than :func:`fuse_for_inference`'s
    copy in the same process. The program is traced on CPU; inputs to it are expected NHWC.

    Args:
        model: the model, in eval mode (see :func:`fuse_for_inference`).
        path: the file to write.
        example_input: one input batch (N, C, H, W) of the shape and dtype to serve.
        dynamic_batch: let the batch size vary (needs ``example_input`` with N >= 2).

    Returns:
        The exported program that was saved, and what was fused.

    Raises:
        ValueError: ``model`` is in train mode, or a dynamic batch has an example batch of 1.

    Example:
        .. code-block:: python

            export_for_inference(model.eval(), 'resnet50.pt2', torch.randn(2, 3, 224, 224))
            logits = torch.export.load('resnet50.pt2').module()(images)
    """
    if dynamic_batch and example_input.shape[0] < 2:
        raise ValueError(f'export with a dynamic batch size needs an example batch of at least 2, got shape '
                         f'{tuple(example_input.shape)}; repeat the example along the batch dimension, or fix the '
                         'batch size (dynamic_batch=False; --static-batch for `channels-last export`)')
    fused = fuse_for_inference(model, example_input, traceable=True)
    _register_fake_binary_convolution()
    example = to_channels_last(example_input)
    dynamic_shapes = {'args': ({0: torch.export.Dim('batch', min=1, max=2**16)},)} if dynamic_batch else None
    with torch.no_grad():
        program = torch.export.export(fused, (example,), dynamic_shapes=dynamic_shapes, strict=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, path)
    log.info('saved %s (%s) to %s', type(model).__name__, fused.summary, path)
    return program, fused.summary
