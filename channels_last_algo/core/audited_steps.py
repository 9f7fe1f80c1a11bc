"""The audit of a run's first training steps: started and stopped per step, its console block after the last.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())
    >>> model = model.to(memory_format=torch.channels_last)
    >>> steps = AuditedSteps(model, audit_steps=1)
    >>> steps.start_step()
    >>> model(torch.randn(1, 3, 5, 5).to(memory_format=torch.channels_last)).sum().backward()
    >>> step_report, block = steps.end_step()
    >>> step_report.ok, block is not None, steps.block is not None
    (True, True, True)
"""

from __future__ import annotations

from typing import Optional

import torch

from channels_last_algo.core.audit import LayoutAudit
from channels_last_algo.core.audit_report import AuditReport, LayoutBreakError
from channels_last_algo.core.console import ConsoleBlock, audit_block

__all__ = ['AuditedSteps']


class AuditedSteps:
    """:class:`~channels_last_algo.core.audit.LayoutAudit` over the first ``audit_steps`` training steps.

    Args:
        model: the model whose module paths name the records.
        audit_steps: how many training steps to audit.
        strict: :meth:`end_step` raises :class:`LayoutBreakError` at the first step with a break.
    """

    def __init__(self, model: torch.nn.Module, audit_steps: int, strict: bool = False) -> None:
        self.audit_steps = audit_steps
        self.strict = strict
        self._audit = LayoutAudit(model)
        self._first: Optional[AuditReport] = None  # the first audited step's report
        self._last: Optional[AuditReport] = None

    @property
    def active(self) -> bool:
        """True while a step is being audited."""
        return self._audit.active

    @property
    def report(self) -> Optional[AuditReport]:
        """Every audited step so far; None before the first one."""
        return self._audit.report if self._audit.report.steps else None

    @property
    def block(self) -> Optional[ConsoleBlock]:
        """The breaks the last audited step left (and the first step's count where it differs); None
        until every audited step ran."""
        if self._audit.report.steps < self.audit_steps or self._last is None:
            return None
        return self._block()

    def _block(self) -> ConsoleBlock:
        return audit_block(self._last, self._audit.report.steps, self._first)

    def start_step(self) -> None:
        """Audit this step, if audited steps remain (an audit a failed step left running is stopped)."""
        if self._audit.active:
            self._audit.stop()
        if self._audit.report.steps < self.audit_steps:
            self._audit.start()

    def end_step(self) -> tuple[Optional[AuditReport], Optional[ConsoleBlock]]:
        """Stop; this step's report (None when it was not audited), and the block to show now: after
        the last audited step, or at a strict failure (then shown before :meth:`raise_failure`)."""
        if not self._audit.active:
            return None, None
        step_report = self._audit.stop()
        self._first = self._first or step_report
        self._last = step_report
        failed = self.strict and bool(step_report.breaks)
        shown = self._block() if self._audit.report.steps == self.audit_steps or failed else None
        return step_report, shown

    def raise_failure(self, step_report: AuditReport) -> None:
        """In strict mode, :class:`LayoutBreakError` for the step's first break."""
        if self.strict and step_report.breaks:
            raise LayoutBreakError(step_report.breaks[0])

    def close(self) -> None:
        """Stop an audit a failed step left running."""
        if self._audit.active:
            self._audit.stop()
