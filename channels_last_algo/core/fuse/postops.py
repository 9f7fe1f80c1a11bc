"""Post-ops: the elementwise activations a fused convolution applies to its output, and how
each is recognised as a module, a function or a tensor method.

A :class:`PostOp` names the activation as oneDNN's ``torch.ops.mkldnn._convolution_pointwise``
takes it and computes it with plain PyTorch ops (:meth:`PostOp.eager`: the fallback and the
reference). :func:`post_op_of_module` and :func:`post_op_of_call` read the three tables below.

Example:
    >>> post_op_of_module(torch.nn.ReLU6())
    PostOp(attr='hardtanh', scalars=(0.0, 6.0), algorithm='')
    >>> str(post_op_of_module(torch.nn.SiLU())), post_op_of_module(torch.nn.Softmax()) is None
    ('silu', True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = ['RELU', 'PostOp', 'has_hooks', 'post_op_of_call', 'post_op_of_module']

_EAGER: dict[str, Callable[[torch.Tensor, tuple, str], torch.Tensor]] = {
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
        return _EAGER[self.attr](x, self.scalars, self.algorithm)

    def __str__(self) -> str:
        return {'hardtanh': 'relu6' if self.scalars == (0.0, 6.0) else 'hardtanh', 'swish': 'silu'}.get(
            self.attr, self.attr
        )


RELU = PostOp('relu')

# Activation modules (exact types: a subclass may change the math) -> their post-op.
_MODULES: dict[type, Callable[[nn.Module], PostOp]] = {
    nn.ReLU: lambda m: RELU,
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

# Activation functions and tensor methods called on one tensor alone (only an ``inplace``
# flag, or GELU's ``approximate``, besides it) -> their post-op.
_FUNCTIONS: dict[Any, PostOp] = {
    F.relu: RELU,
    torch.relu: RELU,
    torch.relu_: RELU,
    F.relu_: RELU,
    F.relu6: PostOp('hardtanh', (0.0, 6.0)),
    F.silu: PostOp('swish'),
    F.hardswish: PostOp('hardswish'),
    torch.sigmoid: PostOp('sigmoid'),
    F.sigmoid: PostOp('sigmoid'),
    F.hardsigmoid: PostOp('hardsigmoid'),
    torch.tanh: PostOp('tanh'),
    F.tanh: PostOp('tanh'),
    F.gelu: PostOp('gelu', algorithm='none'),
}
_METHODS: dict[str, PostOp] = {
    'relu': RELU,
    'relu_': RELU,
    'sigmoid': PostOp('sigmoid'),
    'sigmoid_': PostOp('sigmoid'),
    'tanh': PostOp('tanh'),
    'tanh_': PostOp('tanh'),
}


def has_hooks(module: nn.Module) -> bool:
    """Whether forward (pre-)hooks watch ``module``: fusing it away would silence them."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def post_op_of_module(module: nn.Module) -> Optional[PostOp]:
    """The post-op an activation module computes, or None (not one, or hooked): a ``torch.nn`` activation,
    or a module from elsewhere whose forward is one activation call on its input (transformers'
    ``SiLUActivation`` calls ``F.silu``)."""
    if has_hooks(module):
        return None
    make = _MODULES.get(type(module))
    if make is not None:
        return make(module)
    stateless = not (module._modules or module._parameters or module._buffers)
    return _one_call_post_op(module) if stateless and not type(module).__module__.startswith('torch.') else None


def _one_call_post_op(module: nn.Module) -> Optional[PostOp]:
    """The post-op of ``module``'s forward where, traced, it is one call on its one input, returned."""
    try:
        nodes = list(fx.Tracer().trace(module).nodes)
    except Exception:  # any forward can fail on proxies
        return None
    ops = [node.op for node in nodes]
    if ops[:1] != ['placeholder'] or ops[1:] not in (['call_function', 'output'], ['call_method', 'output']):
        return None
    return post_op_of_call(nodes[1], nodes[0]) if nodes[2].args[0] is nodes[1] else None


def post_op_of_call(node: fx.Node, source: fx.Node) -> Optional[PostOp]:
    """The post-op a ``call_function`` / ``call_method`` node computes from ``source`` alone, or None."""
    if not node.args or node.args[0] is not source:
        return None
    extra = list(node.args[1:]) + [v for k, v in node.kwargs.items() if k != 'approximate']
    if not all(isinstance(v, bool) for v in extra) or set(node.kwargs) - {'inplace', 'approximate'}:
        return None
    if node.op == 'call_function' and node.target in _FUNCTIONS:
        post_op = _FUNCTIONS[node.target]
        if post_op.attr == 'gelu':
            return PostOp('gelu', algorithm=node.kwargs.get('approximate', 'none'))
        return None if 'approximate' in node.kwargs else post_op
    if node.op == 'call_method' and node.target in _METHODS and not node.kwargs:
        return _METHODS[node.target]
    return None
