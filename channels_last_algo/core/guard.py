"""The framework-neutral event layer that keeps a training run channels last.

:class:`LayoutGuard` holds the work of each training event, named ``on_<moment>``: convert the
model once (``on_init``), restride a loaded checkpoint's optimizer state (``on_load``), show what
the run starts with (``on_run_start``), put every batch in NHWC (``on_batch``), and audit the first
training steps (``on_step_start``, ``on_step_end``, or the ``step()`` context manager), inside which
a converted model's graphs compile with inductor's layout optimisation where this torch needs it
(:mod:`~channels_last_algo.core.compiled_backward`). Auto mode is its own object (:attr:`LayoutGuard.auto`,
:mod:`~channels_last_algo.core.auto_mode`); the guard asks it which layout. The Composer algorithm and
the Lightning callback map their trainer's events onto these calls; a plain PyTorch loop calls them directly.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    >>> guard = LayoutGuard()
    >>> _ = guard.on_init(model)
    >>> images, labels = guard.on_batch((torch.randn(4, 3, 16, 16), torch.zeros(4)))
    >>> images.is_contiguous(memory_format=torch.channels_last)
    True
    >>> model(images).is_contiguous(memory_format=torch.channels_last)  # the batch's forward
    True
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

from channels_last_algo.core.argument_checks import require_loop, require_module, require_optimizers
from channels_last_algo.core.audit import AuditReport, LayoutBreakError
from channels_last_algo.core.audited_steps import AuditedSteps
from channels_last_algo.core.auto_mode import AutoMode, LossFn
from channels_last_algo.core.compiled_backward import CompiledBackwardLayout
from channels_last_algo.core.console import ConsoleBlock, start_block
from channels_last_algo.core.convert import (
    ConversionSummary,
    Optimizers,
    apply_channels_first,
    apply_channels_last,
    keep_weights_contiguous,
    restride,
)
from channels_last_algo.core.inputs import Inputs, InputSelection
from channels_last_algo.core.late_views import explain_unwatched_view
from channels_last_algo.core.layout import to_channels_first, to_channels_last
from channels_last_algo.core.options import check_options, options_repr
from channels_last_algo.core.repair_check import RefusedRepair, RepairCheck
from channels_last_algo.core.viewed_outputs import ViewedOutputs
from channels_last_algo.core.weight_layout import OptimizerWatch, WeightLayoutPlan, for_training, weight_layout_for

__all__ = ['LayoutGuard']


log = logging.getLogger(__name__)


class LayoutGuard:
    """The events of a channels-last run, usable from any training loop.

    Call :meth:`on_init` once with the model before the optimizer takes state (or pass the optimizers),
    :meth:`on_batch` on every batch before the forward pass, in training, evaluation and prediction alike,
    and wrap each training step's forward, loss and backward in :meth:`step` (or call :meth:`on_step_start`
    / :meth:`on_step_end`); a trainer also calls :meth:`on_batch_end` and, at the end, :meth:`close`.

    Options: the keyword-only ones of :data:`~channels_last_algo.core.options.OPTIONS` but ``fuse_eval`` (options.md).

    What a user should see (:mod:`channels_last_algo.core.console`): :attr:`start_block` (the conversion,
    repairs, weight layout and auto mode's decision), shown once by :meth:`on_run_start` or else at the first
    training step; auto mode's timing line and decision; and after the last audited step the breaks left
    (:attr:`audit_block`). They go to :attr:`console`, a trainer integration's console, or, where it is None
    (a plain loop), to the log at INFO (WARNING for breaks left): one record each.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(288, 2))
        >>> guard = LayoutGuard(audit_steps=1)
        >>> _ = guard.on_init(model)
        >>> with guard.step():
        ...     model(guard.on_batch(torch.randn(2, 3, 8, 8))).sum().backward()
        >>> guard.report.ok, len(guard.report.exits)
        (True, 1)
    """

    def __init__(
        self,
        *,
        mode: str = 'on',
        audit_steps: int = 0,
        strict: bool = False,
        repair: bool = True,
        inputs: Inputs = 'auto',
        weights: str = 'auto',
    ) -> None:
        self.options = dict(mode=mode, audit_steps=audit_steps, strict=strict, repair=repair, inputs=inputs)
        self.options['weights'] = weights
        check_options(**self.options)
        self.inputs = InputSelection(inputs)
        self.auto = AutoMode(mode == 'auto', self._trial_step, self._show, self._weights_viewed)
        self.summary: Optional[ConversionSummary] = None
        self.weight_layout: Optional[WeightLayoutPlan] = None
        self.console: Optional[Callable[[str], None]] = None  # an integration's console; None: the log
        self._conv_channels: set[int] = set()  # in_channels of the model's convolutions
        self._audited: Optional[AuditedSteps] = None
        self._repair_check: Optional[RepairCheck] = None
        self._model_name, self._start_shown = '', False  # the model's class; the start block shown
        self._viewed: Optional[ViewedOutputs] = None  # views NHWC makes fail: watched on the first step
        self._optimizer_watch: Optional[OptimizerWatch] = None  # optimizers made after on_init
        self._compiled_backward = CompiledBackwardLayout()  # inductor's layout choice in training steps

    def __repr__(self) -> str:
        """The options as asked (``mode='auto'`` stays ``'auto'``); defaults after ``strict`` left out."""
        return options_repr(type(self).__name__, self.options)

    @property
    def mode(self) -> str:
        """The mode as asked; :attr:`effective_mode` is the one acted in."""
        return self.options['mode']

    @property
    def audit_steps(self) -> int:
        """How many first training steps are audited."""
        return self.options['audit_steps']

    @property
    def effective_mode(self) -> str:
        """The mode acted in: :attr:`mode`, but ``'auto'`` acts as ``'on'`` once the weights must stay contiguous."""
        return 'auto' if self.auto.enabled else self.mode.replace('auto', 'on')

    @property
    def channels_last(self) -> bool:
        """Whether the model and batches are channels last now (in auto mode: until decided, yes)."""
        asked = self.auto.channels_last if self.auto.enabled else self.mode != 'off'
        return asked and not (self.summary is not None and self.summary.nothing_channels_last)  # else as they come

    @property
    def report(self) -> Optional[AuditReport]:
        """The audit of every audited step so far; None before the first one."""
        return None if self._audited is None else self._audited.report

    @property
    def start_block(self) -> Optional[ConsoleBlock]:
        """What the run starts with, to print: conversion, repairs, safe paths, weight layout, auto mode's decision,
        and the ``channels_last/...`` hyperparameters; None before :meth:`on_init` and in mode ``'off'``."""
        if self.summary is None:
            return None
        return start_block(
            self._model_name,
            self.summary,
            self.weight_layout,
            self.effective_mode,
            self.auto.decision,
            self.audit_steps,
            self._compiled_backward.note if self.channels_last else None,
        )

    @property
    def audit_block(self) -> Optional[ConsoleBlock]:
        """The layout breaks the last audited step left, by module path and op with their bytes (and
        the first step's count where it differs), to print; None until every audited step ran."""
        return None if self._audited is None else self._audited.block

    @property
    def refused_repairs(self) -> list[RefusedRepair]:
        """The swaps the repair check took back, with how the replacement differed from the original."""
        return [] if self._repair_check is None else list(self._repair_check.refused)

    def _show_refused(self) -> None:
        """One warning line per swap the repair check took back, once: a shown one has left the summary."""
        for item in self.refused_repairs:
            if item.record in self.summary.repaired:
                self.summary.repaired.remove(item.record)
                self._show(f'channels last: not repaired: {item}', warn=True)

    def _show(self, text: str, warn: bool = False) -> None:
        if self.console is None:
            return log.log(logging.WARNING if warn else logging.INFO, '%s', text)
        self.console(text)

    # --- the model: built, loaded, starting ----------------------------------------------------------

    def on_init(
        self, model: torch.nn.Module, optimizers: Optimizers = None, weight_layout: Optional[WeightLayoutPlan] = None
    ) -> Optional[ConversionSummary]:
        """Restride the model (and any optimizer state it already has) to channels last; None in mode ``'off'``.

        ``weight_layout`` is what the distributed setting allows (see
        :func:`~channels_last_algo.core.weight_layout.weight_layout_for`; by default it is read from the
        model, which must not be wrapped in DDP yet). Where it asks for contiguous weights (FSDP,
        tensor parallelism) the weights stay contiguous, restrided back if they are not and not
        yet sharded, only the batches go NHWC, and auto mode acts as ``'on'`` (:attr:`effective_mode`).
        """
        require_module(model, 'LayoutGuard.on_init')
        require_optimizers(optimizers, 'LayoutGuard.on_init')
        if self.mode == 'off':
            return None
        plan = weight_layout_for(model) if weight_layout is None else weight_layout
        self.weight_layout = for_training(plan, optimizers, self.options['weights'])
        self._model_name = type(model).__name__
        self._viewed = ViewedOutputs(model, functools.partial(self._weights_viewed, weakref.ref(model)), self.inputs)
        if not self.weight_layout.contiguous and self.options['weights'] == 'auto':
            self._optimizer_watch = OptimizerWatch(
                model, functools.partial(self._weights_contiguous, weakref.ref(model)), self._optimizer_stepped
            )
        if not self.weight_layout.contiguous:
            self.summary = apply_channels_last(model, optimizers=optimizers, repair=self.options['repair'])
            self._repair_check = RepairCheck(model, self.summary.repaired)
            if self.summary.nothing_channels_last:  # nothing to time: the batches go as they come
                self.auto.stand_down()
        else:
            self.summary = self._keep_weights_contiguous(model, optimizers)
        if self.audit_steps:
            self._audited = AuditedSteps(model, self.audit_steps, self.options['strict'])
        if self.inputs.inputs == 'auto':
            convolutions = (torch.nn.modules.conv._ConvNd,)
            self._conv_channels = {m.in_channels for m in model.modules() if isinstance(m, convolutions)}
        return self.summary

    def _weights_viewed(self, model: weakref.ref, why: str) -> bool:
        """Code views a channels-last weight, or writes through a reshape of one, as ``why`` says: contiguous now."""
        if self.options['weights'] != 'auto' or self.weight_layout.contiguous:
            return False
        self._weights_contiguous(model, None, WeightLayoutPlan(True, why))
        return True

    def _weights_contiguous(self, model: weakref.ref, optimizer: Optimizers, plan: WeightLayoutPlan) -> None:
        """An optimizer made after :meth:`on_init`, or code in a step, flattens the weights: contiguous now."""
        self.weight_layout = plan
        self.auto.stand_down(plan.reason)
        if self._optimizer_watch is not None:
            self._optimizer_watch.stop()  # perhaps inside an optimizer's step hooks
        if not plan.sharded and model() is not None:
            apply_channels_first(model(), optimizers=optimizer)
        self._show(f'channels last: {self._model_name}: {plan}', warn=True)

    def _keep_weights_contiguous(self, model: torch.nn.Module, optimizers: Optimizers) -> ConversionSummary:
        """Contiguous weights asked for: restride them back unless sharded; mode ``'on'`` for ``'auto'`` (logged)."""
        refused = "; auto mode would time channels-last weights, which sharding does not allow: mode 'on'"
        log.info('%s: %s%s', self._model_name, self.weight_layout, refused if self.auto.enabled else '')
        self.auto.stand_down()
        return keep_weights_contiguous(model, optimizers, self.weight_layout.sharded)  # the activations still go NHWC

    def _trial_step(self, model: torch.nn.Module, batch: Any, loss_fn: LossFn, channels_last: bool) -> None:
        """One of auto mode's timed steps, its batch in the layout timed; the first finds the batch's images, the ones
        in channels last are watched as training steps are (ViewedOutputs.start_trial)."""
        first, layout = not self.inputs.known(batch), to_channels_last if channels_last else to_channels_first
        if not (self._viewed.start_trial(channels_last) or first):
            return loss_fn(model, self.inputs.convert(batch, layout)).backward()
        try:
            loss = loss_fn(model, self.inputs.put(batch, self._looks_like_an_image, layout))
            self.inputs.finish()
            loss.backward()
        finally:
            self.inputs.finish()
            self._end_watch(training=False)

    def on_load(self, model: torch.nn.Module, optimizers: Optimizers = None) -> None:
        """After a checkpoint was loaded: the model and the optimizer state in the guard's layout again (optimizers'
        and ``assign=True`` loads keep a checkpoint's NCHW tensors); not for contiguous weights, nor in mode 'off'."""
        if self.weight_layout is not None and not self.weight_layout.contiguous:
            restride(model, self.channels_last, optimizers)

    def on_run_start(self) -> None:
        """Show :attr:`start_block` once (on :attr:`console`, else the log); in auto mode once :attr:`auto` settled."""
        block = self.start_block
        if block is not None and not self._start_shown:
            self._start_shown = True
            self._show(str(block))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the guard: auto mode's decision (None before one)."""
        return self.auto.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpointed run's decision, which :meth:`AutoMode.settle` then applies instead of measuring."""
        self.auto.load_state_dict(state)

    # --- batches and steps ---------------------------------------------------------------------------

    def on_batch(self, batch: Any, loop: Optional[str] = None) -> Any:
        """The batch with its image tensors (the ``inputs`` option) in NHWC, no copy when they already are; as
        it is when the guard's layout is NCHW or nothing in the model is channels last. In ``inputs='auto'``
        mode the first batch of a structure goes NHWC by a guess (a channel count some convolution takes) while
        its forward shows which are images (:mod:`channels_last_algo.core.inputs`). ``loop`` (``'validate'``,
        ``'predict'``): :meth:`on_batch_end` follows the batch's own code, which the first batch of each loop
        watches with its forward (``out.view(n, -1)``)."""
        require_loop(loop, 'LayoutGuard.on_batch')
        self.inputs.finish()
        if self._viewed is None or not self._viewed.stepping:  # else a batch begun inside the step (plain loop)
            self._end_watch(training=False)  # a batch with no training step end: an evaluation batch
        if self._repair_check is not None and self.channels_last:
            self._repair_check.start()  # before the model's first call; nothing once every layer is checked
        elif self._repair_check is not None:
            self._repair_check.close()  # auto mode kept NCHW: the swapped layers run as their originals
        if not self.channels_last:
            return batch
        batch = self.inputs.put(batch, self._looks_like_an_image, to_channels_last)
        if self._viewed is not None:  # after the input search: its mode leaves first
            self._viewed.begin(whole_step=False, loop=loop)
        return batch

    def _looks_like_an_image(self, tensor: torch.Tensor) -> bool:
        """The first batch's guess: a tensor whose channel count some convolution takes."""
        return tensor.shape[1] in self._conv_channels

    def on_forward_end(self) -> None:
        """The forward of the batch given to :meth:`on_batch` is over: stop following its tensors (which otherwise
        ends after the first outermost module call that runs a convolution); show what a forward-only watch found."""
        self.inputs.finish()
        if self._viewed is not None and not (self._viewed.watching or self._viewed.stepping):
            self._end_watch(training=False)

    def on_step_start(self) -> None:
        """Show :attr:`start_block` before the first step; audit this step if audited steps remain."""
        self.on_run_start()
        if self.channels_last:
            self._compiled_backward.start()
        if self._viewed is not None and self.channels_last:  # views NHWC makes fail (core/viewed_outputs.py)
            self._viewed.begin(whole_step=True)
        if self._audited is not None and self.channels_last:
            self._audited.start_step()

    def on_step_end(self, until_optimizer_step: bool = False) -> Optional[AuditReport]:
        """Stop auditing; return this step's report, or None when it was not audited. After the last
        audited step (or a strict failure) the breaks left are shown (:attr:`audit_block`).
        ``until_optimizer_step`` (a trainer's step follows): the first step's watch lasts until it ends,
        over code between that reads the gradients (``torch.cat([p.grad.view(-1) ...])``).

        Raises:
            LayoutBreakError: in strict mode, when the step had a layout break.
        """
        self.inputs.finish()
        self._compiled_backward.stop()
        self._show_refused()
        lasting = until_optimizer_step and self._optimizer_watch is not None and not self.weight_layout.contiguous
        self._end_watch(training=True, lasting=lasting)
        if self._repair_check is not None:
            self._repair_check.end_step()
        if self._audited is None:
            return None
        step_report, block = self._audited.end_step()
        if block is not None:
            self._show(str(block), warn=not step_report.ok)
            try:
                self._audited.raise_failure(step_report)
            except LayoutBreakError:
                self._end_watch(training=False)  # no optimizer step follows to end a lasting watch
                raise
        return step_report

    def on_batch_end(self) -> None:
        """A batch and its own code are over: a watch over them ends. From then to the next batch, after a training
        batch (its optimizer step run) until :meth:`close`, or of a loop named to :meth:`on_batch`, a ``.view()`` NHWC
        strides refuse runs as NCHW's (:mod:`~channels_last_algo.core.between_batches`)."""
        self.inputs.finish()
        self._end_watch(training=False)
        if self._viewed is not None and self.channels_last:
            self._viewed.between.batch_end(evaluation_loop=self._viewed.loop is not None)

    def _end_watch(self, training: bool, lasting: bool = False) -> None:
        """What the watch found: one line for each view placed or not (``lasting``: ViewedOutputs.end)."""
        for line in [] if self._viewed is None else self._viewed.end(training, lasting):
            self._show(f'channels last: {line}', warn=True)

    def _optimizer_stepped(self) -> None:
        """After an optimizer step: the first training step's watch, if it lasts, ends."""
        if self._viewed is not None and self._viewed.lasting:
            self._end_watch(training=False)

    def close(self) -> None:
        """End the watch between batches (its hooks on modules outside the model come off), and an audit or image
        search a step that raised left on; safe at any time."""
        self.inputs.finish()
        self._compiled_backward.stop()
        if self._viewed is not None:
            self._viewed.close()
        self._end_watch(training=False)
        for part in (self._optimizer_watch, self._repair_check, self._audited):
            if part is not None:
                part.close()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one training step's forward, loss and backward (not the optimizer step)."""
        self.on_step_start()
        try:
            yield
        except BaseException as error:
            if self.channels_last:
                explain_unwatched_view(error)
            self.close()
            raise
        self.on_step_end()
