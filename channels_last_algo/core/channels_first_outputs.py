"""The forward hook that makes a module's NHWC outputs channels first: where a ``.view()`` of them needs NCHW strides.

:class:`~channels_last_algo.core.viewed_outputs.ViewedOutputs` puts it on the module whose output code views
(:func:`make_outputs_channels_first`), before the module's own hooks. A module of one tensor in and one out gets a
form ``torch.jit.script`` compiles, so that the model still scripts and makes the output contiguous there as eager
does; the copy counts as an exit in the layout audit.

Example:
    >>> import torch
    >>> conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    >>> make_outputs_channels_first(conv, one_tensor=True)
    >>> conv(torch.randn(1, 3, 5, 5).to(memory_format=torch.channels_last)).is_contiguous()
    True
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from channels_last_algo.core.audit import exit_copies
from channels_last_algo.core.module_calls import in_graph_capture
from channels_last_algo.core.view_watch import nhwc

__all__ = ['channels_first_output', 'channels_first_outputs', 'make_outputs_channels_first']


def make_outputs_channels_first(module: torch.nn.Module, one_tensor: bool) -> None:
    """Hook ``module`` (before its own hooks) to return its NHWC outputs contiguous; ``one_tensor``: it was seen
    returning one tensor, and its forward takes one argument too, the form TorchScript compiles."""
    scriptable = one_tensor and _one_tensor_in(module)
    module.register_forward_hook(channels_first_output if scriptable else channels_first_outputs, prepend=True)


def _channels_first(output: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.contiguous() if nhwc(t) else t, output)


def channels_first_outputs(module: torch.nn.Module, args: tuple, output: Any) -> Any:
    """A forward hook: ``output`` with its NHWC tensors made contiguous (channels first), which the
    layout audit counts as exits."""
    if in_graph_capture():
        return _channels_first(output)
    with exit_copies():
        return _channels_first(output)


def channels_first_output(module: Any, args: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    """:func:`channels_first_outputs` for a module of one tensor in and one out, in a form
    ``torch.jit.script`` compiles: a scripted model makes the output contiguous as eager does."""
    if torch.jit.is_scripting():
        return output.contiguous()
    return _eager_channels_first(module, args, output)


@torch.jit.unused
def _eager_channels_first(module: Any, args: Any, output: Any) -> Any:
    return channels_first_outputs(module, args, output)


def _one_tensor_in(module: torch.nn.Module) -> bool:
    """Whether ``module.forward`` takes one argument (the hook TorchScript types as ``Tuple[Tensor]``)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1 and next(iter(parameters)).kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
