"""Auto mode: the guard's one question, which layout to train in, asked once per run.

:class:`AutoMode` times the first training batch in both layouts (:meth:`AutoMode.decide`, with
:func:`~channels_last_algo.core.auto.decide_layout`), or takes the decision a resumed run saved.
:meth:`AutoMode.settle` is that sequence as every trainer needs it: the resumed decision, else rank 0
times a :class:`Trial` and every rank takes its layout. The guard reads :attr:`AutoMode.channels_last`.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3))
    >>> def step(model, batch, loss_fn, channels_last):
    ...     memory_format = torch.channels_last if channels_last else torch.contiguous_format
    ...     loss_fn(model, batch.to(memory_format=memory_format)).backward()
    >>> auto = AutoMode(True, step)
    >>> decision = auto.decide(model, torch.randn(2, 3, 8, 8), lambda m, x: m(x).sum(), max_rounds=2, warmup=0)
    >>> auto.channels_last == decision.channels_last, auto.state_dict()['decision'] is not None
    (True, True)
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.nn.parameter import is_lazy

from channels_last_algo.core.auto import LayoutDecision, decide_layout
from channels_last_algo.core.console import timing_line
from channels_last_algo.core.convert import Optimizers, restride
from channels_last_algo.core.layout_switch import LayoutSwitch

__all__ = ['AutoMode', 'LayoutDecision', 'Trial']  # LayoutDecision: what AutoMode.decision holds

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]

log = logging.getLogger(__name__)

# decide_layout's bounds by default, which the timing line names unless decide() is given others.
_DECIDE_DEFAULTS = {
    name: p.default for name, p in inspect.signature(decide_layout).parameters.items() if p.default is not p.empty
}


@dataclasses.dataclass(frozen=True)
class Trial:
    """What auto mode times (:meth:`AutoMode.settle`): ``draw()`` gives the first training batch
    as a step gets it (called on rank 0 only), ``loss_fn(model, batch)`` a training step's loss."""

    draw: Callable[[], Any]
    loss_fn: LossFn


class AutoMode:
    """Which layout a run trains in, when the guard was asked for ``mode='auto'``.

    Args:
        enabled: whether the run asked for auto mode; :meth:`stand_down` turns it off (the
            weights must stay contiguous, so there are no channels-last weights to time).
        step: ``step(model, batch, loss_fn, channels_last)`` runs one trial step (forward, loss,
            backward) with the batch in the layout asked for; the guard's converts the batch.
        show: where the timing line and the decision go (the guard's console).
        weights_viewed: ``weights_viewed(weakref.ref(model), why)`` makes the weights contiguous, as the step
            does that finds them viewed: where a trial step did on rank 0, :meth:`settle` has every rank follow.
    """

    def __init__(
        self,
        enabled: bool,
        step: Callable[[torch.nn.Module, Any, LossFn, bool], None],
        show: Callable[[str], None] = log.info,
        weights_viewed: Callable[[weakref.ref, str], Any] = lambda model, why: None,
    ) -> None:
        self.enabled = enabled
        self.decision: Optional[LayoutDecision] = None
        self.stood_down_because: Optional[str] = None
        self._step = step
        self._show = show
        self._weights_viewed = weights_viewed
        self._resumed: Optional[LayoutDecision] = None  # the decision of the checkpoint a run resumed from

    @property
    def channels_last(self) -> bool:
        """The layout decided; channels last until a decision is made."""
        return self.decision is None or self.decision.channels_last

    def stand_down(self, because: Optional[str] = None) -> None:
        """Auto mode no longer applies: the run acts as ``mode='on'``; ``because`` the weights must stay contiguous."""
        self.enabled = False
        self.stood_down_because = self.stood_down_because or because

    def decide(
        self, model: torch.nn.Module, batch: Any, loss_fn: LossFn, optimizers: Optimizers = None, **options: Any
    ) -> Optional[LayoutDecision]:
        """Time ``loss_fn(model, batch).backward()`` in both layouts; keep channels first only on evidence
        that channels last is slower (docs/auto.md). ``options`` go to
        :func:`~channels_last_algo.core.auto.decide_layout`. The model is left in the chosen layout. None where a
        trial step found the weights viewed: they are contiguous then, and the run acts as ``mode='on'``.
        """
        if not self.enabled:
            raise RuntimeError("decide() is for mode='auto', and this run does not act in auto mode")
        shapeless = _shapeless(model)
        if shapeless is not None:
            raise ValueError(f'auto layout: {shapeless}')
        bounds = {**_DECIDE_DEFAULTS, **options}
        self._show(timing_line(bounds['max_rounds'], bounds['max_seconds']))

        def run_step(channels_last: bool) -> None:
            self._step(model, batch, loss_fn, channels_last)
            if not self.enabled:
                raise _StoodDown

        try:
            self.decision = decide_layout(model, run_step, optimizers=optimizers, **options)
        except _StoodDown:
            self._show(
                f'auto layout: not decided, the weights must stay contiguous ({self.stood_down_because}); '
                "the run acts as mode 'on'"
            )
            return None
        self._show(str(self.decision))
        return self.decision

    def apply(self, model: torch.nn.Module, decision: LayoutDecision, optimizers: Optimizers = None) -> None:
        """Put ``model`` in the layout of a decision made before (on resume, or on rank 0), as the trials do."""
        self.decision = decision
        LayoutSwitch(model, optimizers).put(decision.channels_last)

    def settle(
        self,
        model: torch.nn.Module,
        trial: Callable[[], Optional[Trial]],
        optimizers: Optimizers = None,
        rank: int = 0,
        world_size: int = 1,
        broadcast: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        """The layout, settled alike under every trainer, once: a resumed run's decision
        (:meth:`load_state_dict`) is applied without measuring; else ``trial()`` (called on every rank)
        gives the step to time, or None where there is none (yet); rank 0 times it (:meth:`decide`) and,
        where ``world_size`` > 1, every rank takes the layout ``broadcast(obj)`` sends from rank 0."""
        if not self.enabled or self.decision is not None:
            return
        if self._resumed is not None:
            self.apply(model, self._resumed, optimizers)
            log.info('auto layout: resumed with %s, decided in the checkpointed run', self._resumed.layout)
            return
        shapeless = _shapeless(model)
        if shapeless is not None:  # on every rank alike: the same model
            log.warning('auto layout: %s; the run trains channels last', shapeless)
            self.stand_down()
            return
        timed = trial()
        if timed is None:
            return
        outcome = self._timed_on_rank_0(model, timed, optimizers) if rank == 0 else None
        if world_size <= 1:
            return
        outcome = broadcast(outcome)  # every rank takes rank 0's
        if 'stood_down' in outcome:
            if rank:
                self._weights_viewed(weakref.ref(model), outcome['stood_down'])
        elif 'untimed' in outcome:
            self.stand_down()
        else:
            self.apply(model, LayoutDecision.from_dict(outcome), optimizers)

    def _timed_on_rank_0(self, model: torch.nn.Module, timed: Trial, optimizers: Optimizers) -> dict[str, Any]:
        """Rank 0 decides (the decision's dict), or says why not: ``{'stood_down': why}``, a trial found the
        weights viewed (they are contiguous now); ``{'untimed': why}``, the step raised before training, where
        it may read what only the training loop sets up (``self.optimizers()``): the run acts as ``mode='on'``,
        and the step raises in training if it must."""
        try:
            decision = self.decide(model, timed.draw(), timed.loss_fn, optimizers)
        except Exception as error:
            said = (str(error).splitlines() or [''])[0][:300]
            why = f'the step on the first training batch raised before training ({type(error).__name__}: {said})'
            log.warning("auto layout: not decided, %s; the run acts as mode 'on'", why)
            if self.stood_down_because is not None:
                return {'stood_down': self.stood_down_because}
            restride(model, True, optimizers)  # a channels-first trial may have raised
            self.stand_down()
            return {'untimed': why}
        return {'stood_down': self.stood_down_because} if decision is None else decision.to_dict()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the decision, or the one a resumed run loaded and has yet to apply (None before
        either)."""
        decision = self.decision if self.decision is not None else self._resumed
        return {'decision': None if decision is None else decision.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpointed run's decision, which :meth:`settle` then applies instead of measuring."""
        if state.get('decision') is not None:
            self._resumed = LayoutDecision.from_dict(state['decision'])


class _StoodDown(Exception):
    """A trial step found the weights viewed: auto mode stood down, and the timing ends."""


def _shapeless(model: torch.nn.Module) -> Optional[str]:
    """Why ``model`` cannot be timed yet, naming its first lazy parameter or buffer without a shape; None if none."""
    for kind, named in (('parameter', model.named_parameters()), ('buffer', model.named_buffers())):
        name = next((name for name, tensor in named if is_lazy(tensor)), None)
        if name is not None:
            return (
                f'{type(model).__name__}.{name} is a lazy {kind} without a shape yet, so there is no step to time '
                'in both layouts; run one batch through the model before training (as lazy modules ask) for auto '
                'mode to decide'
            )
    return None
