"""The fusion patterns: a table from a run of ops to the fused op that replaces it, read by
both routes (:mod:`.graph` on an fx trace, :mod:`.modules` on ``nn.Sequential`` containers).

:data:`FUSION_PATTERNS` maps a pattern (a tuple of :class:`Element`, in the order the ops run)
to its fuser method, in the manner of ``torch.ao.quantization``'s fuser method mappings: the
fuser takes what each element matched and returns the module that replaces the run. At a
convolution the first pattern in the table that matches wins; a fuser that returns a plain
``nn.Conv2d`` (BatchNorm folding) leaves it to be matched again, so ``conv -> bn -> relu``
becomes a fold and then a conv + ReLU kernel. Every fusable 2D convolution ends as a
:class:`~channels_last_algo.core.fuse.conv.FusedConv2d`, with the last pattern at least; a 3D
convolution (video, volumes) folds its BatchNorm and stays an ``nn.Conv3d``, channels last 3D.

An element sees either a module (:attr:`Element.of_module`: an ``nn.Sequential`` child, or
the module an fx ``call_module`` node calls) or an fx ``call_function`` / ``call_method``
node (:attr:`Element.of_call`: functional activations, residual adds); the module route
never sees an add, so the patterns with one are the fx route's alone.

Example:
    >>> [' -> '.join(element.name for element in pattern) for pattern in FUSION_PATTERNS]
    ['conv -> bn', 'conv3d -> bn', 'conv -> add -> relu', 'conv -> add', 'conv -> activation', 'conv']
    >>> conv, bn = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8).eval()
    >>> match = match_pattern([conv, bn], lambda element, module, previous: element.of_module(module))
    >>> match.names, type(match.fuse(prepack=True)).__name__
    (['conv', 'bn'], 'Conv2d')
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import fx, nn
from torch.nn.utils.fusion import fuse_conv_bn_weights

from channels_last_algo.core.fuse.conv import FusedConv2d
from channels_last_algo.core.fuse.plain_convs import as_plain_conv2d, keeps_conv_forward
from channels_last_algo.core.fuse.postops import RELU, PostOp, has_hooks, post_op_of_call, post_op_of_module
from channels_last_algo.core.layout import to_channels_last

__all__ = [
    'FUSION_PATTERNS',
    'Element',
    'Match',
    'batchnorm_holding',
    'batchnorm_paths',
    'fold_batchnorm',
    'fuse_chain',
    'is_eval_identity',
    'match_pattern',
]


def _none(*args: Any) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Element:
    """One op of a fusion pattern, as both routes see it.

    Attributes:
        name: what the fused kernel's description calls it (``'conv+bn+relu'``).
        of_module: a module -> what it contributes to the fusion, or None where it does not match.
        of_call: an fx ``call_function`` / ``call_method`` node and the node before it in the
            run -> what it contributes, or None.
        operand: the value it contributes is another input of the fused op (a residual).
        describe: the value -> its part of the description (default: ``name``).
    """

    name: str
    of_module: Callable[[nn.Module], Any] = _none
    of_call: Callable[[fx.Node, fx.Node], Any] = _none
    operand: bool = False
    describe: Optional[Callable[[Any], str]] = None

    def __repr__(self) -> str:
        return self.name.upper()


def _foldable_batchnorm(module: nn.Module) -> Optional[nn.Module]:
    foldable = (
        type(module) in (nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
        and module.track_running_stats
        and module.running_mean is not None
        and not has_hooks(module)
    )
    return module if foldable else None


def batchnorm_paths(module: nn.Module) -> list[str]:
    """The module paths of the BatchNorms in ``module``: in a fused network, those left unfused."""
    return [path for path, child in module.named_modules() if isinstance(child, nn.modules.batchnorm._BatchNorm)]


def _only_relu(post_op: Optional[PostOp]) -> Optional[PostOp]:
    return post_op if post_op == RELU else None


_ADDS = (operator.add, torch.add)
_IN_PLACE_ADDS = (operator.iadd,)


def _residual_of(node: fx.Node, previous: fx.Node) -> Optional[fx.Node]:
    """The other operand when ``node`` adds a tensor to ``previous``, else None. In-place adds
    only onto ``previous`` (``identity += conv(x)`` mutates ``identity``, which others may read)."""
    if node.kwargs or len(node.args) != 2:
        return None
    first, second = node.args
    in_place = (node.op == 'call_function' and node.target in _IN_PLACE_ADDS) or (
        node.op == 'call_method' and node.target == 'add_'
    )
    out_of_place = (node.op == 'call_function' and node.target in _ADDS) or (
        node.op == 'call_method' and node.target == 'add'
    )
    if not (in_place or out_of_place) or not isinstance(first, fx.Node) or not isinstance(second, fx.Node):
        return None
    if first is previous and second is not previous:
        return second
    if second is previous and first is not previous and out_of_place:
        return first
    return None


CONV = Element('conv', of_module=lambda m: None if has_hooks(m) else as_plain_conv2d(m))
CONV3D = Element(
    'conv3d', of_module=lambda m: m if isinstance(m, nn.Conv3d) and keeps_conv_forward(m) and not has_hooks(m) else None
)
BATCHNORM = Element('bn', of_module=_foldable_batchnorm)
ACTIVATION = Element('activation', of_module=post_op_of_module, of_call=post_op_of_call, describe=str)
RELU_ONLY = Element(
    'relu',
    of_module=lambda m: _only_relu(post_op_of_module(m)),
    of_call=lambda node, previous: _only_relu(post_op_of_call(node, previous)),
    describe=str,
)
ADD = Element('add', of_call=_residual_of, operand=True)


def batchnorm_holding(
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> nn.BatchNorm2d:
    """An eval-mode ``nn.BatchNorm2d`` holding these statistics and affine parameters (not copied): what a
    functional ``batch_norm`` computes, or a slice of a BatchNorm's channels, to call or to fold."""
    batch_norm = nn.BatchNorm2d(mean.numel(), eps=eps, affine=weight is not None).eval()
    batch_norm.running_mean, batch_norm.running_var = mean, var
    if weight is not None:
        batch_norm.weight, batch_norm.bias = (nn.Parameter(t.detach(), requires_grad=False) for t in (weight, bias))
    return batch_norm


def fold_batchnorm(conv: nn.Module, bn: nn.Module, *, prepack: bool) -> nn.Module:
    """A copy of ``conv`` with ``bn`` (eval mode: running statistics) folded in, computed in
    float64, weight channels last; matched again (``prepack`` is for the fused op it becomes)."""
    del prepack
    dtype = conv.weight.dtype
    args = [
        None if t is None else t.detach().double() for t in (conv.weight, conv.bias, bn.running_mean, bn.running_var)
    ]
    affine = [None if t is None else t.detach().double() for t in (bn.weight, bn.bias)]
    weight, bias = fuse_conv_bn_weights(*args, bn.eps, *affine)
    folded = copy.deepcopy(conv)
    folded.weight = nn.Parameter(to_channels_last(weight.detach().to(dtype)), requires_grad=False)
    folded.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
    return folded


def fuse_conv_add_relu(conv: nn.Conv2d, residual: Any, relu: PostOp, *, prepack: bool) -> FusedConv2d:
    """``relu(conv(x) + residual)``: oneDNN's binary convolution with an add and a ReLU post-op."""
    return FusedConv2d(conv, relu, add=True, prepack=prepack)


def fuse_conv_add(conv: nn.Conv2d, residual: Any, *, prepack: bool) -> FusedConv2d:
    """``conv(x) + residual``: oneDNN's binary convolution with an add post-op."""
    return FusedConv2d(conv, add=True, prepack=prepack)


def fuse_conv_activation(conv: nn.Conv2d, post_op: PostOp, *, prepack: bool) -> FusedConv2d:
    """``activation(conv(x))``: oneDNN's convolution with the activation as a unary post-op."""
    return FusedConv2d(conv, post_op, prepack=prepack)


def fuse_conv(conv: nn.Conv2d, *, prepack: bool) -> FusedConv2d:
    """``conv(x)`` alone, NHWC, on prepacked weights."""
    return FusedConv2d(conv, prepack=prepack)


Fuser = Callable[..., nn.Module]

# pattern (ops in the order they run) -> the fuser method that builds its replacement
FUSION_PATTERNS: dict[tuple[Element, ...], Fuser] = {
    (CONV, BATCHNORM): fold_batchnorm,
    (CONV3D, BATCHNORM): fold_batchnorm,  # then the plain NDHWC conv3d: no fused kernel takes it here
    (CONV, ADD, RELU_ONLY): fuse_conv_add_relu,
    (CONV, ADD): fuse_conv_add,
    (CONV, ACTIVATION): fuse_conv_activation,
    (CONV,): fuse_conv,
}

LONGEST_PATTERN = max(len(pattern) for pattern in FUSION_PATTERNS)

_EVAL_IDENTITY_MODULES = (
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def is_eval_identity(module: nn.Module) -> bool:
    """Whether ``module`` returns its input in eval mode (Identity, the Dropouts), unhooked:
    nothing a pattern has to step over."""
    return type(module) in _EVAL_IDENTITY_MODULES and not has_hooks(module)


@dataclasses.dataclass
class Match:
    """A pattern found on a run of ops (``items``: modules, names or fx nodes, as the route has them)."""

    pattern: tuple[Element, ...]
    fuser: Fuser
    values: list[Any]
    items: list[Any]

    @property
    def names(self) -> list[str]:
        """Each element's part of the fused kernel's description."""
        return [e.name if e.describe is None else e.describe(v) for e, v in zip(self.pattern, self.values)]

    @property
    def operands(self) -> list[Any]:
        """The values that are further inputs of the fused op (the residual of an add)."""
        return [value for element, value in zip(self.pattern, self.values) if element.operand]

    def fuse(self, prepack: bool) -> nn.Module:
        """The module that replaces the run."""
        return self.fuser(*self.values, prepack=prepack)


def match_pattern(run: Sequence[Any], value_of: Callable[[Element, Any, Any], Any]) -> Optional[Match]:
    """The first pattern of :data:`FUSION_PATTERNS` that matches the start of ``run``.

    ``value_of(element, item, previous_item)`` says what ``item`` contributes as ``element``
    (None: no match); ``previous_item`` is None for the first.
    """
    for pattern, fuser in FUSION_PATTERNS.items():
        if len(pattern) > len(run):
            continue
        values = []
        for index, element in enumerate(pattern):
            value = value_of(element, run[index], run[index - 1] if index else None)
            if value is None:
                break
            values.append(value)
        else:
            return Match(pattern, fuser, values, list(run[: len(pattern)]))
    return None


def fuse_chain(
    run_at: Callable[[], Sequence[Any]],
    value_of: Callable[[Element, Any, Any], Any],
    replace: Callable[[Match, nn.Module], None],
    prepack: bool,
) -> Optional[str]:
    """Apply the table at one place until nothing matches there any more.

    Args:
        run_at: the run of ops from that place as it is now (it changes with each replacement).
        value_of: see :func:`match_pattern`.
        replace: puts the fused module in place of a match's run.
        prepack: passed to the fusers (see :class:`~channels_last_algo.core.fuse.conv.FusedConv2d`).

    Returns:
        The fused kernel's description (``'conv+bn+add+relu'``), or None when nothing matched.
    """
    parts: list[str] = []
    while (match := match_pattern(run_at(), value_of)) is not None:
        replace(match, match.fuse(prepack))
        parts.extend(match.names[1:] if parts else match.names)
    return '+'.join(parts) if parts else None
