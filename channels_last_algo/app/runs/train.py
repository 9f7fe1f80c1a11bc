"""``channels-last train``: one recipe run that loses no work, from the pre-flight check to the last checkpoint.

:func:`train_recipe` builds the run (:func:`~channels_last_algo.app.runs.trainer.build_trainer`: the
run folder locked, an earlier run's checkpoints refused unless resumed or overwritten), fits it
and closes it. Checkpoints are written atomically and before evaluation
(:class:`~channels_last_algo.app.runs.run_checkpoints.RunCheckpoints`), so a run stopped by a corrupt image,
a Ctrl-C or a kill keeps every checkpoint it finished; a corrupt image ends it with
:class:`RunError`, one line naming the file, the recipe key that skips such files, and the
checkpoint to resume from. Any other failure while the run is built or trained ends it with
:class:`RunError` too: one line naming the exception, the training time and the place it came
from (:func:`failure_place`), and the newest whole checkpoint, with the full traceback written to
a file of the save folder. Before any work, every refusal of the save folder and of the checkpoint
to resume is made (:meth:`~channels_last_algo.app.runs.folder.RunFolder.check`); then
``check_data`` decodes every image once (:func:`~channels_last_algo.app.data.image_folder.scan_images`).
It returns the last checkpoint and the metrics of the evaluation at the end (:class:`RunResult`).

Example::

    train_recipe(load_recipe('recipes/resnet50_imagenet.yaml'), data_path='/data/imagenet', check_data=True)
    train_recipe(load_recipe('recipes/resnet50_imagenet.yaml'), data_path='/data/imagenet', resume=True)
"""

from __future__ import annotations

import gc
import os
import re
import sys
import sysconfig
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import torch
from torch.utils._pytree import tree_leaves

from channels_last_algo.app.data.image_folder import CorruptImageError, printable, scan_images
from channels_last_algo.app.recipes.placement import loader_workers
from channels_last_algo.app.recipes.schema import Recipe, RecipeError
from channels_last_algo.app.recipes.training_data import build_datasets
from channels_last_algo.app.runs.checkpoint_files import RunFolderError
from channels_last_algo.app.runs.folder import RunFolder
from channels_last_algo.app.runs.trainer import build_trainer

__all__ = ['RunError', 'RunResult', 'check_data_set', 'failure_place', 'train_recipe', 'write_traceback']

# the modules whose frames say where a failure came from, besides the user's own: this package's
# (but this one) and Composer's algorithms and callbacks, wherever they are installed
_PLACES = re.compile(r'^(channels_last_algo|composer\.(algorithms|callbacks))\.')
_LONGEST = 300  # characters of an exception's first line in the one-line message: the file holds the rest
_PASSING_ON = ('__torch_dispatch__', '__torch_function__')
_LIBRARIES = tuple({str(Path(sysconfig.get_path(key)).resolve()) + os.sep for key in ('stdlib', 'purelib', 'platlib')})


class RunError(RuntimeError):
    """A run that cannot start or go on: its data, or a failure while it was built or trained; the
    message names what failed, where, the fix or the traceback file, and what was saved."""


_REPORTED = (RecipeError, RunFolderError, RunError)  # their messages name the file and the fix in one line


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


def _check_every_class_keeps_an_image(dataset: Any, bad: set[str]) -> None:
    """RunError naming a class of the training set none of whose images can be decoded: skipping them all
    would train a classifier that never saw the class."""
    totals: dict[int, int] = {}
    lost: dict[int, int] = {}
    for path, label in getattr(dataset, 'samples', []):
        totals[label] = totals.get(label, 0) + 1
        lost[label] = lost.get(label, 0) + (path in bad)
    empty = [label for label, count in totals.items() if lost[label] == count]
    if empty:
        names = [dataset.classes[label] for label in empty[:3]]
        raise RunError(
            f'--check-data: none of the images of the training class {printable(names[0])} can be decoded'
            + (f' (nor of {len(empty) - 1} more)' if len(empty) > 1 else '')
            + '; data.on_corrupt: skip would train without the class: replace its images or remove its folder'
        )


def check_data_set(recipe: Recipe, data_path: Optional[str] = None) -> int:
    """Decode every image of the recipe's train and eval sets once; return how many were checked.

    RunError naming the files that cannot be decoded when ``data.on_corrupt`` is ``raise``; a
    line on stderr naming them when it is ``skip`` (training will skip them)."""
    train, val = build_datasets(recipe, data_path)
    images = sum(len(getattr(split, 'samples', [])) for split in (train, val))
    bad_train = scan_images(train, loader_workers(recipe))
    bad = bad_train + scan_images(val, loader_workers(recipe))
    if bad and recipe.data.on_corrupt == 'skip':
        _check_every_class_keeps_an_image(train, {path for path, _ in bad_train})
    if bad:
        shown = ', '.join(f'{printable(path)} ({problem})' for path, problem in bad[:3]) + (
            ' ...' if len(bad) > 3 else ''
        )
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


def _telling(frame: Any) -> bool:
    """Whether ``frame`` says where a failure came from: a frame of this package (but this module),
    of a Composer algorithm or callback, or of the user's own code (no installed library's), but
    not a torch mode's, which only passes on the ops that the code around it calls."""
    name = frame.f_globals.get('__name__', '')
    if name == __name__ or frame.f_code.co_name in _PASSING_ON:
        return False
    if _PLACES.match(name):
        return True
    file = frame.f_code.co_filename
    return not file.startswith('<') and not str(Path(file).resolve()).startswith(_LIBRARIES)


def failure_place(error: BaseException) -> str:
    """``module.function`` of the innermost frame of ``error``'s traceback in this package (but
    this module), in a Composer algorithm or callback, or in the user's own code (a model given as
    ``module.path:callable``); else of its innermost frame.

    Example:
        >>> def fail():
        ...     raise ValueError('boom')
        >>> try:
        ...     fail()
        ... except ValueError as error:
        ...     failure_place(error).rsplit('.', 1)[-1]
        'fail'
    """
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    if not frames:
        return 'an unknown place'
    chosen = next((frame for frame in reversed(frames) if _telling(frame)), frames[-1])
    code = chosen.f_code
    return f'{chosen.f_globals.get("__name__", "?")}.{getattr(code, "co_qualname", code.co_name)}'


def write_traceback(error: BaseException, folder: Path) -> str:
    """Write ``error``'s full traceback to ``error-<time>.log`` in ``folder`` (else in the temporary
    folder); the words that say where it is."""
    text = ''.join(traceback.format_exception(error))
    name = time.strftime('error-%Y%m%d-%H%M%S.log')
    for place in (folder, Path(tempfile.gettempdir())):
        try:
            (place / name).write_text(text)
        except OSError:
            continue
        return f'the full traceback is in {place / name}'
    return 'the full traceback could not be written anywhere'


def _failure(error: Exception, when: str, saved: str, folder: Path) -> RunError:
    """The one-line RunError of an unexpected ``error``: what failed, when and where, what is saved,
    and the file that holds its traceback."""
    first = (str(error).strip().splitlines() or [''])[0][:_LONGEST]
    what = f'{type(error).__name__}: {first}' if first else type(error).__name__
    return RunError(f'{when} failed in {failure_place(error)}: {what}; {saved}; {write_traceback(error, folder)}')


def _finite_loss_check(recipe: Recipe) -> Any:
    """A Composer callback that stops the run when a training loss is not finite, before the backward that would
    make every weight NaN (a learning rate too large, bad data): the run would otherwise end with exit 0."""
    from composer import Callback

    class FiniteLoss(Callback):
        def after_loss(self, state: Any, logger: Any) -> None:
            del logger  # unused
            losses = [t for t in tree_leaves(state.loss) if isinstance(t, torch.Tensor)]
            if losses and not all(bool(torch.isfinite(t.detach()).all()) for t in losses):
                raise FloatingPointError(
                    f'the training loss is not finite at batch {int(state.timestamp.batch) + 1}; lower optimizer.lr '
                    f'(it is {recipe.optimizer.lr} at {recipe.optimizer.reference_batch_size} images) or check the '
                    'data and the model'
                )

    return FiniteLoss()


def _build(recipe: Recipe, data_path: Optional[str], resume: Any, overwrite: bool) -> Any:
    """:func:`build_trainer`, with an unexpected failure turned into a :func:`_failure`."""
    try:
        return build_trainer(
            recipe, data_path=data_path, resume=resume, overwrite=overwrite, callbacks=[_finite_loss_check(recipe)]
        )
    except _REPORTED:
        raise
    except Exception as error:
        failure = _failure(error, 'building the run', 'nothing was trained', recipe.save_folder())
        error.__traceback__ = None  # in the file now: the half-built Trainer goes, its progress bars closed first
        gc.collect()
        raise failure from error


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
    ``check_data``: :func:`check_data_set` first. A failure while the run is built or trained
    raises :class:`RunError` (see the module docstring); Ctrl-C and SystemExit are re-raised.
    """
    from composer.utils import dist

    from channels_last_algo.app.runs.run_checkpoints import RunCheckpoints

    if dist.get_global_rank() == 0:  # the rank that locks and writes the folder refuses it before any other work
        RunFolder(recipe.save_folder()).check(resume, overwrite, recipe.train.max_duration)
    if check_data:
        check_data_set(recipe, data_path)
    trainer = _build(recipe, data_path, resume, overwrite)
    checkpoints = next(callback for callback in trainer.state.callbacks if isinstance(callback, RunCheckpoints))
    _fit(trainer, checkpoints, recipe.save_folder())
    timestamp = trainer.state.timestamp
    return RunResult(
        checkpoints.saved[-1] if checkpoints.saved else None,
        f'epoch {int(timestamp.epoch)}, batch {int(timestamp.batch)}',
        {f'eval/{name}': float(value) for name, value in trainer.state.eval_metric_values.items()},
    )


def _saved(checkpoints: Any) -> str:
    """What the run's checkpoints (its :class:`~channels_last_algo.app.runs.run_checkpoints.RunCheckpoints`) keep
    of its training, in the words that end a message."""
    if checkpoints.saved:
        return f'the training up to {checkpoints.saved[-1]} is saved: continue with --resume'
    if checkpoints.resume_from is not None:
        return f'no checkpoint was written by this run; {checkpoints.resume_from}, which it resumed, is whole'
    return 'no checkpoint was written by this run'


def _fit(trainer: Any, checkpoints: Any, folder: Path) -> None:
    """``trainer.fit()``, closed at the end; a failure as a :class:`RunError` that says what is saved (the traceback
    in ``folder``), Ctrl-C and SystemExit with a line on stderr."""
    try:
        trainer.fit()
    except CorruptImageError as error:
        raise RunError(f'{_one_line(error)}; {_saved(checkpoints)}') from error
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C (Composer turns SIGINT and SIGTERM into SystemExit)
        print(f'channels-last train: stopped; {_saved(checkpoints)}', file=sys.stderr)
        raise
    except _REPORTED:
        raise
    except Exception as error:
        timestamp = trainer.state.timestamp
        when = f'training after {int(timestamp.batch)} batches (epoch {int(timestamp.epoch)})'
        raise _failure(error, when, _saved(checkpoints), folder) from error
    finally:
        trainer.close()
