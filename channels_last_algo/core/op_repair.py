"""Op repair: NHWC kept through the functional calls and tensor ops of the modules where an audit found breaks.

A repair rule removes a break where a known module class makes it; a break written as a function
call or a tensor op (``torch.cat``, ``x[:, :k]``, ``x.mean((2, 3))``, an attention reshape back to
N x C x H x W, ``.contiguous()``) has no class to swap. :func:`repair_ops` takes the layout
audit's findings and puts a *layout policy* on each module where a break ran (the innermost module
of the break, the model itself included). While such a module's own forward runs, every torch call
it makes goes through the policy (a ``TorchFunctionMode``; the calls of its submodules that hold no
break do not), which keeps the op's output and gradient in the layout of its NHWC operands (the rules are in
:mod:`~channels_last_algo.core.op_policy`). Nothing is installed in a model without breaks.

The policy is entered from process-wide module hooks keyed by the repaired modules, so each module
keeps its class, ``Parameter`` objects, ``state_dict`` keys and its own hooks, and TorchScript
never sees it; a copy of the model in the same process (``copy.deepcopy``, an EMA model) keeps it,
since the module carries its path as an attribute. It acts only in eager execution:
``torch.fx.symbolic_trace``, ``torch.jit.script``, ``torch.jit.trace`` (the TorchScript ONNX
exporter), ``torch.compile`` and ``torch.export`` (the dynamo ONNX exporter) record the model's own
ops, with the same numbers. After a second audit,
:func:`prune_op_repairs` takes the policy off modules where it changed nothing, and off all of
them where the breaks did not become fewer (4D tensors that are not images, such as an attention
block's batch x heads x tokens x tokens maps, only move around).

Example:
    >>> import torch
    >>> from channels_last_algo.core.audit import audit_model
    >>> class Mix(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.conv = torch.nn.Conv2d(4, 8, 1)
    ...     def forward(self, x):
    ...         y = self.conv(x[:, :4]).contiguous()                    # a channel slice, an NCHW copy
    ...         return torch.relu(y) + x.mean((2, 3), keepdim=True)     # a global mean, as a function
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), Mix(), torch.nn.Conv2d(8, 4, 3))
    >>> model = model.to(memory_format=torch.channels_last)
    >>> x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    >>> [(r.op, r.module_path, r.phase) for r in audit_model(model, x).breaks]  # doctest: +NORMALIZE_WHITESPACE
    [('aten.clone.default', '1', 'forward'), ('aten.threshold_backward.default', '1', 'backward'),
     ('aten.slice_backward.default', '1', 'backward')]
    >>> [record.path for record in repair_ops(model, audit_model(model, x))]
    ['1']
    >>> report = audit_model(model, x)
    >>> report.breaks, [(r.module_path, r.phase, r.nbytes) for r in report.fallbacks]
    ([], [('1', 'backward', 2304)])
    >>> remove_op_repairs(model)
    ['1']
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from channels_last_algo.core.audit import AuditReport
from channels_last_algo.core.op_policy import OpLayoutPolicy, restore_channels_last
from channels_last_algo.core.swap import SwapRecord, qualified_name

__all__ = [
    'OP_REPAIR_RULE',
    'has_op_repair',
    'prune_op_repairs',
    'remove_op_repairs',
    'repair_ops',
    'restore_channels_last',
]

OP_REPAIR_RULE = 'op_layout_policy'
"""The reason of an op repair's :class:`~channels_last_algo.core.swap.SwapRecord` (kind ``'op_repair'``)."""

# (the module's path, the sorted aten ops the audit found there), set on a repaired module (and its copies)
_PATH_ATTRIBUTE = '_channels_last_op_repair'
_POLICIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # repaired module (or copy) -> its OpLayoutPolicy
_REPAIRED: weakref.WeakSet = weakref.WeakSet()  # the modules repair_ops put the policy on
_HOOKS: list = []  # the two process-wide module hooks, while any module is repaired
_state = threading.local()  # .stack: per running module call under a repaired one, its policy or None


def _in_graph_capture() -> bool:
    """True while a tracer or compiler records the model: layouts are its business there."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.compiler.is_exporting()


def _stack() -> list:
    if not hasattr(_state, 'stack'):
        _state.stack = []
    return _state.stack


def _switch(leaving: Optional[OpLayoutPolicy], entering: Optional[OpLayoutPolicy]) -> None:
    if leaving is entering:
        return
    if leaving is not None:
        leaving.__exit__(None, None, None)
    if entering is not None:
        entering.__enter__()


def _enter_module(module: nn.Module, args: Any) -> None:
    """Process-wide forward pre-hook: a repaired module's policy in force, suspended in the others."""
    stack = _stack()
    if not stack and _PATH_ATTRIBUTE not in module.__dict__:  # most calls: no policy, none to suspend
        return
    policy = None if _in_graph_capture() else _policy_of(module)  # a compiler reads no value of ours
    previous = stack[-1] if stack else None
    stack.append(policy)
    _switch(previous, policy)


def _leave_module(module: nn.Module, args: Any, output: Any) -> None:
    """Process-wide forward hook (also when forward raised): the policy of the caller back in force."""
    stack = _stack()
    if not stack:
        return
    current = stack.pop()
    _switch(current, stack[-1] if stack else None)


def _policy_of(module: nn.Module) -> Optional[OpLayoutPolicy]:
    placed = module.__dict__.get(_PATH_ATTRIBUTE)
    if placed is None:
        return None
    policy = _POLICIES.get(module)
    if policy is None:  # a copy of a repaired module (deepcopy, an EMA model) gets its own
        policy = _POLICIES[module] = OpLayoutPolicy(*placed)
    return policy


def has_op_repair(module: nn.Module) -> bool:
    """True when :func:`repair_ops` has put the layout policy on ``module`` (or on what it is a copy of)."""
    return _PATH_ATTRIBUTE in module.__dict__


def _install(module: nn.Module, path: str, found: tuple[str, ...]) -> None:
    setattr(module, _PATH_ATTRIBUTE, (path, found))
    _REPAIRED.add(module)
    weakref.finalize(module, _release_hooks)
    if not _HOOKS:
        _HOOKS.append(module_hooks.register_module_forward_pre_hook(_enter_module))
        _HOOKS.append(module_hooks.register_module_forward_hook(_leave_module, always_call=True))


def _uninstall(module: nn.Module) -> None:
    delattr(module, _PATH_ATTRIBUTE)
    _POLICIES.pop(module, None)
    _REPAIRED.discard(module)
    _release_hooks()


def _release_hooks() -> None:
    """The process-wide hooks off once no repaired module is left (taken off, or collected)."""
    if not list(_REPAIRED):
        while _HOOKS:
            _HOOKS.pop().remove()


def remove_op_repairs(model: nn.Module) -> list[str]:
    """Take the layout policy off every module of ``model``; the paths of the modules that had it."""
    removed = [path for path, module in model.named_modules() if has_op_repair(module)]
    for path in removed:
        _uninstall(model.get_submodule(path))
    return removed


def prune_op_repairs(model: nn.Module, report: AuditReport, before: Optional[AuditReport] = None) -> list[str]:
    """Take the policy off the modules of ``model`` where it changed no layout in the step ``report``
    audited (after :func:`repair_ops`). With ``before`` (the audit that placed it) given, also off
    the modules whose own breaks did not become fewer, and off all of them if the model's did not:
    then it only moved breaks around (4D tensors that are not images, such as an attention block's
    batch x heads x tokens x tokens maps). The paths of the modules it was taken off."""
    after_counts = collections.Counter(record.module_path for record in report.breaks)
    before_counts = collections.Counter(record.module_path for record in (before.breaks if before else ()))
    useless = before is not None and len(report.breaks) >= len(before.breaks)
    pruned = []
    for path, module in model.named_modules():
        if not has_op_repair(module):
            continue
        policy = _policy_of(module)
        no_better = before is not None and after_counts[path] >= before_counts[path]
        if useless or no_better or not policy.actions:
            _uninstall(module)
            pruned.append(path)
    return pruned


def repair_ops(model: nn.Module, report: AuditReport) -> list[SwapRecord]:
    """Put the layout policy on every module of ``model`` where ``report`` (an audit of ``model``,
    after its rules were applied) found an op that drops NHWC, the model itself included.

    Breaks outside the model (the loss) and copies back into NHWC (the symptom of an earlier
    break, not a cause) get none.

    Returns:
        One :class:`~channels_last_algo.core.swap.SwapRecord` (kind ``'op_repair'``, reason
        ``'op_layout_policy'``, no replacement: the module keeps its class) per module that got the
        policy, its ``detail`` naming the ops found there.
    """
    held: dict[str, set[str]] = {}
    for record in report.breaks:
        if record.module_path is not None and record.layouts.split('->')[0] in ('NHWC', 'NDHWC'):
            held.setdefault(record.module_path, set()).add(record.op)
    records = []
    for path, ops in held.items():
        module = model.get_submodule(path)
        if not has_op_repair(module):
            _install(module, path, tuple(sorted(ops)))
            detail = 'keeps NHWC through ' + ', '.join(sorted(ops))
            records.append(SwapRecord(path, 'op_repair', OP_REPAIR_RULE, qualified_name(type(module)), detail=detail))
    return records
