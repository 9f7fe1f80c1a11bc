"""Layout audit: find every place where a model's forward or backward pass drops NHWC.

A model converted to channels last only pays off if its activations *and* gradients stay
NHWC. :class:`LayoutAudit` watches every aten op of a forward and backward pass with a
``TorchDispatchMode`` and records two kinds of event:

*Layout breaks* (``report.breaks``):

- a non-view op that takes an unambiguous NHWC (or NDHWC) tensor and returns an unambiguous
  channels-first one (``cat``, ``mul``, ``silu_backward``, a ``clone`` from ``.contiguous()``);
- a copy (``clone``, ``copy_``, ``_to_copy``: what ``.contiguous()`` and ``.to()`` become at
  the dispatcher) from channels-first into channels-last, run by a module of the model (a
  layer that converts back after an earlier break, or a gradient copied into a parameter's
  NHWC layout). The same copy outside the model, such as the NHWC conversion of the input
  batch, is the algorithm at work and is not recorded.

A drop outside the model (an op no module of the model ran, nor the backward of one: the loss's
``log_softmax`` on a segmentation output, say) is no break of the model: it is listed apart
(``report.outside``), does not make ``report.ok`` False, and a strict audit does not raise on it.

Views (slices, permutes, expands) move no bytes and are never breaks; ambiguous tensors
(C == 1, or every spatial size 1) are channels-first and channels-last at once, so they
neither start nor end a break.

*Exit conversions* (``report.exits``): where a tensor leaves the 4D/5D trunk, as in the
``flatten`` before a Linear head. A reshape of an NHWC or ambiguous tensor to a lower rank
that is a view (an N x C x 1 x 1 tensor after global pooling) is free: it is recorded with
0 bytes, so the report still shows where the trunk ends. A reshape that has to copy (the
``clone`` that ``reshape`` runs before ``_unsafe_view`` on an N x C x H x W NHWC tensor) is
recorded with the bytes it copies, as is any copy the backward pass of such a reshape runs;
neither is counted as a break.

Each record (:mod:`channels_last_algo.core.audit_report`) names the aten op, the module path
that was running (in backward: the module whose forward created the autograd node being
executed), the phase, the shape of the tensor that lost its layout, and the bytes the op
wrote. Nothing is installed while no audit is active. One audited pass of a model on an example
input is :func:`~channels_last_algo.core.model_audit.audit_model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils import _python_dispatch
from torch.utils._pytree import tree_flatten

from channels_last_algo.core.audit_report import AuditRecord, AuditReport, LayoutBreakError
from channels_last_algo.core.break_causes import cause_of
from channels_last_algo.core.layout import Layout, layout_of
from channels_last_algo.core.module_calls import (
    compiled_in_place,
    compiled_wrapper,
    in_graph_capture,
    subscribe,
    unsubscribe,
)

__all__ = ['AuditRecord', 'AuditReport', 'LayoutAudit', 'LayoutBreakError', 'exit_copies', 'tensors_in']

FORWARD = 'forward'
BACKWARD = 'backward'

_aten = torch.ops.aten
# What `.contiguous()`, `.clone()`, `.to()` and `copy_` reach the dispatcher as.
_COPY_OPS = frozenset({_aten.clone, _aten._to_copy, _aten.copy_, _aten.copy})
# Reshapes that can take a 4D/5D tensor to a lower rank without copying.
_RESHAPE_OPS = frozenset({_aten.view, _aten._unsafe_view, _aten.squeeze})
# Key under which the audit stores (module path, is_exit) in an autograd node's metadata.
_NODE_KEY = 'channels_last_algo.core.audit'


class _DispatchObserver(_python_dispatch.TorchDispatchMode):
    """Runs every op unchanged and shows it, with its output, to the audit."""

    def __init__(self, audit: LayoutAudit):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.audit._observe(func, args, kwargs, out)
        return out


_exits = {'depth': 0}  # exit_copies() blocks under way


@contextlib.contextmanager
def exit_copies() -> Iterator[None]:
    """The layout changes inside are exits, made on purpose for code that needs channels first
    (:mod:`~channels_last_algo.core.viewed_outputs`), not breaks."""
    _exits['depth'] += 1
    try:
        yield
    finally:
        _exits['depth'] -= 1


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree`` (tuples, lists, dicts, namedtuples: torch's pytrees), in order."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class LayoutAudit:
    """Records the layout breaks and exit conversions of the passes run while it is active.

    Use it as a context manager around the steps to audit, or call :meth:`start` and
    :meth:`stop` from separate places (the start and end of a training step). Each
    ``start``/``stop`` span counts as one step; :attr:`report` holds all of them, and
    :meth:`stop` returns the span it ends.

    Args:
        model: the model whose module paths name the records. Modules are looked up when the
            audit starts, so layers swapped in before that are named correctly.
        strict: raise :class:`LayoutBreakError` at the first break instead of recording on.

    Example:
        >>> model = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        >>> x = torch.randn(1, 3, 8, 8).to(memory_format=torch.channels_last)
        >>> audit = LayoutAudit(model)
        >>> for _ in range(2):
        ...     audit.start()
        ...     model(x).sum().backward()
        ...     step_report = audit.stop()
        >>> audit.report.steps, audit.report.ok
        (2, True)
    """

    def __init__(self, model: torch.nn.Module, strict: bool = False):
        self.model = model
        self.strict = strict
        self._breaks: list[AuditRecord] = []
        self._exits: list[AuditRecord] = []
        self._outside: list[AuditRecord] = []
        self._steps = 0
        self._mode: Optional[_DispatchObserver] = None
        self._modules: dict[str, torch.nn.Module] = {}  # by path (a TorchScript module has no get_submodule)
        self._module_paths: dict[int, str] = {}
        self._param_paths: dict[int, str] = {}
        self._stack: list[str] = []
        self._pending: list[tuple[list[torch.Tensor], Optional[str], bool]] = []
        self._held_clone: Optional[tuple[AuditRecord, torch.Tensor]] = None
        self._failure: Optional[LayoutBreakError] = None
        self._span = (0, 0, 0)  # where the current span's breaks, exits and outside records begin
        self._paused_for: Optional[torch.nn.Module] = None  # the compiled wrapper running without the mode

    @property
    def active(self) -> bool:
        return self._mode is not None

    @property
    def report(self) -> AuditReport:
        """Everything recorded since this audit was created, over every span."""
        return AuditReport(
            breaks=list(self._breaks),
            exits=list(self._exits),
            steps=self._steps,
            outside=list(self._outside),
        )

    def start(self) -> None:
        """Begin recording: install the dispatch mode and follow module calls."""
        if self.active:
            raise RuntimeError('this LayoutAudit is already active; call stop() before start()')
        self._modules = dict(self.model.named_modules())
        self._module_paths = {id(m): name for name, m in self._modules.items()}
        self._param_paths = {id(p): name.rpartition('.')[0] for name, p in self.model.named_parameters()}
        self._stack.clear()
        self._failure = None
        self._span = (len(self._breaks), len(self._exits), len(self._outside))
        self._steps += 1
        subscribe(self)
        self._mode = _DispatchObserver(self)
        # model.compile() runs the forward as a graph from the module's own call, before any hook of ours
        self._paused_for = next((m for m in self.model.modules() if compiled_in_place(m)), None)
        if self._paused_for is None:
            self._mode.__enter__()

    def stop(self) -> AuditReport:
        """End recording, remove everything :meth:`start` installed, and return this span.

        In strict mode, raises :class:`LayoutBreakError` if the span's last op was a break
        that could only be classified once the audit ended.
        """
        failure = self._stop()
        if failure is not None:
            raise failure
        return self._span_report()

    def __enter__(self) -> LayoutAudit:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        failure = self._stop()
        if failure is not None and exc_type is None:
            raise failure

    def _stop(self) -> Optional[LayoutBreakError]:
        if not self.active:
            raise RuntimeError('this LayoutAudit is not active; call start() first')
        paused, self._paused_for = self._paused_for is not None, None  # a compiled call that raised
        if not paused and _python_dispatch._get_current_dispatch_mode() is not self._mode:
            raise RuntimeError(
                'another TorchDispatchMode was entered after the layout audit '
                'started and is still active; exit it before stopping the audit'
            )
        try:
            self._flush_held_clone()
            self._label_pending_nodes()
        except LayoutBreakError as error:
            self._failure = error
        finally:
            if not paused:
                self._mode.__exit__(None, None, None)
            self._mode = None
            unsubscribe(self)
            self._stack.clear()
        return self._failure

    def _span_report(self) -> AuditReport:
        first_break, first_exit, first_outside = self._span
        return AuditReport(
            breaks=self._breaks[first_break:],
            exits=self._exits[first_exit:],
            steps=1,
            outside=self._outside[first_outside:],
        )

    # module stack (forward attribution), as a listener of channels_last_algo.core.module_calls

    def entered(self, module: torch.nn.Module, args: tuple) -> None:
        if (compiled_wrapper(module) or in_graph_capture()) and self._paused_for is None:
            self._paused_for = module  # a tracer or dynamo records this call: no dispatch mode under it
            self._mode.__exit__(None, None, None)
        path = self._module_paths.get(id(module))
        if path is not None:
            self._stack.append(path)

    def left(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any, failed: bool) -> None:
        if module is self._paused_for:
            self._paused_for = None
            self._mode.__enter__()
        path = self._module_paths.get(id(module))
        if path is not None and path in self._stack:
            while self._stack.pop() != path:
                pass

    # autograd node labels (backward attribution)

    def _label_pending_nodes(self) -> None:
        """Tag the autograd nodes of the last op's outputs with the module path that ran it.

        The dispatch mode sees an op before autograd attaches its node, so outputs wait here
        until the next op (or the end of the audit) and are labelled then.
        """
        for tensors, path, is_exit in self._pending:
            for tensor in tensors:
                try:
                    node = tensor.grad_fn
                except RuntimeError:  # a view made under no_grad whose base was written since: no node
                    continue
                if node is not None:
                    node.metadata[_NODE_KEY] = (path, is_exit)
        self._pending.clear()

    def _backward_owner(self, node: Any) -> tuple[Optional[str], bool]:
        label = node.metadata.get(_NODE_KEY)
        if label is not None:
            return label
        variable = getattr(node, 'variable', None)  # AccumulateGrad: the parameter's module
        if isinstance(variable, torch.Tensor):
            return self._param_paths.get(id(variable)), False
        return None, False

    # classification

    def _observe(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        self._label_pending_nodes()
        node = torch._C._current_autograd_node()
        phase = FORWARD if node is None else BACKWARD
        if phase == FORWARD:
            path, in_exit = (self._stack[-1] if self._stack else None), _exits['depth'] > 0
        else:
            path, in_exit = self._backward_owner(node)
        outputs = tensors_in(out)
        is_exit = self._settle_held_clone(func, args, outputs) or in_exit
        if phase == FORWARD and (path is not None or is_exit):
            self._pending.append((outputs, path, is_exit))
        if func.is_view or func.overloadpacket is _aten._unsafe_view:
            if phase == FORWARD and func.overloadpacket in _RESHAPE_OPS:
                self._check_free_exit(func, args, outputs, path)
            return
        record = self._layout_change(func, args, kwargs, outputs, path, phase)
        if record is None:
            return
        if is_exit:
            self._exits.append(record)
        elif func.overloadpacket is _aten.clone and phase == FORWARD and layout_of(outputs[0]).is_channels_first:
            self._held_clone = (record, outputs[0])  # an exit if a lower-rank reshape follows
        else:
            self._add_break(record)

    def _layout_change(
        self, func: Any, args: tuple, kwargs: dict, outputs: list[torch.Tensor], path: Optional[str], phase: str
    ) -> Optional[AuditRecord]:
        inputs = tensors_in((args, kwargs))
        out_layouts = [layout_of(t) for t in outputs]
        dropped = [t for t, layout in zip(outputs, out_layouts) if layout.is_channels_first]
        if dropped:
            for tensor in inputs:
                layout = layout_of(tensor)
                if layout.is_channels_last:
                    return AuditRecord(
                        str(func),
                        path,
                        phase,
                        tuple(tensor.shape),
                        sum(t.nbytes for t in dropped),
                        f'{layout.value}->{layout_of(dropped[0]).value}',
                        self._cause(func, dropped[0], path, phase),
                    )
        converted = [t for t, layout in zip(outputs, out_layouts) if layout.is_channels_last]
        if converted and path is not None and func.overloadpacket in _COPY_OPS:
            source = args[1] if func.overloadpacket in (_aten.copy_, _aten.copy) else args[0]
            layout = layout_of(source)
            if layout.is_channels_first:
                return AuditRecord(
                    str(func),
                    path,
                    phase,
                    tuple(source.shape),
                    sum(t.nbytes for t in converted),
                    f'{layout.value}->{layout_of(converted[0]).value}',
                    self._cause(func, source, path, phase),
                )
        return None

    def _cause(self, func: Any, tensor: torch.Tensor, path: Optional[str], phase: str) -> str:
        module = self._modules.get(path) if path is not None else None
        return cause_of(str(func), tensor.dtype, tensor.device.type, module, phase)

    def _check_free_exit(self, func: Any, args: tuple, outputs: list[torch.Tensor], path: Optional[str]) -> None:
        source = args[0]
        if source.dim() not in (4, 5) or not outputs or outputs[0].dim() >= source.dim():
            return
        layout = layout_of(source)
        if layout.is_channels_last or layout is Layout.AMBIGUOUS:
            self._exits.append(
                AuditRecord(str(func), path, FORWARD, tuple(source.shape), 0, f'{layout.value}->{outputs[0].dim()}D')
            )

    def _settle_held_clone(self, func: Any, args: tuple, outputs: list[torch.Tensor]) -> bool:
        """Decide a held NHWC->NCHW clone: True (an exit) when this op flattens its output."""
        if self._held_clone is None:
            return False
        record, copied = self._held_clone
        if (
            func.overloadpacket in _RESHAPE_OPS
            and args
            and args[0] is copied
            and outputs
            and outputs[0].dim() < copied.dim()
        ):
            self._held_clone = None
            exit_record = dataclasses.replace(record, layouts=f'{record.layouts}->{outputs[0].dim()}D')
            self._exits.append(exit_record)
            if copied.grad_fn is not None:
                copied.grad_fn.metadata[_NODE_KEY] = (record.module_path, True)
            return True
        self._flush_held_clone()
        return False

    def _flush_held_clone(self) -> None:
        if self._held_clone is not None:
            record, _ = self._held_clone
            self._held_clone = None
            self._add_break(record)

    def _add_break(self, record: AuditRecord) -> None:
        """A break of the model (strict: raise); a drop outside the model is only listed apart."""
        if record.module_path is None:
            self._outside.append(record)
            return
        self._breaks.append(record)
        if self.strict:
            raise LayoutBreakError(record, type(self.model.get_submodule(record.module_path)).__name__)
