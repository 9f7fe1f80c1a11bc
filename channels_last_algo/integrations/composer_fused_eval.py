"""``FusedEval``: Composer evaluation and prediction on a fused copy of the network.

At each evaluation or prediction pass's first batch the network the ComposerModel keeps in
``.module`` is swapped for :func:`~channels_last_algo.core.fuse.fuse_for_inference` of its current
weights (EMA's, when swapped in), and put back at the pass's end
(:class:`~channels_last_algo.core.fuse.FusedEvaluation`). ``ChannelsLast(fuse_eval=True)`` runs one.

Example:
    >>> from channels_last_algo import FusedEval
    >>> FusedEval()
    FusedEval()
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from channels_last_algo.integrations import require

require('composer', 'composer')

from composer.core import Algorithm, Event, State
from composer.loggers import Logger

from channels_last_algo.core.fuse import FusedEvaluation
from channels_last_algo.core.fuse.evaluation import parameter_holders

__all__ = ['FusedEval', 'fused_network', 'unwrapped']

_PASS_STARTS = (Event.EVAL_START, Event.PREDICT_START)
_FIRST_BATCHES = (Event.EVAL_BEFORE_FORWARD, Event.PREDICT_BEFORE_FORWARD)
_PASS_ENDS = (Event.EVAL_END, Event.PREDICT_END)
_EVENTS = (Event.INIT, *_PASS_STARTS, *_FIRST_BATCHES, *_PASS_ENDS)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP's wrapper, if there is one."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def fused_network(state: State) -> tuple[torch.nn.Module, str, torch.nn.Module]:
    """The ComposerModel (unwrapped from DDP), the attribute and the network it keeps there: ``.module``
    (ComposerClassifier), else its one child that holds parameters (HuggingFaceModel's ``.model``); a
    ValueError naming the model where there is none."""
    model = unwrapped(state.model)
    if isinstance(getattr(model, 'module', None), torch.nn.Module):
        return model, 'module', model.module
    holders = parameter_holders(model)
    if len(holders) != 1:
        raise ValueError(
            f'fused evaluation (FusedEval, ChannelsLast(fuse_eval=True)) fuses the network a ComposerModel '
            f'keeps in .module (as ComposerClassifier does), or its one child that holds parameters; '
            f'{type(model).__name__} has {len(holders)} such children ({", ".join(holders) or "none"}). Keep the '
            'network in .module, or leave fused evaluation off.'
        )
    return model, holders[0], getattr(model, holders[0])


class FusedEval(Algorithm):
    """Evaluate and predict on a fused copy of the network (BatchNorm folded, activations and
    residual adds fused into the convolutions), built at each pass's first batch.

    The network is the ComposerModel's ``.module``, else its one child that holds parameters
    (``HuggingFaceModel.model``; checked at ``Event.INIT``); a sharded one
    is evaluated unfused, with a warning. Training never sees the copy, and a checkpoint saved
    after a pass holds the training network.

    Example:
        .. code-block:: python

            trainer = Trainer(model=model, eval_dataloader=eval_dataloader, algorithms=[FusedEval()])
    """

    def __init__(self) -> None:
        self._evaluation = FusedEvaluation()

    def __repr__(self) -> str:
        return f'{type(self).__name__}()'

    def loop_name(self, loop: str) -> str:
        """``loop`` named with the pass under way, whose fused copy is new (:meth:`FusedEvaluation.loop_name`)."""
        return self._evaluation.loop_name(loop)

    def match(self, event: Event, state: State) -> bool:
        del state  # unused
        return event in _EVENTS

    def apply(self, event: Event, state: State, logger: Logger) -> Optional[int]:
        del logger  # unused
        if event == Event.INIT:
            fused_network(state)  # refused now, not at the first evaluation after training
        elif event in _PASS_STARTS:
            self._evaluation.begin_pass()
        elif event in _FIRST_BATCHES:
            self._evaluation.first_batch(functools.partial(fused_network, state), state.batch)
        else:
            self._evaluation.end()
        return None
