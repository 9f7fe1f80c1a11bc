"""Composer checkpoints of a recipe run: written atomically before evaluation, checked on resume, and
turned back into a model for export.

:class:`RunCheckpoints` replaces the Trainer's own checkpoint saver for ``channels-last train``.
It writes the same Composer checkpoint (``{'state': state.state_dict(), 'rng': ...}``, named
``ep{E}-ba{B}-rank0.pt`` with a ``latest-rank0.pt`` link) through
:meth:`~channels_last_algo.app.runs.folder.RunFolder.write` (temporary file, fsync, rename), at the
end of the batch or epoch the save interval names, *before* that point's evaluation, so an
evaluation that fails (a corrupt ``val/`` image) loses no training. On resume it checks at
``Event.BEFORE_LOAD``, after the algorithms' model surgery, that the checkpoint holds this model.

:func:`model_from_checkpoint` rebuilds a recipe's network (with the layers its algorithms swap
in, as BlurPool's) and loads a checkpoint's weights into it, EMA's by default.

Example (what ``channels-last export --recipe R --checkpoint C OUT`` runs)::

    recipe = load_recipe('recipes/resnet50_imagenet.yaml')
    network = model_from_checkpoint(recipe, 'runs/resnet50_imagenet/latest-rank0.pt')
    export_for_inference(network.eval(), 'resnet50.pt2', torch.randn(2, 3, 224, 224))
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import create_interval_scheduler, dist, reproducibility

from channels_last_algo.app.recipes import models
from channels_last_algo.app.recipes.algorithms import build_algorithms
from channels_last_algo.app.recipes.schema import Recipe
from channels_last_algo.app.runs.checkpoint_files import CHECKPOINT_NAME, RunFolderError, check_readable, read_state
from channels_last_algo.app.runs.folder import RunFolder

__all__ = ['RunCheckpoints', 'check_same_model', 'model_difference', 'model_from_checkpoint']

_SAVE_EVENTS = {Event.BATCH_END, Event.EPOCH_END}  # both come before the evaluation of the same point


def _shape(value: Any) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else f'a {type(value).__name__}'


def model_difference(saved: dict[str, Any], model: torch.nn.Module) -> Optional[str]:
    """The first key or shape in which a checkpoint's model state ``saved`` differs from ``model``'s
    state_dict, in words; None when both have the same keys and shapes."""
    current = model.state_dict()
    difference = next((f'{key!r} is missing from it' for key in current if key not in saved), None)
    difference = difference or next(
        (f'it has {key!r}, which this model lacks' for key in saved if key not in current), None
    )
    return difference or next(
        (
            f'{key!r} is {_shape(saved[key])} there and {list(value.shape)} here'
            for key, value in current.items()
            if _shape(saved[key]) != str(list(value.shape))
        ),
        None,
    )


def check_same_model(path: Union[str, os.PathLike], model: torch.nn.Module, saved: Optional[dict] = None) -> None:
    """RunFolderError naming ``path`` and the first differing key unless the checkpoint's model
    state has ``model``'s keys and shapes. ``saved``: that state, if already read."""
    difference = model_difference(read_state(Path(path))['model'] if saved is None else saved, model)
    if difference:
        raise RunFolderError(
            f'{path} holds another model ({difference})',
            'use the recipe (model, algorithms and --set overrides) that wrote it',
        )


def _holds(path: Path, model: torch.nn.Module) -> bool:
    """Whether the checkpoint at ``path`` is whole and holds ``model`` (its keys and shapes)."""
    try:
        check_readable(path)
        return model_difference(read_state(path)['model'], model) is None
    except RunFolderError:
        return False


class RunCheckpoints(Callback):
    """Atomic Composer checkpoints of one run in its :class:`RunFolder` (see the module docstring).

    Args:
        run: the run's folder, locked by the caller on the writing rank; unlocked at ``post_close``.
        save_interval: a Composer time string (``'1ep'``, ``'100ba'``, ``'0.25dur'``); the end
            of training is always saved.
        keep: how many of the newest checkpoints to keep (-1: all).
        resume_from: the checkpoint the Trainer loads, checked against the model at ``Event.BEFORE_LOAD``.
        write: whether this rank writes (rank 0 does; every rank takes part in gathering the state).
    """

    def __init__(
        self, run: RunFolder, save_interval: str, keep: int = -1, resume_from: Optional[Path] = None, write: bool = True
    ) -> None:
        self.run = run
        self.due = create_interval_scheduler(save_interval, checkpoint_events=False, final_events=_SAVE_EVENTS)
        self.keep = keep
        self.resume_from = resume_from
        self.write = write
        self.saved: list[Path] = []
        self._last_batch: Optional[int] = None

    def before_load(self, state: State, logger: Logger) -> None:
        """RunFolderError naming the checkpoint to resume, what differs and the fix that fits, when it
        holds another model. Event.BEFORE_LOAD comes after the algorithms' surgery at Event.INIT."""
        del logger  # unused
        if self.resume_from is None:
            return
        difference = model_difference(read_state(self.resume_from)['model'], state.model)
        if difference:
            problem = f'{self.resume_from} holds another model than this recipe builds ({difference})'
            raise RunFolderError(problem, self._foreign_fix(state.model))

    def _foreign_fix(self, model: torch.nn.Module) -> str:
        """How to go on when the checkpoint to resume holds another model: from this recipe's own
        newest checkpoint in the folder, in another folder, or over the other run."""
        start = self.resume_from.resolve()  # type: ignore[union-attr]
        others = [c for c in self.run.checkpoints() if c.path.resolve() != start]
        own = next((c for c in reversed(others) if _holds(c.path, model)), None)
        if own is not None:
            later = [
                'it' if c.path.resolve() == start else c.path.name
                for c in self.run.checkpoints()
                if c.batch > own.batch
            ]
            deleting = f' --overwrite (which deletes {", ".join(later)})' if later else ''
            return f"continue from this recipe's own newest checkpoint with --resume {own.path}{deleting}"
        if start.parent == self.run.folder.resolve():
            return (
                f'{self.run.folder} holds the run of another recipe: give this run a new folder '
                '(--set train.save_folder=PATH), or replace that run with --overwrite (without --resume)'
            )
        return (
            'resume it with the recipe (model, algorithms and --set overrides) that wrote it, or resume a '
            'checkpoint of this recipe'
        )

    def batch_end(self, state: State, logger: Logger) -> None:
        self._save_if_due(state, Event.BATCH_END)

    def epoch_end(self, state: State, logger: Logger) -> None:
        self._save_if_due(state, Event.EPOCH_END)

    def _save_if_due(self, state: State, event: Event) -> None:
        batch = int(state.timestamp.batch)
        if self._last_batch != batch and self.due(state, event):
            self._last_batch = batch
            self.save(state)

    def save(self, state: State) -> Optional[Path]:
        """Write ``state`` as a Composer checkpoint now (on the writing rank); its path, or None."""
        checkpoint = {'state': state.state_dict(), 'rng': reproducibility.get_rng_state()}  # every rank gathers
        path = None
        if self.write:
            name = CHECKPOINT_NAME.format(epoch=int(state.timestamp.epoch), batch=int(state.timestamp.batch))
            path = self.run.write(name, lambda file: torch.save(checkpoint, file))
            self.run.keep_newest(self.keep, upto=int(state.timestamp.batch))
            self.saved.append(path)
        dist.barrier()
        return path

    def post_close(self) -> None:
        self.run.unlock()


def _trained_weights(state: dict[str, Any], ema: bool) -> dict[str, torch.Tensor]:
    """The ComposerModel's weights in a checkpoint's ``state``: EMA's averages (when ``ema`` and
    the run used EMA) or the trained ones. EMA keeps whichever is not in the model in its own state."""
    weights = dict(state['model'])
    ema_state = next((s for name, s in state.get('algorithms', []) if name == 'EMA'), None)
    if ema_state is None or ema_state.get('ema_model') is None or ema == bool(ema_state['ema_weights_active']):
        return weights
    stored = ema_state['ema_model']
    return {**weights, **stored['named_parameters_dict'], **stored['named_buffers_dict']}


def model_from_checkpoint(recipe: Recipe, path: Union[str, os.PathLike], ema: bool = True) -> torch.nn.Module:
    """The recipe's network with the weights of the Composer checkpoint at ``path``.

    The network is built as the Trainer builds it: the recipe's model, then the recipe's
    algorithms at ``Event.INIT`` (so BlurPool's renamed layers are there), then the checkpoint's
    weights, EMA's moving averages when the run used EMA and ``ema`` (the weights it evaluated
    with), else the trained ones. Returns the bare network (``ComposerClassifier.module``), on the
    CPU. RunFolderError naming the file when it is truncated or holds another model.
    """
    from composer.devices import DeviceCPU
    from composer.models import ComposerClassifier

    path = Path(path)
    try:
        check_readable(path)
    except RunFolderError as error:  # its fix speaks of --resume: here the file is export's --checkpoint
        raise RunFolderError(error.problem, 'give --checkpoint a checkpoint file its run wrote') from None
    saved = read_state(path)
    classes = recipe.model.num_classes
    model = ComposerClassifier(models.build_model(recipe.model.name, num_classes=classes), num_classes=classes)
    state = State(model=model, rank_zero_seed=recipe.train.seed, run_name=recipe.name, device=DeviceCPU())
    logger = Logger(state)
    for algorithm in build_algorithms(recipe):
        if algorithm.match(Event.INIT, state):
            algorithm.apply(Event.INIT, state, logger)
    weights = _trained_weights(saved, ema)
    check_same_model(path, model, saved=weights)
    model.load_state_dict(weights)
    return model.module
