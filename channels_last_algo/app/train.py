"""``channels-last train``: one recipe run that loses no work, from the pre-flight check to the last checkpoint.

:func:`train_recipe` builds the run (:func:`~channels_last_algo.app.recipes.build_trainer`: the
run folder locked, an earlier run's checkpoints refused unless resumed or overwritten), fits it
and closes it. Checkpoints are written atomically and before evaluation
(:class:`~channels_last_algo.app.checkpoints.RunCheckpoints`), so a run stopped by a corrupt image,
a Ctrl-C or a kill keeps every checkpoint it finished; a corrupt image ends it with
:class:`RunError`, one line naming the file, the recipe key that skips such files, and the
checkpoint to resume from. ``check_data`` decodes every image once before anything else
(:func:`~channels_last_algo.app.datasets.scan_images`). It returns the last checkpoint and the
metrics of the evaluation at the end (:class:`RunResult`).

Example::

    train_recipe(load_recipe('recipes/resnet50_imagenet.yaml'), data_path='/data/imagenet', check_data=True)
    train_recipe(load_recipe('recipes/resnet50_imagenet.yaml'), data_path='/data/imagenet', resume=True)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NamedTuple, Optional, Union

from channels_last_algo.app.datasets import CorruptImageError, scan_images
from channels_last_algo.app.recipes import Recipe, build_datasets, build_trainer

__all__ = ['RunError', 'RunResult', 'check_data_set', 'train_recipe']


class RunError(RuntimeError):
    """A run that cannot start or go on because of its data; the message names the file, the fix
    and what was saved."""


class RunResult(NamedTuple):
    """What a finished run leaves: its last checkpoint (None if it wrote none), when it ended, and the
    metrics of its evaluation at the end (empty when none ran) by name.

    Example:
        >>> print(RunResult(None, 'epoch 1, batch 6', {'eval/MulticlassAccuracy': 0.25}).format_metrics())
          eval/MulticlassAccuracy  0.2500
    """

    checkpoint: Optional[Path]
    end: str
    metrics: dict[str, float]

    def format_metrics(self) -> str:
        """One metric a line, names aligned."""
        width = max((len(name) for name in self.metrics), default=0)
        return '\n'.join(f'  {name:<{width}}  {value:.4f}' for name, value in self.metrics.items())


def _one_line(error: BaseException) -> str:
    """The error's own message, also when a DataLoader worker re-raised it with its traceback."""
    last = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    name = f'{type(error).__module__}.{type(error).__qualname__}: '
    return last[len(name) :] if last.startswith(name) else last


def check_data_set(recipe: Recipe, data_path: Optional[str] = None) -> int:
    """Decode every image of the recipe's train and eval sets once; return how many were checked.

    RunError naming the files that cannot be decoded when ``data.on_corrupt`` is ``raise``; a
    line on stderr naming them when it is ``skip`` (training will skip them)."""
    train, val = build_datasets(recipe, data_path)
    images = sum(len(getattr(split, 'samples', [])) for split in (train, val))
    bad = scan_images(train, recipe.data.workers) + scan_images(val, recipe.data.workers)
    if bad:
        shown = ', '.join(f'{path} ({problem})' for path, problem in bad[:3]) + (' ...' if len(bad) > 3 else '')
        if recipe.data.on_corrupt == 'raise':
            raise RunError(
                f'--check-data: {len(bad)} of {images} images cannot be decoded: {shown}; replace or '
                f'delete them, or set data.on_corrupt: skip in {recipe.source} (--set data.on_corrupt=skip)'
            )
        print(
            f'channels-last train: --check-data: skipping {len(bad)} of {images} images that cannot be decoded '
            f'(data.on_corrupt: skip): {shown}',
            file=sys.stderr,
        )
    return images


def train_recipe(
    recipe: Recipe,
    data_path: Optional[str] = None,
    resume: Union[bool, str, os.PathLike] = False,
    overwrite: bool = False,
    check_data: bool = False,
) -> RunResult:
    """Train ``recipe`` to ``train.max_duration``; return the last checkpoint written and the final metrics.

    ``resume``: True for the newest readable checkpoint in the save folder, a path for that one.
    ``overwrite``: replace an earlier run's checkpoints there instead of refusing the folder.
    ``check_data``: :func:`check_data_set` first.
    """
    from channels_last_algo.app.checkpoints import RunCheckpoints

    if check_data:
        check_data_set(recipe, data_path)
    trainer = build_trainer(recipe, data_path=data_path, resume=resume, overwrite=overwrite)
    checkpoints = next(callback for callback in trainer.state.callbacks if isinstance(callback, RunCheckpoints))

    def saved() -> str:
        if not checkpoints.saved:
            return 'no checkpoint was written by this run'
        return f'the training up to {checkpoints.saved[-1]} is saved: continue with --resume'

    try:
        trainer.fit()
    except CorruptImageError as error:
        raise RunError(f'{_one_line(error)}; {saved()}') from error
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C (Composer turns SIGINT and SIGTERM into SystemExit)
        print(f'channels-last train: stopped; {saved()}', file=sys.stderr)
        raise
    finally:
        trainer.close()
    timestamp = trainer.state.timestamp
    return RunResult(
        checkpoints.saved[-1] if checkpoints.saved else None,
        f'epoch {int(timestamp.epoch)}, batch {int(timestamp.batch)}',
        {f'eval/{name}': float(value) for name, value in trainer.state.eval_metric_values.items()},
    )
