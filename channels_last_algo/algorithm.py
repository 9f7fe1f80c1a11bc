"""``ChannelsLast``: the Composer algorithm.

It decides *when*; :class:`~channels_last_algo.guard.LayoutGuard` does the work.

Example:
    >>> from channels_last_algo import ChannelsLast
    >>> ChannelsLast()
    ChannelsLast()
"""

from __future__ import annotations

import logging
from typing import Optional

from composer.core import Algorithm, Event, State
from composer.loggers import Logger

from channels_last_algo.guard import LayoutGuard

__all__ = ['ChannelsLast']

log = logging.getLogger(__name__)

_BATCH_EVENTS = (Event.BEFORE_FORWARD, Event.EVAL_BEFORE_FORWARD, Event.PREDICT_BEFORE_FORWARD)


class ChannelsLast(Algorithm):
    """Train, evaluate and predict in channels-last (NHWC) memory format.

    At ``Event.INIT`` (before DDP/FSDP wrapping and ``torch.compile``) every 4D parameter and
    buffer of the model is restrided to ``torch.channels_last`` and every 5D one to
    ``torch.channels_last_3d``, in place, so Conv3d models work too. Before every forward pass
    (training, evaluation, prediction) the batch's image tensors are put in NHWC, without a
    copy when the data loader already delivers them so.

    Unlike ``composer.algorithms.ChannelsLast``, which only calls
    ``model.to(memory_format=torch.channels_last)``, this one also handles the inputs, 5D
    weights, and the real channels-last strides of 1x1 and depthwise kernels.

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

    def __init__(self) -> None:
        self.guard = LayoutGuard()

    def __repr__(self) -> str:
        return f'{type(self).__name__}()'

    def match(self, event: Event, state: State) -> bool:
        del state  # unused
        return event == Event.INIT or event in _BATCH_EVENTS

    def apply(self, event: Event, state: State, logger: Logger) -> Optional[int]:
        if event == Event.INIT:
            summary = self.guard.on_init(state.model, state.optimizers)
            logger.log_hyperparameters({
                'channels_last/restrided_tensors': len(summary.converted),
                'channels_last/channels_last_tensors': summary.channels_last_tensors,
            })
            log.info('%s: %s', type(state.model).__name__, summary)
        else:
            state.batch = self.guard.on_batch(state.batch)
        return None
