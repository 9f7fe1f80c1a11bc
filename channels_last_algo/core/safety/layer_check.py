"""The float32 kernel check: every layer's channels-last kernels against float64, on the same inputs.

Comparing a whole float32 training step in channels last with one in NCHW cannot tell a kernel
bug from rounding: a pre-activation that rounds to -8.8e-6 in one layout and to +6.0e-6 in the
other flips a ReLU, and every gradient below it moves by percents (seen on timm's repvgg_a0).
So each leaf layer that takes a 4D/5D tensor is checked on its own: its input and the gradient
of its output are recorded in one float32 NCHW step, then the layer runs forward and backward
on exactly those tensors three times, as a float64 NCHW copy (the reference), as the float32
NCHW layer and as the float32 layer of the converted model on NHWC copies of them. A kernel
is wrong when channels last is further from float64 than ``factor`` times NCHW's own rounding
error plus ``floor`` (relative to the largest magnitude of each tensor).

Example:
    >>> import copy, torch
    >>> from channels_last_algo.core.convert import apply_channels_last
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    >>> converted = copy.deepcopy(model)
    >>> summary = apply_channels_last(converted)
    >>> result = check_layers(model, converted, torch.randn(2, 3, 8, 8), loss=lambda out: out.square().sum())
    >>> result['layers'], result['failed']
    (3, [])
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from channels_last_algo.core.layout import channels_last_format, to_channels_last

__all__ = ['check_layers', 'relative_error']


def _record(
    model: nn.Module, x: torch.Tensor, loss: Callable[[Any], torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(input, output gradient) of every leaf layer called once with one 4D/5D tensor and
    returning one tensor, from one forward and backward of ``model``."""
    inputs: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}

    def before(path: str, args: tuple) -> None:
        calls[path] = calls.get(path, 0) + 1
        if len(args) == 1 and isinstance(args[0], torch.Tensor) and channels_last_format(args[0]) is not None:
            inputs[path] = args[0].detach().clone()

    def after(path: str, output: Any) -> None:
        if calls[path] == 1 and path in inputs and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: grads.__setitem__(path, grad.detach().clone()))

    handles = []
    for path, module in model.named_modules():
        if not any(True for _ in module.children()):
            handles.append(module.register_forward_pre_hook(lambda m, args, path=path: before(path, args)))
            handles.append(module.register_forward_hook(lambda m, args, out, path=path: after(path, out)))
    try:
        loss(model(x)).backward()
    finally:
        for handle in handles:
            handle.remove()
    return {path: (inputs[path], grads[path]) for path in grads if calls[path] == 1}


def _layer_values(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, input gradient and parameter gradients of ``layer`` on ``x`` with output gradient ``grad``."""
    leaf = x.detach().clone().requires_grad_()
    output = layer(leaf.clone())  # a non-leaf input, so an in-place layer may run
    params = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
    found = torch.autograd.grad(output, [leaf] + [p for _, p in params], grad, allow_unused=True)
    values = {'output': output.detach(), 'input gradient': found[0]}
    values.update({f'{n} gradient': g for (n, _), g in zip(params, found[1:]) if g is not None})
    return {name: value.double() for name, value in values.items() if value is not None}


def relative_error(values: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest difference from ``reference``, relative to the largest magnitude of ``reference``."""
    return (values - reference).abs().max().item() / (reference.abs().max().item() or 1.0)


def check_layers(
    reference: nn.Module,
    converted: nn.Module,
    x: torch.Tensor,
    loss: Callable[[Any], torch.Tensor],
    factor: float = 10.0,
    floor: float = 1e-4,
) -> dict[str, Any]:
    """Check every leaf layer of ``converted`` (channels last) against ``reference`` (NCHW, the
    same weights and module paths) on the float32 input ``x``, ``loss`` turning the model's
    output into the scalar whose backward gives the recorded output gradients.

    Returns:
        ``layers``: how many were checked; ``failed``: ``'path: tensor'`` for each tensor where
        channels last exceeds ``factor`` x NCHW's error + ``floor``; ``worst``, ``error`` and
        ``nchw_error``: the tensor closest to (or furthest past) that limit and its two errors.
    """
    found: dict[str, Any] = {'layers': 0, 'failed': [], 'worst': '', 'error': 0.0, 'nchw_error': 0.0}
    worst_ratio = -1.0
    for path, (inp, grad) in _record(reference, x, loss).items():
        layer = reference.get_submodule(path)
        truth = _layer_values(copy.deepcopy(layer).double(), inp.double(), grad.double())
        nchw = _layer_values(copy.deepcopy(layer), inp, grad)
        last = _layer_values(
            copy.deepcopy(converted.get_submodule(path)), to_channels_last(inp), to_channels_last(grad)
        )
        found['layers'] += 1
        for name, value in truth.items():
            error, nchw_error = relative_error(last[name], value), relative_error(nchw[name], value)
            ratio = error / (factor * nchw_error + floor)
            if ratio > 1:
                found['failed'].append(f'{path}: {name}')
            if ratio > worst_ratio:
                worst_ratio = ratio
                found.update(worst=f'{path}: {name}', error=error, nchw_error=nchw_error)
    return found
