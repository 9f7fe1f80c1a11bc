"""The framework-neutral event layer that keeps a training run channels last.

:class:`LayoutGuard` holds the work of each event: convert the model once (``on_init``), put
every batch in NHWC (``on_batch``), and audit the first training steps (``on_step_start``,
``on_step_end``, or the ``step()`` context manager). The Composer algorithm drives it from
Trainer events; a plain PyTorch loop calls it directly.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    >>> guard = LayoutGuard()
    >>> _ = guard.on_init(model)
    >>> images, labels = guard.on_batch((torch.randn(4, 3, 16, 16), torch.zeros(4)))
    >>> images.is_contiguous(memory_format=torch.channels_last)
    True
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional, Sequence, TypeVar, Union

import torch
from torch.utils._pytree import tree_map_only

from channels_last_algo.audit import AuditReport, LayoutAudit, LayoutBreakError
from channels_last_algo.convert import ConversionSummary, apply_channels_last
from channels_last_algo.layout import to_channels_last

__all__ = ['LayoutGuard', 'batch_to_channels_last']

Batch = TypeVar('Batch')

log = logging.getLogger(__name__)


def batch_to_channels_last(batch: Batch) -> Batch:
    """Every 4D/5D tensor in ``batch`` (a tensor, or tuples, lists, dicts and namedtuples of
    them) restrided to channels last; tensors that already are, and all other values, are
    passed through untouched, without a copy.

    Example:
        >>> x = torch.randn(2, 3, 8, 8)
        >>> out = batch_to_channels_last({'image': x, 'label': torch.tensor([0, 1])})
        >>> out['image'].stride()
        (192, 1, 24, 3)
    """
    return tree_map_only(torch.Tensor, to_channels_last, batch)


class LayoutGuard:
    """The events of a channels-last run, usable from any training loop.

    Call :meth:`on_init` once with the model before the optimizer takes state (or pass the
    optimizers), :meth:`on_batch` on every batch before the forward pass, in training,
    evaluation and prediction alike, and wrap each training step's forward, loss and backward
    in :meth:`step` (or call :meth:`on_step_start` / :meth:`on_step_end`).

    Args:
        audit_steps: audit the layouts of the first ``audit_steps`` training steps (forward,
            loss, backward) with :class:`~channels_last_algo.audit.LayoutAudit`. 0 installs
            nothing: no overhead.
        strict: raise :class:`~channels_last_algo.audit.LayoutBreakError`, naming the first
            break's module path and op, at the end of an audited step that had a break.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(288, 2))
        >>> guard = LayoutGuard(audit_steps=1)
        >>> _ = guard.on_init(model)
        >>> with guard.step():
        ...     model(guard.on_batch(torch.randn(2, 3, 8, 8))).sum().backward()
        >>> guard.report.ok, len(guard.report.exits)
        (True, 1)
    """

    def __init__(self, audit_steps: int = 0, strict: bool = False) -> None:
        if audit_steps < 0:
            raise ValueError(f'audit_steps must be >= 0 (0 turns the audit off), got {audit_steps}')
        self.audit_steps = audit_steps
        self.strict = strict
        self.summary: Optional[ConversionSummary] = None
        self._audit: Optional[LayoutAudit] = None

    @property
    def report(self) -> Optional[AuditReport]:
        """The audit of every audited step so far; None before the first one."""
        if self._audit is None or self._audit.report.steps == 0:
            return None
        return self._audit.report

    @property
    def auditing(self) -> bool:
        """True while a step is being audited."""
        return self._audit is not None and self._audit.active

    def on_init(
        self,
        model: torch.nn.Module,
        optimizers: Optional[Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]] = None,
    ) -> ConversionSummary:
        """Restride the model (and any optimizer state it already has) to channels last."""
        self.summary = apply_channels_last(model, optimizers=optimizers)
        self._audit = LayoutAudit(model) if self.audit_steps else None
        return self.summary

    def on_batch(self, batch: Any) -> Any:
        """The batch with its image tensors in NHWC; no copy when they already are."""
        return batch_to_channels_last(batch)

    def on_step_start(self) -> None:
        """Start auditing this step if audited steps remain; otherwise do nothing."""
        if self._audit is None:
            return
        if self._audit.active:  # the last step ended in an exception before on_step_end
            self._audit.stop()
        if self._audit.report.steps < self.audit_steps:
            self._audit.start()

    def on_step_end(self) -> Optional[AuditReport]:
        """Stop auditing; return this step's report, or None when it was not audited.

        Raises:
            LayoutBreakError: in strict mode, when the step had a layout break.
        """
        if not self.auditing:
            return None
        step_report = self._audit.stop()
        if self._audit.report.steps == self.audit_steps:
            report = self._audit.report
            (log.info if report.ok else log.warning)('%s', report)
        if self.strict and step_report.breaks:
            raise LayoutBreakError(step_report.breaks[0])
        return step_report

    def close(self) -> None:
        """Stop an audit left running by a step that raised; safe to call at any time."""
        if self.auditing:
            self._audit.stop()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one training step's forward, loss and backward (not the optimizer step)."""
        self.on_step_start()
        try:
            yield
        except BaseException:
            self.close()
            raise
        self.on_step_end()
