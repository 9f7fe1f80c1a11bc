"""``ChannelsLastCallback``: channels last in a Lightning ``Trainer``.

It decides *when*: it maps Lightning's hooks onto the calls of a
:class:`~channels_last_algo.core.guard.LayoutGuard`, which does the work. In
Lightning's order inside ``fit`` / ``validate`` / ``test`` / ``predict`` (``Callback.setup`` ->
``LightningModule.setup`` -> ``configure_model`` -> checkpoint restore -> ``strategy.setup``:
precision, device move, DDP wrap, optimizers -> ``on_fit_start``), it acts where the strategy
moves things to the device:

- the model: right after ``strategy.model_to_device()``, which ``strategy.setup`` calls just
  before it wraps the model in DDP. ``Callback.setup`` is too early (it runs before the
  LightningModule's own ``setup`` and ``configure_model``, where layers are often built, and
  before a checkpoint's callback state is restored); ``on_fit_start`` is too late (DDP has built
  its gradient buckets). Strategies that shard instead (FSDP, DeepSpeed, model parallel) keep
  the weights contiguous (:func:`~channels_last_algo.core.weight_layout.weight_layout_for`); one that
  never calls ``model_to_device`` (FSDP) is prepared at the stage's start hook.
- every batch: right after ``strategy.batch_to_device()``, which every loop calls after the
  user's transfer hooks and before any ``*_step``; its return value is the batch. A callback's
  ``on_*_batch_start`` cannot replace the batch, wrapping ``LightningModule.on_after_batch_transfer``
  is bypassed when a ``LightningDataModule`` defines that hook, and a forward pre-hook on the
  LightningModule misses steps that call a submodule directly.

Both are wrapped on the strategy instance from ``setup`` to ``teardown`` (or an exception), by
:func:`~channels_last_algo.integrations.lightning_adapter.follow_strategy`.

Example:
    >>> from channels_last_algo import ChannelsLastCallback
    >>> ChannelsLastCallback(audit_steps=2)
    ChannelsLastCallback(mode='on', audit_steps=2, strict=False)
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional

import torch

from channels_last_algo.integrations import require

require('lightning', 'lightning')

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from channels_last_algo.core.auto_mode import Trial
from channels_last_algo.core.canonical_checkpoints import canonical_state
from channels_last_algo.core.inputs import Inputs
from channels_last_algo.core.late_views import explain_unwatched_view
from channels_last_algo.core.saved_state import leaving_no_trace
from channels_last_algo.core.weight_layout import WeightLayoutPlan, weight_layout_for
from channels_last_algo.integrations.guarded import GuardedIntegration
from channels_last_algo.integrations.lightning_adapter import (
    example_forward,
    first_training_batch,
    follow_strategy,
    replace_on_instance,
)
from channels_last_algo.integrations.lightning_fused_eval import FusedEvalCallback

__all__ = ['ChannelsLastCallback']

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _logging_muted(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` do nothing inside: auto mode's trial steps leave no metrics."""
    undo = [replace_on_instance(pl_module, name, lambda *args, **kwargs: None) for name in ('log', 'log_dict')]
    try:
        yield
    finally:
        for step in undo:
            step()


class _Console:
    """Where the callback shows what the guard has to say: above the progress bar while training
    runs with one (its ``print``), else ``rank_zero_info``; rank 0 only either way."""

    def __init__(self) -> None:
        self.bar: Optional[ProgressBar] = None

    def __call__(self, text: str) -> None:
        if self.bar is not None:
            self.bar.print(text)
        else:
            rank_zero_info(text)


def _weight_layout(trainer: pl.Trainer, pl_module: pl.LightningModule) -> WeightLayoutPlan:
    """What the strategy allows for the weights: contiguous where it shards, else channels last."""
    strategy = trainer.strategy
    sharding = strategy if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)) else None
    tensor_parallel = strategy if isinstance(strategy, ModelParallelStrategy) else None
    model = strategy.model if strategy.model is not None else pl_module  # wrapped, when a strategy wrapped it
    return weight_layout_for(model, fsdp_config=sharding, tp_config=tensor_parallel)


def _training_loss(trainer: pl.Trainer, module: pl.LightningModule, batch: Any) -> torch.Tensor:
    """The loss ``training_step`` returns on ``batch``, in the trainer's precision, ``self.log`` muted."""
    with trainer.precision_plugin.train_step_context(), _logging_muted(module):
        output = module.training_step(batch, 0)
    loss = output.get('loss') if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"ChannelsLastCallback(mode='auto') times training_step, which returned "
            f'{type(output).__name__} on the first batch instead of a loss; return the '
            "loss (or {'loss': ...}), or use mode='on'"
        )
    return loss


def _trial(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Optional[Trial]:
    """Auto mode's trial step: ``training_step`` on the first training batch. None without training
    batches (validate, test, predict) or under manual optimization (``training_step`` steps the
    optimizers itself): nothing is timed and the model stays channels last."""
    if trainer.state.fn != TrainerFn.FITTING:
        log.info('auto layout: no training batches to time in %s; channels last', trainer.state.fn)
        return None
    if not pl_module.automatic_optimization:
        log.warning(
            'auto layout: training_step steps the optimizers itself under manual optimization, so it '
            "cannot be timed without training; channels last (use mode='on' or 'off' to choose)"
        )
        return None
    return Trial(functools.partial(first_training_batch, trainer), functools.partial(_training_loss, trainer))


def _log_hyperparameters(trainer: pl.Trainer, params: dict[str, Any]) -> None:
    for logger in trainer.loggers:
        logger.log_hyperparams(params)


class ChannelsLastCallback(GuardedIntegration, pl.Callback):
    """Train, validate, test and predict in channels-last (NHWC) memory format in a Lightning ``Trainer``.

    Just before the strategy wraps the model (see the module docstring for why there) every 4D
    parameter and buffer is restrided to ``torch.channels_last`` and every 5D one to
    ``torch.channels_last_3d``, in place, so DDP builds NHWC gradient buckets and warns about no
    stride mismatch. Every batch the strategy moves to the device is put in NHWC, without a copy
    when it already is. Under FSDP, DeepSpeed or model parallelism, which need contiguous
    parameters, the weights stay contiguous and only the activations go NHWC.

    Options: the keyword-only ones of :data:`~channels_last_algo.core.options.OPTIONS` (``docs/options.md``).
    Here ``mode='auto'`` times ``training_step`` on the first training batch before DDP wraps the model
    (``self.log`` muted); under manual optimization nothing is timed. ``fuse_eval=True`` runs a
    :class:`~channels_last_algo.integrations.lightning_fused_eval.FusedEvalCallback` with it, given
    ``network`` (the LightningModule attribute holding the network to fuse; by default its one child
    with parameters).

    Checkpoints hold NCHW-contiguous tensors (``on_save_checkpoint``); the optimizer state a
    resumed run loads takes its parameters' layout again at ``on_train_start``.

    What it did goes to Lightning's console (``rank_zero_info``; during training above the progress
    bar, through its ``print``) and the loggers' hyperparameters
    (``channels_last/...``): once the model is converted, a block with the conversion, the
    repaired layers and their rules, kernel safe paths, the weight layout and auto mode's
    decision (:mod:`channels_last_algo.core.console`); in auto mode one line before it times and
    one with the decision after; after the last audited step the breaks left, by module and op.

    Example:
        .. code-block:: python

            import lightning as L
            from channels_last_algo import ChannelsLastCallback

            trainer = L.Trainer(max_epochs=1, callbacks=[ChannelsLastCallback(audit_steps=2)])
            trainer.fit(lightning_module, train_dataloader)
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
        network: Optional[str] = None,
    ) -> None:
        options = dict(mode=mode, audit_steps=audit_steps, strict=strict, repair=repair, inputs=inputs)
        self.take_options(**options, weights=weights, fuse_eval=fuse_eval)
        self._fused_eval = FusedEvalCallback(network=network)  # what fuse_eval runs
        self._console = self.guard.console = _Console()
        self._prepared: Optional[pl.LightningModule] = None  # the module converted, once
        self._undo: list[Callable[[], None]] = []

    @property
    def network(self) -> Optional[str]:
        """With ``fuse_eval``, the LightningModule attribute holding the network to fuse."""
        return self._fused_eval.network

    def _fusing(self) -> Optional[FusedEvalCallback]:
        """The fused-evaluation callback while ``fuse_eval`` is on (and the guard acts)."""
        return self._fused_eval if self.fuse_eval and self.guard.effective_mode != 'off' else None

    # --- checkpoints ---------------------------------------------------------------------------------
    # state_dict holds auto mode's decision. Lightning restores callbacks after setup and configure_model,
    # before strategy.setup: the decision is applied when the strategy moves the model to its device.

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Every 4D/5D tensor of the checkpoint (model, optimizer states, other callbacks' state)
        written NCHW-contiguous (:func:`~channels_last_algo.core.canonical_checkpoints.canonical_state`)."""
        if self.guard.effective_mode != 'off':
            checkpoint.update(canonical_state(dict(checkpoint)))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning restores the optimizer state after strategy.setup, just before this hook.
        self.guard.on_load(pl_module, trainer.optimizers or None)
        if pl_module.automatic_optimization:  # the step ends the batch's own code (not so inside a manual step)
            for optimizer in (o for o in trainer.optimizers if isinstance(o, torch.optim.Optimizer)):
                try:
                    self._undo.append(optimizer.register_step_post_hook(self._optimizer_stepped).remove)
                except AttributeError:  # a wrapper that never ran Optimizer.__init__ (Opacus's DPOptimizer) takes no
                    pass  # hooks: on_train_batch_end ends the batch
        bar = trainer.progress_bar_callback
        self._console.bar = bar if bar is not None and bar.is_enabled else None  # disabled off rank 0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._console.bar = None

    # --- setup and teardown: follow the strategy's moves -----------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.guard.effective_mode == 'off':
            return
        prepare = functools.partial(self._prepare, trainer, pl_module)
        on_batch = functools.partial(self._on_batch, trainer)
        self._undo.append(follow_strategy(trainer.strategy, prepare, on_batch))

    def _on_batch(self, trainer: pl.Trainer, batch: Any) -> Any:
        """The batch to NHWC; its loop named (``trainer.state.stage``, and which fused copy it evaluates, whose
        first batch is watched anew): ``on_*_batch_end`` ends every batch."""
        loop = str(trainer.state.stage)
        return self.guard.on_batch(batch, loop=self._fused_eval.loop_name(loop) if self._fusing() else loop)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore(trainer, pl_module, stage)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.guard.channels_last:
            explain_unwatched_view(exception)
        self._restore(trainer, pl_module, 'exception')  # Lightning skips teardown hooks after an exception

    def _restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Stop an audit and a fused evaluation left running; unwrap the strategy."""
        self.guard.close()
        self._fused_eval.teardown(trainer, pl_module, stage)
        self._console.bar = None
        while self._undo:
            self._undo.pop()()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._prepare(trainer, pl_module)

    # --- conversion and auto mode ------------------------------------------------------------------

    def _prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Convert ``pl_module`` once, as its strategy allows; in auto mode settle the layout."""
        if self.guard.effective_mode == 'off' or self._prepared is pl_module:
            return
        self._prepared = pl_module
        if self._fusing():
            self._fused_eval.network_of(pl_module)  # refused now, not at the first validation after training
        optimizers = trainer.optimizers or None
        self.guard.on_init(pl_module, optimizers, weight_layout=_weight_layout(trainer, pl_module))
        trial = functools.partial(_trial, trainer, pl_module)
        broadcast = functools.partial(trainer.strategy.broadcast, src=0)
        self.guard.auto.settle(pl_module, trial, optimizers, trainer.global_rank, trainer.world_size, broadcast)
        _log_hyperparameters(trainer, self.guard.start_block.hyperparameters)
        self.guard.on_run_start()
        if self.guard.channels_last:
            self._rehearse_example(pl_module)

    def _rehearse_example(self, pl_module: pl.LightningModule) -> None:
        """Lightning runs ``example_input_array`` through the model outside any batch, before training (the model
        summary; ``log_graph``, ``to_onnx`` trace it): that evaluation forward runs here first, once, watched, so
        that a ``.view()`` in it finds its module made channels first. Modes, buffers and random state are kept."""
        modes = {module: module.training for module in pl_module.modules()}
        pl_module.eval()
        try:
            with leaving_no_trace(pl_module):
                if example_forward(pl_module, self.guard.on_batch):
                    self.guard.on_forward_end()  # what the watch found, shown
        except Exception as error:  # a rehearsal: Lightning's own pass runs (and fails, if it must) as it would
            log.debug('channels last: the rehearsal of example_input_array stopped: %s', error)
        finally:
            for module, training in modes.items():
                module.train(training)

    # --- training steps: the audit -------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.guard.on_step_start()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.guard.on_forward_end()  # training_step may call a submodule, not the LightningModule's forward

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics, hyperparameters = self.end_step()
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if hyperparameters:
            _log_hyperparameters(trainer, hyperparameters)

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """The batch's optimizer step is over: what follows (every callback's ``on_train_batch_end``, in any order)
        runs between batches."""
        self.guard.on_batch_end()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.guard.on_batch_end()  # also where no optimizer step ran (gradient accumulation, a step AMP skipped)

    # --- validation, test and prediction (one set of handlers) -------------------------------------

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._prepare(trainer, pl_module)
        if self._fusing():
            self._fused_eval.on_validation_start(trainer, pl_module)

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._fusing():
            self._fused_eval.on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.guard.on_batch_end()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fused_eval.on_validation_end(trainer, pl_module)

    on_test_start = on_predict_start = on_validation_start
    on_test_batch_start = on_predict_batch_start = on_validation_batch_start
    on_test_batch_end = on_predict_batch_end = on_validation_batch_end
    on_test_end = on_predict_end = on_validation_end
