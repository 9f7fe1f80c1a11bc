"""``ChannelsLast``: the Composer algorithm, which works among a Trainer's callbacks too.

It decides *when*: it maps Composer's events onto the calls of a
:class:`~channels_last_algo.core.guard.LayoutGuard`, which does the work.

Example:
    >>> from channels_last_algo import ChannelsLast
    >>> ChannelsLast(audit_steps=2)
    ChannelsLast(mode='on', audit_steps=2, strict=False)
    >>> ChannelsLast(fuse_eval=True)
    ChannelsLast(mode='on', audit_steps=0, strict=False, fuse_eval=True)
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

from channels_last_algo.integrations import require

require('composer', 'composer')

from composer.algorithms import ChannelsLast as ComposersChannelsLast
from composer.core import Algorithm, Callback, Event, State
from composer.core.precision import get_precision_context
from composer.loggers import ConsoleLogger, Logger, ProgressBarLogger
from composer.utils import dist

from channels_last_algo.core.auto_mode import Trial
from channels_last_algo.core.batch_tree import Path, leaves, map_leaves
from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.inputs import Inputs
from channels_last_algo.core.saved_state import random_states_kept
from channels_last_algo.core.weight_layout import weight_layout_for
from channels_last_algo.integrations.composer_adapter import save_canonical
from channels_last_algo.integrations.composer_fused_eval import FusedEval, unwrapped
from channels_last_algo.integrations.guarded import GuardedIntegration

__all__ = ['ChannelsLast']

log = logging.getLogger(__name__)

_BATCH_EVENTS = {
    Event.BEFORE_FORWARD: 'fit',
    Event.EVAL_BEFORE_FORWARD: 'eval',
    Event.PREDICT_BEFORE_FORWARD: 'predict',
}
_FORWARD_ENDS = (Event.EVAL_AFTER_FORWARD, Event.PREDICT_AFTER_FORWARD)
_START_EVENTS = (Event.AFTER_LOAD, Event.FIT_START)  # FIT_START also shows the start block
_ALWAYS = (
    Event.INIT,
    *_START_EVENTS,
    *_BATCH_EVENTS,
    *_FORWARD_ENDS,
    Event.AFTER_BACKWARD,
    Event.BATCH_END,
)  # all but off


def _total_loss(loss: Any) -> torch.Tensor:
    """One scalar from what a ComposerModel's ``loss`` returns (a tensor, a sequence, or a dict
    with or without ``'total'``)."""
    if isinstance(loss, dict):
        return loss['total'] if 'total' in loss else sum(loss.values())
    if isinstance(loss, (list, tuple)):
        return sum(loss)
    return loss


def _write_to_console(logger: Logger, text: str) -> None:
    """Write ``text`` on Composer's console stream (stderr by default), rank 0 only: above the
    progress bar while one is shown (``tqdm.write``), else printed; the log at INFO where the
    progress bar and the console logger are both off."""
    if dist.get_global_rank() != 0:
        return
    consoles = [d for d in logger.destinations if isinstance(d, (ProgressBarLogger, ConsoleLogger))]
    if not consoles:
        log.info('%s', text)
        return
    console = min(consoles, key=lambda destination: not isinstance(destination, ProgressBarLogger))
    bar = getattr(console, 'eval_pbar', None) or getattr(console, 'train_pbar', None)
    if bar is not None:
        bar.pbar.write(text, file=console.stream)
    else:
        print(text, file=console.stream, flush=True)


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    shared = [obj]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _float_images(batch: Any) -> Any:
    """Integer 4D/5D tensors (uint8 images waiting for a device-side normalisation) as float32,
    so a trial step can run on a raw batch; timing does not depend on the pixel values."""

    def as_float(path: Path, leaf: Any) -> Any:
        is_integer_image = isinstance(leaf, torch.Tensor) and leaf.dim() in (4, 5) and not leaf.is_floating_point()
        return leaf.float() if is_integer_image else leaf

    return map_leaves(batch, as_float)


def _first_microbatch(batch: Any, size: Any) -> Any:
    """The first ``size`` samples of ``batch`` (every tensor whose first dimension is the images' sliced), where
    Composer splits it into microbatches of ``size`` (``device_train_microbatch_size``): a step of the whole batch
    may not fit in the device's memory. The whole batch where no 4D/5D tensor gives its sample count."""
    counts = [leaf.shape[0] for _, leaf in leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.dim() in (4, 5)]
    if not isinstance(size, int) or not counts or not 0 < size < counts[0]:
        return batch
    return map_leaves(batch, lambda path, leaf: leaf[:size] if _batched(leaf, counts[0]) else leaf)


def _batched(leaf: Any, samples: int) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == samples


class _LastCallback(Callback):
    """The guard's events that follow the other callbacks (added after them at ``Event.INIT``): an evaluation or
    prediction batch ends after their ``*_BATCH_END`` (which the first batch of each loop watches, with
    ``update_metric``), and the guard closes after them at ``FIT_END`` (a callback there may view the weights),
    after ``trainer.eval()`` and ``trainer.predict()``, and when the Trainer closes: an audit (a dispatch mode
    over every op) left running by a step that raised, or the watch between batches, must not outlive the run.
    Composer closes callbacks, not algorithms."""

    def __init__(self, guard: LayoutGuard) -> None:
        self.guard = guard

    def eval_batch_end(self, state: State, logger: Logger) -> None:
        del state, logger  # unused
        self.guard.on_batch_end()

    def fit_end(self, state: State, logger: Logger) -> None:
        del state, logger  # unused
        self.guard.close()

    predict_batch_end = eval_batch_end
    eval_standalone_end = predict_end = close = fit_end


class ChannelsLast(GuardedIntegration, Algorithm, Callback):
    """Train, evaluate and predict in channels-last (NHWC) memory format.

    At ``Event.INIT`` (before DDP/FSDP wrapping and ``torch.compile``) every 4D parameter and
    buffer of the model is restrided to ``torch.channels_last`` and every 5D one to
    ``torch.channels_last_3d``, in place, so Conv3d models work too. Before every forward pass
    (training, evaluation, prediction) the batch's image tensors are put in NHWC, without a
    copy when the data loader already delivers them so. Under FSDP or tensor parallelism
    (Composer's ``parallelism_config``, or a model already sharded), which need contiguous
    parameters, the weights stay contiguous and only the activations go NHWC; the log and the
    ``channels_last/weight_layout`` hyperparameter say which (see :mod:`channels_last_algo.core.weight_layout`).

    What it did goes to Composer's console (the progress bar's stream, rank 0) and its loggers'
    hyperparameters (``channels_last/...``): at ``Event.FIT_START`` a block with the conversion,
    the repaired layers and their rules, kernel safe paths, the weight layout and auto mode's
    decision (:mod:`channels_last_algo.core.console`); in auto mode one line before it times and
    one with the decision after; after the last audited step the breaks left, by module and op.

    With ``audit_steps`` > 0 it watches the forward, loss and backward of the first training
    steps (each microbatch is a step) for ops that drop NHWC, logs
    ``channels_last/layout_breaks``, ``channels_last/break_bytes`` and
    ``channels_last/exit_bytes`` per audited step and the full report at the end, and keeps it
    in :attr:`report`. With ``audit_steps=0`` nothing is installed.

    With ``mode='auto'`` it times a few real forward + backward passes of the first training
    batch in NCHW and in channels last at ``Event.AFTER_LOAD`` (after a checkpoint is loaded,
    before DDP wrapping; at ``FIT_START`` when the train dataloader is given to ``fit``) and
    keeps the faster; the trial steps leave no trace (weights, buffers, optimizer state and RNG
    as before). Under DDP rank 0 decides and broadcasts, so all ranks agree. The decision and
    its timings are logged (``channels_last/auto_*``), kept in :attr:`decision` and saved in
    checkpoints, so a resumed run keeps its layout without measuring again.

    Unlike ``composer.algorithms.ChannelsLast``, which only calls
    ``model.to(memory_format=torch.channels_last)``, this one also handles the inputs, 5D
    weights, and the real channels-last strides of 1x1 and depthwise kernels.

    Options: the keyword-only ones of :data:`~channels_last_algo.core.options.OPTIONS` (``docs/options.md``).

    ``fuse_eval=True`` runs a :class:`~channels_last_algo.integrations.composer_fused_eval.FusedEval`
    with it: evaluation and prediction on a fused copy of the ComposerModel's ``.module``.

    Checkpoints: what Composer saves (``state.state_dict()``, weights-only too) holds NCHW-contiguous
    tensors under the original keys (:mod:`channels_last_algo.core.canonical_checkpoints`); at
    ``Event.AFTER_LOAD`` the loaded optimizer state takes its parameters' layout again.

    Example:
        .. code-block:: python

            from composer import Trainer
            from channels_last_algo import ChannelsLast

            trainer = Trainer(
                model=model,
                train_dataloader=train_dataloader,
                max_duration='1ep',
                algorithms=[ChannelsLast()],  # or callbacks=[ChannelsLast()]
            )
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
        fuse_eval: bool = False,
    ) -> None:
        options = dict(mode=mode, audit_steps=audit_steps, strict=strict, repair=repair, inputs=inputs)
        self.take_options(**options, weights=weights, fuse_eval=fuse_eval)
        self._fused_eval = FusedEval()  # what fuse_eval runs

    def match(self, event: Event, state: State) -> bool:
        if self.guard.mode == 'off':
            return False
        return event in _ALWAYS or (self.fuse_eval and self._fused_eval.match(event, state))

    def apply(self, event: Event, state: State, logger: Logger) -> Optional[int]:
        if event == Event.INIT:
            self._init(state, logger)
        elif event in _START_EVENTS:
            self._start(event, state, logger)
        elif event in _BATCH_EVENTS:
            loop = self._fused_eval.loop_name(_BATCH_EVENTS[event]) if self.fuse_eval else _BATCH_EVENTS[event]
            state.batch = self.guard.on_batch(state.batch, loop=loop)
            if event == Event.BEFORE_FORWARD:
                self.guard.on_step_start()
        elif event in _FORWARD_ENDS:
            self.guard.on_forward_end()
        elif event == Event.AFTER_BACKWARD:
            metrics, hyperparameters = self.end_step()
            if metrics:
                logger.log_metrics(metrics)
            if hyperparameters:
                logger.log_hyperparameters(hyperparameters)
        elif event == Event.BATCH_END:
            self.guard.on_batch_end()
        if self.fuse_eval and self._fused_eval.match(event, state):
            self._fused_eval.apply(event, state, logger)
        return None

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        """As one of the Trainer's ``callbacks``: the same work at the same events (at ``Event.INIT`` before the
        algorithms, as Composer runs callbacks there, at the other events after them)."""
        if self.match(event, state):
            self.apply(event, state, logger)

    def _init(self, state: State, logger: Logger) -> None:
        """Convert the model as its parallel setting allows; checkpoints canonical; the console set."""
        _refuse_a_second(state)
        self.guard.console = functools.partial(_write_to_console, logger)
        state.callbacks.append(_LastCallback(self.guard))
        weight_layout = weight_layout_for(state.model, fsdp_config=state.fsdp_config, tp_config=state.tp_config)
        self.guard.on_init(state.model, state.optimizers, weight_layout=weight_layout)
        logger.log_hyperparameters(self.guard.start_block.hyperparameters)
        save_canonical(state)

    def _start(self, event: Event, state: State, logger: Logger) -> None:
        """After a checkpoint loads, and when fit starts: the loaded optimizer state in the model's
        layout, auto mode's layout settled once (its decision logged), the start block shown."""
        if event == Event.AFTER_LOAD:
            self.guard.on_load(state.model, state.optimizers)
        if self.guard.auto.enabled and self.decision is None and event == Event.FIT_START and dist.get_world_size() > 1:
            log.warning(  # restriding a model DDP wraps would give wrong gradients (core/convert.py)
                'auto layout: the train dataloader came with fit(), after DDP wrapped the model: the run trains '
                "channels last; pass the dataloader to the Trainer's constructor for auto mode to decide"
            )
            self.guard.auto.stand_down()
        if self.guard.auto.enabled and self.decision is None:
            trial = functools.partial(_trial, event, state)
            rank, world_size = dist.get_global_rank(), dist.get_world_size()
            self.guard.auto.settle(unwrapped(state.model), trial, state.optimizers, rank, world_size, _broadcast)
            if self.decision is not None:
                logger.log_hyperparameters(self.guard.start_block.hyperparameters)
        if event == Event.FIT_START:
            self.guard.on_run_start()


def _refuse_a_second(state: State) -> None:
    """A clear error where the Trainer holds more than one channels-last algorithm (this ``ChannelsLast`` or
    Composer's, in ``algorithms``, ``callbacks`` or both): each would restride the model, and Composer's would undo
    the weight layout this one chose (contiguous weights under FSDP, say)."""
    places = [
        f'{where}[{index}]' + ('' if isinstance(candidate, ChannelsLast) else " (Composer's)")
        for where, objects in (('algorithms', state.algorithms), ('callbacks', state.callbacks))
        for index, candidate in enumerate(objects)
        if isinstance(candidate, (ChannelsLast, ComposersChannelsLast))
    ]
    if len(places) > 1:
        raise ValueError(
            f"the Trainer holds ChannelsLast {len(places)} times ({', '.join(places)}): keep one, this project's "
            "(it does what Composer's does and more), in the Trainer's algorithms or its callbacks"
        )


def _trial(event: Event, state: State) -> Optional[Trial]:
    """Auto mode's trial step: the first train batch's first microbatch (integer images as float) and the
    ComposerModel's loss on it; None until the train dataloader is known (it may come with ``fit``)."""
    if state.dataloader is None:
        return None  # the train dataloader comes with fit(): decide at FIT_START
    with random_states_kept():  # a loader's new iterator draws its seeds: the run's data order and draws stay
        batch = _float_images(state.device.batch_to_device(next(iter(state.dataloader))))
    batch = _first_microbatch(batch, state.device_train_microbatch_size)

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        with get_precision_context(state.precision, state.precision_config):
            return _total_loss(model.loss(model(batch), batch))

    return Trial(lambda: batch, loss_fn)
