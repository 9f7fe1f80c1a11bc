"""What every trainer adapter shares of the :class:`~channels_last_algo.core.guard.LayoutGuard` it drives.

Example:
    >>> class Adapter(GuardedIntegration):
    ...     def __init__(self, *, mode='on', audit_steps=0, fuse_eval=False):
    ...         self.take_options(mode=mode, audit_steps=audit_steps, fuse_eval=fuse_eval)
    >>> Adapter(mode='auto', fuse_eval=True)
    Adapter(mode='auto', audit_steps=0, strict=False, fuse_eval=True)
    >>> Adapter(audit_steps=-1)
    Traceback (most recent call last):
    ...
    ValueError: audit_steps must be an int >= 0 (0 turns the audit off), got -1
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from channels_last_algo.core.audit import AuditReport
from channels_last_algo.core.auto_mode import LayoutDecision
from channels_last_algo.core.console import step_metrics
from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.options import INTEGRATION_ONLY, check_options, options_repr

__all__ = ['GuardedIntegration', 'StepLogs']


class StepLogs(NamedTuple):
    """What a trainer logs after a training step: an audited step's metrics
    (:func:`~channels_last_algo.core.console.step_metrics`), and after the last audited step the audit
    block's hyperparameters; empty where there are none."""

    metrics: dict[str, int]
    hyperparameters: dict[str, Any]


class GuardedIntegration:
    """The guard an adapter drives (``self.guard``), its options, the audit report, auto mode's
    decision, the checkpointed state and a ``repr`` that rebuilds the object with the options as asked.

    ``fuse_eval`` (settable between passes) is the integrations' own option: the adapter runs its
    fused-evaluation object beside the guard.
    """

    guard: LayoutGuard
    fuse_eval: bool

    def take_options(self, **options: Any) -> None:
        """Check ``options`` (:data:`~channels_last_algo.core.options.OPTIONS`) and build the guard."""
        check_options(**options)
        self.fuse_eval = options.get('fuse_eval', False)
        self.guard = LayoutGuard(**{name: value for name, value in options.items() if name not in INTEGRATION_ONLY})

    @property
    def report(self) -> Optional[AuditReport]:
        """The layout audit of the audited steps so far (None before any)."""
        return self.guard.report

    @property
    def decision(self) -> Optional[LayoutDecision]:
        """Auto mode's decision, once made (or loaded from a checkpoint and applied)."""
        return self.guard.auto.decision

    def end_step(self) -> StepLogs:
        """The guard's :meth:`~channels_last_algo.core.guard.LayoutGuard.on_step_end`, with what a trainer
        logs of it. A trainer steps the optimizer after the backward: the first step's watch lasts
        until then, over the trainer's hooks between them."""
        step_report = self.guard.on_step_end(until_optimizer_step=True)
        if step_report is None:
            return StepLogs({}, {})
        block = self.guard.audit_block
        return StepLogs(step_metrics(step_report), {} if block is None else block.hyperparameters)

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own state of the object and the guard's (auto mode's decision)."""
        return {**super().state_dict(), **self.guard.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state)

    def __getstate__(self) -> dict[str, Any]:
        """What pickling and ``copy.deepcopy`` keep (Lightning's ``ddp_spawn`` sends the trainer, callbacks and all,
        to each process it starts): the guard as its options, its checkpointed state and its console; what it holds
        of a run under way (its watches, weak tables, the model's hooks) belongs to that process's run."""
        state = dict(self.__dict__)
        guard = state.pop('guard')
        state['guard'] = (dict(guard.options), guard.state_dict(), guard.console)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        options, saved, console = state['guard']
        self.__dict__.update(state, guard=LayoutGuard(**options))
        self.guard.load_state_dict(saved)
        self.guard.console = console

    def __repr__(self) -> str:
        return options_repr(type(self).__name__, {**self.guard.options, 'fuse_eval': self.fuse_eval})
