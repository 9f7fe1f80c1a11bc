"""``ChannelsLast``: the Composer algorithm.

It decides *when*; :class:`~channels_last_algo.guard.LayoutGuard` does the work.

Example:
    >>> from channels_last_algo import ChannelsLast
    >>> ChannelsLast(audit_steps=2)
    ChannelsLast(audit_steps=2, strict=False)
"""

from __future__ import annotations

import logging
from typing import Optional

from composer.core import Algorithm, Event, State
from composer.loggers import Logger

from channels_last_algo.audit import AuditReport
from channels_last_algo.guard import LayoutGuard

__all__ = ['ChannelsLast']

log = logging.getLogger(__name__)

_BATCH_EVENTS = (Event.BEFORE_FORWARD, Event.EVAL_BEFORE_FORWARD, Event.PREDICT_BEFORE_FORWARD)
_AUDIT_EVENTS = (Event.AFTER_BACKWARD, Event.FIT_END)


class ChannelsLast(Algorithm):
    """Train, evaluate and predict in channels-last (NHWC) memory format.

    At ``Event.INIT`` (before DDP/FSDP wrapping and ``torch.compile``) every 4D parameter and
    buffer of the model is restrided to ``torch.channels_last`` and every 5D one to
    ``torch.channels_last_3d``, in place, so Conv3d models work too. Before every forward pass
    (training, evaluation, prediction) the batch's image tensors are put in NHWC, without a
    copy when the data loader already delivers them so.

    With ``audit_steps`` > 0 it watches the forward, loss and backward of the first training
    steps (each microbatch is a step) for ops that drop NHWC, logs
    ``channels_last/layout_breaks``, ``channels_last/break_bytes`` and
    ``channels_last/exit_bytes`` per audited step and the full report at the end, and keeps it
    in :attr:`report`. With ``audit_steps=0`` nothing is installed.

    Unlike ``composer.algorithms.ChannelsLast``, which only calls
    ``model.to(memory_format=torch.channels_last)``, this one also handles the inputs, 5D
    weights, and the real channels-last strides of 1x1 and depthwise kernels.

    Args:
        audit_steps: how many training steps to audit from the start (default 0: none).
        strict: raise :class:`~channels_last_algo.audit.LayoutBreakError` at the end of the
            first audited step with a layout break, naming its module path and op.

    Example:
        .. code-block:: python

            from composer import Trainer
            from channels_last_algo import ChannelsLast

            trainer = Trainer(
                model=model,
                train_dataloader=train_dataloader,
                max_duration='1ep',
                algorithms=[ChannelsLast()],
            )
    """

    def __init__(self, audit_steps: int = 0, strict: bool = False) -> None:
        self.guard = LayoutGuard(audit_steps=audit_steps, strict=strict)

    @property
    def report(self) -> Optional[AuditReport]:
        """The layout audit of the audited steps so far (None before any)."""
        return self.guard.report

    def __repr__(self) -> str:
        return f'{type(self).__name__}(audit_steps={self.guard.audit_steps}, strict={self.guard.strict})'

    def match(self, event: Event, state: State) -> bool:
        del state  # unused
        return event == Event.INIT or event in _BATCH_EVENTS or (self.guard.audit_steps > 0 and event in _AUDIT_EVENTS)

    def apply(self, event: Event, state: State, logger: Logger) -> Optional[int]:
        if event == Event.INIT:
            summary = self.guard.on_init(state.model, state.optimizers)
            logger.log_hyperparameters({
                'channels_last/restrided_tensors': len(summary.converted),
                'channels_last/channels_last_tensors': summary.tensors,
            })
            log.info('%s: %s', type(state.model).__name__, summary)
        elif event in _BATCH_EVENTS:
            state.batch = self.guard.on_batch(state.batch)
            if event == Event.BEFORE_FORWARD:
                self.guard.on_step_start()
        elif event == Event.AFTER_BACKWARD:
            step_report = self.guard.on_step_end()
            if step_report is not None:
                logger.log_metrics({
                    'channels_last/layout_breaks': len(step_report.breaks),
                    'channels_last/break_bytes': step_report.break_bytes,
                    'channels_last/exit_bytes': step_report.exit_bytes,
                })
        else:  # FIT_END
            self.guard.close()
        return None
