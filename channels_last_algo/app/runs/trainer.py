"""A Composer ``Trainer`` for a recipe: its model, NHWC loaders, optimizer, schedule, algorithms and atomic
checkpoints in its locked run folder. Before Composer's own output, on standard error, rank 0 says what the run
loads (the training set and the loader workers started), and notes an evaluation or checkpoint interval longer
than the run, which then happens once, at the end.

Example::

    trainer = build_trainer(load_recipe('recipes/resnet50_imagenet.yaml'), data_path='/data/imagenet', resume=True)
    trainer.fit()
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional, Union

from channels_last_algo.app.data.loaders import build_data_spec
from channels_last_algo.app.recipes import models
from channels_last_algo.app.recipes.algorithms import build_algorithms
from channels_last_algo.app.recipes.optimizers import build_optimizer, build_scheduler
from channels_last_algo.app.recipes.placement import (
    device_and_precision,
    loader_workers,
    microbatch_size,
    rank_batch_sizes,
    workers_words,
)
from channels_last_algo.app.recipes.schema import Recipe, RecipeError, check_durations
from channels_last_algo.app.recipes.step_memory import check_step_memory
from channels_last_algo.app.recipes.training_data import build_datasets, training_set_name
from channels_last_algo.app.runs.folder import RunFolder

__all__ = ['build_trainer']


def _error(recipe: Recipe):
    """The :class:`RecipeError` maker for ``recipe``: its message starts with the recipe file."""
    return lambda message: RecipeError(f'{recipe.source}: {message}')


def _data(recipe: Recipe, data_path: Optional[str], writer: bool) -> tuple[Recipe, tuple[Any, Any]]:
    """The recipe as it runs (:func:`check_durations`: intervals longer than the run at its end) and its training
    and evaluation sets; what it loads, and the note on those intervals, on the ``writer`` rank's standard error
    (with Composer's console, before it)."""
    train_data, eval_data = build_datasets(recipe, data_path)
    source = training_set_name(recipe, data_path)
    recipe, note = check_durations(recipe, len(train_data), source, _error(recipe))
    workers = workers_words(recipe.data.workers, loader_workers(recipe))
    if writer:
        print(f'channels-last train: data: {len(train_data):,} training images ({source}); {workers}', file=sys.stderr)
        if note is not None:
            print(f'channels-last train: note: {note}', file=sys.stderr)
    return recipe, (train_data, eval_data)


def _loaders(recipe: Recipe, data: tuple[Any, Any], device: str, batches: tuple[int, int]) -> tuple[Any, Any]:
    """The training DataSpec and the evaluator of the training and evaluation sets ``data``, for the rank's
    ``batches`` (training, evaluation); the evaluator splits its batches into microbatches as training does."""
    from composer.core import Evaluator

    train_batch, eval_batch = batches
    train_data, eval_data = data
    options = dict(workers=loader_workers(recipe), seed=recipe.train.seed)
    try:
        train_loader = build_data_spec(train_data, batch_size=train_batch, train=True, **options)
    except ValueError as exc:  # fewer training images than one batch
        raise RecipeError(f'{recipe.source}: train.global_batch_size: {exc}') from exc
    subset = recipe.train.eval_subset_num_batches
    evaluator = Evaluator(
        label='eval',
        dataloader=build_data_spec(eval_data, batch_size=eval_batch, train=False, **options),
        subset_num_batches=subset,
        device_eval_microbatch_size=microbatch_size(recipe, device, eval_batch),
    )
    return train_loader, evaluator


def _model_and_checkpoints(recipe: Recipe, run: Any, start: Optional[Path], writer: bool) -> tuple[Any, Any]:
    """The seeded ComposerClassifier of the recipe's model, and the callback that writes its checkpoints to ``run``."""
    from composer.models import ComposerClassifier
    from composer.utils import reproducibility

    from channels_last_algo.app.runs.run_checkpoints import RunCheckpoints

    reproducibility.seed_all(recipe.train.seed)
    classes = recipe.model.num_classes
    try:
        network = models.build_model(recipe.model.name, num_classes=classes)
    except Exception as exc:  # the user's callable, or a torchvision builder refusing the class count
        message = (str(exc).strip().splitlines() or [''])[0]
        raise RecipeError(
            f'{recipe.source}: model.name: building {recipe.model.name!r} with num_classes={classes} failed: '
            f'{type(exc).__name__}: {message}'
        ) from exc
    model = ComposerClassifier(network, num_classes=classes)
    train = recipe.train
    checkpoints = RunCheckpoints(
        run, train.save_interval, keep=train.save_num_checkpoints_to_keep, resume_from=start, write=writer
    )
    return model, checkpoints


def _schedule_options(recipe: Recipe, device: str, precision: str, train_batch: int) -> dict[str, Any]:
    """The Trainer's options for duration, evaluation, device, precision, microbatches and seed."""
    return dict(
        max_duration=recipe.train.max_duration,
        eval_interval=recipe.train.eval_interval,
        device=device,
        precision=precision,
        device_train_microbatch_size=microbatch_size(recipe, device, train_batch),
        seed=recipe.train.seed,
        run_name=recipe.name,
    )


def build_trainer(
    recipe: Recipe,
    data_path: Optional[str] = None,
    resume: Union[bool, str, os.PathLike] = False,
    overwrite: bool = False,
    **trainer_options: Any,
):
    """A Composer ``Trainer`` for ``recipe``: the model, NHWC loaders, the optimizer and schedule of
    :mod:`~channels_last_algo.app.recipes.optimizers`, the algorithms, fp32 on CPU and
    ``train.gpu_precision`` on a GPU, microbatches of :func:`microbatch_size`, and atomic
    checkpoints in the recipe's save folder.

    A step that cannot fit the device's memory is refused first, before the folder is touched
    (:func:`~channels_last_algo.app.recipes.step_memory.check_step_memory`). The folder is then locked for
    the run (:class:`~channels_last_algo.app.runs.folder.RunFolder`, on rank 0, released by
    ``trainer.close()`` or when the process ends); an earlier run's checkpoints there are refused
    unless ``resume`` (True: the newest readable one; a path: that one) or ``overwrite``.
    ``trainer_options`` go to the Trainer.
    """
    device, precision = device_and_precision(recipe)
    batches = rank_batch_sizes(recipe)
    check_step_memory(recipe, device, precision, batches)  # a step that cannot fit is refused before the folder
    run = RunFolder(recipe.save_folder())
    writer = int(os.environ.get('RANK', 0)) == 0  # only rank 0 writes checkpoints
    if writer:
        run.lock()
    try:
        max_duration = recipe.train.max_duration
        start = run.prepare(resume, overwrite, max_duration) if writer else run.resume_point(resume, max_duration)
        return _trainer(recipe, data_path, (run, start, writer), (device, precision, batches), trainer_options)
    except BaseException:
        run.unlock()
        raise


def _trainer(
    recipe: Recipe,
    data_path: Optional[str],
    checkpointing: tuple[RunFolder, Optional[Path], bool],
    placement: tuple[str, str, tuple[int, int]],
    trainer_options: dict[str, Any],
) -> Any:
    """The Trainer of :func:`build_trainer`, once its run folder is ready: ``checkpointing`` is the folder, the
    checkpoint to resume and whether this rank writes; ``placement`` the device, precision and rank batches."""
    from composer import Trainer

    device, precision, batches = placement
    recipe, data = _data(recipe, data_path, checkpointing[2])
    train_loader, evaluator = _loaders(recipe, data, device, batches)
    model, checkpoints = _model_and_checkpoints(recipe, *checkpointing)
    return Trainer(
        model=model,
        train_dataloader=train_loader,
        eval_dataloader=evaluator,
        optimizers=build_optimizer(recipe, model.parameters()),
        schedulers=build_scheduler(recipe),
        algorithms=build_algorithms(recipe),
        callbacks=[checkpoints, *trainer_options.pop('callbacks', [])],
        load_path=None if checkpointing[1] is None else str(checkpointing[1]),
        **_schedule_options(recipe, device, precision, batches[0]),
        **trainer_options,
    )
