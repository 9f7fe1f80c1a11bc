"""The boundary fallback: NHWC restored around a module that drops it and that no rule repairs.

A repair rule removes a break where it happens; where none applies (a functional call or a
tensor op inside some module's forward), :func:`repair_breaks` takes the layout audit's
findings and restores NHWC at the boundary of each module that holds a break:

- forward: a channels-first 4D/5D output of the module is copied to channels last, so the
  layers after it run NHWC;
- backward: a channels-first gradient of the module's 4D/5D inputs is copied to channels
  last, so the layers before it get an NHWC gradient.

The break inside the module stays (the audit still lists it), and each restore costs one
copy of the tensor it restores, only when that tensor is channels first (an NHWC or ambiguous
tensor passes untouched). A break can be the consequence of another (an activation that
receives NCHW from the module before it), so :func:`prune_boundaries` takes off, after a
second audit, the boundaries that copied nothing (and all of them where they did not lower
the number of breaks). The copies run as the op ``channels_last_algo::restore_channels_last``,
so the audit reports them apart from breaks, with their bytes (``report.fallbacks``).

The fallback is two module hooks (a forward hook and a forward pre-hook that registers a
gradient hook on the inputs), so the module keeps its class, ``Parameter`` objects and
``state_dict`` keys. ``torch.fx.symbolic_trace`` does not run module hooks, and the hooks do
nothing under ``torch.jit.script``, ``torch.jit.trace`` (what the TorchScript ONNX exporter
runs), ``torch.compile`` and ``torch.export`` (what the dynamo ONNX exporter runs), whose
graphs get their layouts from the compiler, so the op never reaches an exporter; the
numbers are the same with or without them. TorchScript compiles a module's hooks with the
types of its forward, and the hooks are typed for one tensor in and out, so a break inside a
module whose forward takes more than one argument gets its boundary at the nearest enclosing
module that takes one; :func:`remove_boundaries` takes the hooks off.

Example:
    >>> import torch
    >>> from channels_last_algo.core.audit import audit_model
    >>> class Drop(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.contiguous() * 2             # drops NHWC: no rule knows this module
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), Drop(), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    >>> model = model.to(memory_format=torch.channels_last)
    >>> x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    >>> [record.path for record in repair_breaks(model, audit_model(model, x))]   # '2' breaks after '1'
    ['1', '2']
    >>> report = audit_model(model, x)
    >>> [(r.op, r.module_path, r.phase) for r in report.breaks]                     # the break inside '1'
    [('aten.clone.default', '1', 'forward')]
    >>> [(r.module_path, r.phase, r.nbytes) for r in report.fallbacks]             # one copy of '1's output
    [('1', 'forward', 2304)]
    >>> prune_boundaries(model, report)                                              # '2' copied nothing
    ['2']
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from channels_last_algo.core.audit import FALLBACK_OP, AuditReport
from channels_last_algo.core.layers.rules import RepairRecord, qualified_name
from channels_last_algo.core.layout import layout_of

__all__ = [
    'BOUNDARY_RULE',
    'has_boundary',
    'prune_boundaries',
    'remove_boundaries',
    'repair_breaks',
    'restore_boundary',
    'restore_channels_last',
]

BOUNDARY_RULE = 'boundary_fallback'
"""The rule name of a boundary in :class:`~channels_last_algo.core.layers.RepairRecord`."""

_PATH_ATTRIBUTE = '_channels_last_boundary'  # the module's path, set on a module with a boundary


def _format_of(x: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if x.dim() == 4 else torch.channels_last_3d


@torch.library.custom_op(FALLBACK_OP, mutates_args=())
def restore_channels_last(x: torch.Tensor, where: str) -> torch.Tensor:
    """A channels-last copy of the 4D/5D tensor ``x``; ``where`` names the module, for the audit."""
    return x.clone(memory_format=_format_of(x))


@restore_channels_last.register_fake
def _restore_channels_last_fake(x: torch.Tensor, where: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=_format_of(x))


def _restore_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


restore_channels_last.register_autograd(_restore_backward)


def _in_graph_capture() -> bool:
    """True while a tracer or compiler records the model: layouts are its business there."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.compiler.is_exporting()


def _restored(value: Any, where: str) -> Any:
    def restore(t: torch.Tensor) -> torch.Tensor:
        return restore_channels_last(t, where) if layout_of(t).is_channels_first else t

    return tree_map_only(torch.Tensor, restore, value)


def _restore_gradient(where: str, grad: torch.Tensor) -> torch.Tensor:
    return _restored(grad, where)


def _restore_output(module: nn.Module, args: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    """Forward hook: the module's channels-first 4D/5D outputs, copied to channels last."""
    if torch.jit.is_scripting():
        return output
    else:
        if _in_graph_capture():
            return output
        return _restored(output, getattr(module, _PATH_ATTRIBUTE))


def _restore_input_gradients(module: nn.Module, args: tuple[torch.Tensor]) -> None:
    """Forward pre-hook: the gradients of the module's 4D/5D inputs, copied to channels last
    when they arrive channels first."""
    if torch.jit.is_scripting():
        pass
    else:
        if torch.is_grad_enabled() and not _in_graph_capture():
            hook = functools.partial(_restore_gradient, getattr(module, _PATH_ATTRIBUTE))
            for value in tree_flatten(args)[0]:
                if isinstance(value, torch.Tensor) and value.requires_grad and value.dim() in (4, 5):
                    value.register_hook(hook)


def has_boundary(module: nn.Module) -> bool:
    """True when :func:`restore_boundary` has put the fallback on ``module``."""
    return hasattr(module, _PATH_ATTRIBUTE)


def restore_boundary(module: nn.Module, path: str) -> bool:
    """Put the fallback on ``module`` (named ``path`` in the audit); False if it already has it."""
    if has_boundary(module):
        return False
    setattr(module, _PATH_ATTRIBUTE, path)
    module.register_forward_pre_hook(_restore_input_gradients)
    module.register_forward_hook(_restore_output)
    return True


def _remove_boundary(module: nn.Module) -> None:
    delattr(module, _PATH_ATTRIBUTE)
    for hooks, hook in (
        (module._forward_pre_hooks, _restore_input_gradients),
        (module._forward_hooks, _restore_output),
    ):
        for key in [key for key, value in hooks.items() if value is hook]:
            del hooks[key]


def remove_boundaries(model: nn.Module) -> list[str]:
    """Take every fallback off ``model``'s modules; the paths of the modules that had one."""
    removed = []
    for path, module in model.named_modules():
        if has_boundary(module):
            _remove_boundary(module)
            removed.append(path)
    return removed


def prune_boundaries(model: nn.Module, report: AuditReport, before: Optional[AuditReport] = None) -> list[str]:
    """Take the fallback off the modules of ``model`` that copied nothing in ``report`` (an audit
    run after :func:`repair_breaks`), and off all of them if, with ``before`` (the audit that
    placed them) given, ``report`` has no fewer breaks than ``before``: then the fallback only
    moved the breaks around (4D tensors that are not images, such as the N x C x patch x token
    tensors of some attention blocks, go back and forth). Its copies are not counted: they
    stand for the mixed-layout work (reorders inside convolutions, NCHW activations) that the
    audit cannot see. The paths of the modules it was taken off."""
    copied = {record.module_path for record in report.fallbacks}
    useless = before is not None and len(report.breaks) >= len(before.breaks)
    pruned = []
    for path, module in model.named_modules():
        if has_boundary(module) and (useless or getattr(module, _PATH_ATTRIBUTE) not in copied):
            _remove_boundary(module)
            pruned.append(path)
    return pruned


def _takes_one_input(module: nn.Module) -> bool:
    """True when ``module.forward`` has exactly one parameter (the boundary hooks' signature)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1 and next(iter(parameters)).kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


def _boundary_path(model: nn.Module, path: str) -> Optional[str]:
    """``path``, or the nearest enclosing module's path whose forward takes one input (not the model)."""
    while path:
        if _takes_one_input(model.get_submodule(path)):
            return path
        path = path.rpartition('.')[0]
    return None


def repair_breaks(model: nn.Module, report: AuditReport) -> list[RepairRecord]:
    """Restore NHWC at the boundary of every module of ``model`` where ``report`` (an audit of
    ``model``, after its rules were applied) found an op that drops NHWC.

    Breaks outside any module (the loss) or in the model itself (its own output and input
    gradient are not inside the network), and copies back into NHWC (the symptom of an
    earlier break, not a cause) get no boundary. A break in a module whose forward takes more
    than one argument gets its boundary at the nearest enclosing module that takes one.

    Returns:
        One :class:`~channels_last_algo.core.layers.rules.RepairRecord` (rule ``'boundary_fallback'``)
        per module that got a boundary, its ``detail`` naming the ops it holds.
    """
    held: dict[str, set[str]] = {}
    for record in report.breaks:
        if record.module_path and record.layouts.split('->')[0] in ('NHWC', 'NDHWC'):
            path = _boundary_path(model, record.module_path)
            if path is not None:
                held.setdefault(path, set()).add(f'{record.op} ({record.phase})')
    records = []
    for path, ops in held.items():
        module = model.get_submodule(path)
        if restore_boundary(module, path):
            records.append(
                RepairRecord(
                    path, qualified_name(type(module)), BOUNDARY_RULE, 'restores NHWC around ' + ', '.join(sorted(ops))
                )
            )
    return records
