"""A recipe loaded: read, overridden (``--set``) and checked, every key and every algorithm option.

A recipe is one YAML file (see ``recipes/resnet50_imagenet.yaml``) with the sections of
:class:`~channels_last_algo.app.recipes.schema.Recipe`. ``--set key.path=value`` overrides are
applied first, their values read as YAML (``0.1``, ``true``, ``null``, ``[1, 2]``). Then every
key is checked before anything is built (:mod:`~channels_last_algo.app.recipes.schema`: types,
ranges, time strings, choices, placeholders) and every algorithm option
(:mod:`~channels_last_algo.app.recipes.algorithms`), and the model name is looked up.
Anything off raises :class:`~channels_last_algo.app.recipes.schema.RecipeError` naming the file,
the key path and the fix. ``name: {options}`` or ``name: true`` turns an algorithm on,
``name: false`` (or leaving it out) turns it off. YAML 1.1 reads an unquoted ``mode: on`` as a
bool; the recipe layer reads it back as ``'on'`` / ``'off'``.

Example:
    >>> recipe = load_recipe('recipes/resnet50_imagenet.yaml', ['optimizer.lr=0.1'])
    >>> recipe.optimizer.lr, recipe.algorithms['channels_last']['mode']
    (0.1, 'on')
    >>> load_recipe('recipes/resnet50_imagenet.yaml', ['optimizer.lrr=0.1'])  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ...
    RecipeError: recipes/resnet50_imagenet.yaml: optimizer.lrr: unknown key; did you mean 'lr'?
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

from channels_last_algo.app.recipes.algorithms import check_algorithms
from channels_last_algo.app.recipes.models import model_builder
from channels_last_algo.app.recipes.schema import Recipe, RecipeError, recipe_from_dict
from channels_last_algo.app.recipes.yaml_reader import YamlError, parse_yaml, read_yaml_file

__all__ = ['SMOKE_OVERRIDES', 'load_recipe']

# --smoke: the recipe shrunk to a run of a minute or two on 2 CPU cores, data, evaluation, checkpoints and
# duration together (16-image batches, 4 of them, one evaluation batch and one checkpoint at the end), in its
# own folder so that the real run's is left alone; applied before --set, so the user's overrides win.
SMOKE_OVERRIDES = (
    'train.max_duration=4ba',
    'train.global_batch_size=16',
    'train.eval_batch_size=16',
    'train.eval_subset_num_batches=1',
    'train.eval_interval=1dur',
    'train.save_interval=1dur',
    'train.save_num_checkpoints_to_keep=1',
    'train.save_folder=runs/{name}-smoke',
    'scheduler.t_warmup=1ba',
    'data.synthetic_train_samples=64',
    'data.synthetic_eval_samples=16',
)


def _apply_override(data: dict[str, Any], override: str, error) -> None:
    path, sep, text = override.partition('=')
    named = f'--set {override if len(override) <= 100 else override[:97] + "..."!r}'
    if not sep or not path:
        raise error(f'{named}: expected KEY.PATH=VALUE, e.g. optimizer.lr=0.1')
    try:
        value = parse_yaml(text, 'the value') if text else None
    except YamlError as exc:
        raise error(f'{named}: {exc}') from None
    keys = path.split('.')
    node = data
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None or child is True:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise error(f'{named}: {".".join(keys[: depth + 1])} is {child!r}, not a mapping')
        node = child
    node[keys[-1]] = value


def _check_model(recipe: Recipe, error) -> None:
    try:
        builder = model_builder(recipe.model.name)
    except ValueError as exc:
        raise error(f'model.name: {exc}') from exc
    try:
        inspect.signature(builder).bind_partial(num_classes=recipe.model.num_classes)
    except TypeError:
        raise error(
            f'model.name: {recipe.model.name!r} does not take num_classes, which the recipe builds it with '
            f'(model.num_classes: {recipe.model.num_classes}); give a callable with a num_classes argument'
        ) from None
    except ValueError:  # a builtin or extension callable without a signature: its call will tell
        pass


def load_recipe(path: Union[str, os.PathLike], overrides: Sequence[str] = ()) -> Recipe:
    """Read, override and validate the recipe at ``path``; :class:`RecipeError` if anything is off."""
    path = Path(path)

    def error(message: str) -> RecipeError:
        return RecipeError(f'{path}: {message}')

    if not path.is_file():
        raise RecipeError(f'{path}: no such recipe file' + (' (it is a folder)' if path.is_dir() else ''))
    try:
        data = read_yaml_file(path)
    except YamlError as exc:
        raise RecipeError(str(exc)) from None
    if not isinstance(data, dict):
        raise error(f'expected a mapping of recipe sections at the top, got {type(data).__name__}')
    for override in overrides:
        _apply_override(data, override, error)
    recipe = recipe_from_dict(data, str(path))
    check_algorithms(recipe, error)
    _check_model(recipe, error)
    return recipe
