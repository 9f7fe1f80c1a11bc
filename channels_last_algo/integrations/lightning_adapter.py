"""Where the Lightning integration reaches past Lightning's hooks: two functions, tested against Lightning.

A callback cannot replace the batch a step gets, and it has no hook between the strategy's
device move and its DDP wrap. :func:`follow_strategy` wraps the two strategy methods every
strategy calls there (``model_to_device``, ``batch_to_device``) on one strategy instance, and
returns what undoes it. Before ``fit``'s loop builds the train dataloaders, only the fit loop's
data source knows them: :func:`first_training_batch` asks it (auto mode's trial step).
:func:`example_forward` runs ``example_input_array`` through the model as Lightning's model summary
does. The integration tests call them on a real ``Trainer`` and fail if Lightning renames what they use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from channels_last_algo.integrations import require

require('lightning', 'lightning')

import lightning.pytorch as pl
from lightning.pytorch.utilities import CombinedLoader

from channels_last_algo.core.saved_state import random_states_kept

__all__ = ['example_forward', 'first_training_batch', 'follow_strategy', 'replace_on_instance']


def replace_on_instance(owner: object, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Set ``owner.<name>`` to ``replacement`` on this instance only; return what undoes it."""
    had_own = name in vars(owner)
    original = getattr(owner, name)
    setattr(owner, name, replacement)

    def undo() -> None:
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)

    return undo


def follow_strategy(
    strategy: pl.strategies.Strategy, model_moved: Callable[[], None], batch_moved: Callable[[Any], Any]
) -> Callable[[], None]:
    """Call ``model_moved()`` right after ``strategy.model_to_device()`` (``strategy.setup`` calls it just
    before the DDP wrap) and pass every batch ``strategy.batch_to_device`` returns (after the user's
    transfer hooks, before any ``*_step``) through ``batch_moved``; return what undoes both."""
    move_model, move_batch = strategy.model_to_device, strategy.batch_to_device

    def model_to_device() -> None:
        move_model()
        model_moved()

    def batch_to_device(*args: Any, **kwargs: Any) -> Any:
        return batch_moved(move_batch(*args, **kwargs))

    undo_model = replace_on_instance(strategy, 'model_to_device', model_to_device)
    undo_batch = replace_on_instance(strategy, 'batch_to_device', batch_to_device)

    def undo() -> None:
        undo_batch()
        undo_model()

    return undo


def first_training_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the train dataloader(s), on the device, as ``training_step`` gets it before the
    guard's ``on_batch`` (each trial step puts it in its own layout).

    The dataloaders are not built before ``fit``'s loop starts, so this asks their source (the
    module, the datamodule, or what was passed to ``fit``) as the loop will. The random state is
    put back, so drawing it does not change the run's data order."""
    loaders = trainer.fit_loop._data_source.dataloader()
    with random_states_kept():
        batch, _, _ = next(iter(CombinedLoader(loaders, 'max_size_cycle')))
    strategy = trainer.strategy
    return type(strategy).batch_to_device(strategy, batch)  # the class's: not follow_strategy's on the instance


def example_forward(module: pl.LightningModule, on_batch: Callable[[Any], Any]) -> bool:
    """Run ``module.example_input_array`` (False where there is none) through ``module`` as the model summary
    does (the batch transfer hooks, then the forward, without gradients), passed through ``on_batch`` first."""
    example = module.example_input_array
    if example is None:
        return False
    example = on_batch(module._apply_batch_transfer_handler(module._on_before_batch_transfer(example)))
    with torch.no_grad():
        if isinstance(example, (list, tuple)):
            module(*example)
        elif isinstance(example, dict):
            module(**example)
        else:
            module(example)
    return True
