"""The recipe schema: typed sections, the rule each key must satisfy, and Composer time strings.

Every key of a recipe is declared once here, with its type and a *rule* (a range, a set of
choices, a time string's units, a format string's placeholders). :func:`recipe_from_dict`
checks a parsed YAML mapping against the schema before anything is built and raises
:class:`RecipeError` with the key path and what would be valid. Nothing here needs Composer or
torch: time strings such as ``'36ep'`` are parsed by :func:`parse_time`.

Example:
    >>> recipe = recipe_from_dict({'name': 'r', 'train': {'max_duration': '2ep'}}, 'r.yaml')
    >>> recipe.train.max_duration, recipe.save_folder().as_posix()
    ('2ep', 'runs/r')
    >>> recipe_from_dict({'name': 'r', 'optimizer': {'lr': -1}}, 'r.yaml')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    channels_last_algo.app.recipe_schema.RecipeError: r.yaml: optimizer.lr: -1.0 is out of range; expected a ... > 0
    >>> parse_time('36ep'), parse_time('0.5dur')
    ((36, 'ep'), (0.5, 'dur'))
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import string
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

__all__ = [
    'DataConfig',
    'ModelConfig',
    'OptimizerConfig',
    'Recipe',
    'RecipeError',
    'SchedulerConfig',
    'TrainConfig',
    'parse_time',
    'recipe_from_dict',
]

Rule = Callable[[Any], Optional[str]]  # the problem with a value ('... expected ...'), or None when it is valid

_TIME = re.compile(r'^([0-9]*\.?[0-9]+(?:e[0-9]+)?)(ep|ba|sp|tok|dur|iter)$')
TIME_UNITS = {'ep': 'epochs', 'ba': 'batches', 'sp': 'samples', 'dur': 'a fraction of the whole run'}


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file, the key path and the fix."""


def parse_time(text: str) -> tuple[Union[int, float], str]:
    """A Composer time string as ``(value, unit)``: ``'36ep'`` -> ``(36, 'ep')``; integer values
    for every unit but ``dur``. ValueError for anything Composer's ``Time.from_timestring`` would refuse."""
    match = _TIME.match(text.strip().lower()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f'{text!r} is not a time string')
    value, unit = float(match.group(1)), match.group(2)
    if unit == 'dur':
        return value, unit
    if value != int(value):
        raise ValueError(f'{text!r} needs a whole number of {unit}')
    return int(value), unit


# --- rules -----------------------------------------------------------------------------------------


def _between(low: float, high: float = math.inf, *, open_low: bool = False, open_high: bool = False) -> Rule:
    """A finite number in a range (``open_*``: the bound itself excluded)."""
    above = f'> {low:g}' if open_low else f'>= {low:g}'
    below = '' if high == math.inf else (f' and < {high:g}' if open_high else f' and <= {high:g}')

    def rule(value: float) -> Optional[str]:
        inside = (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
        if math.isfinite(value) and inside:
            return None
        kind = 'a finite number' if isinstance(value, float) else 'an integer'
        return f'{value!r} is out of range; expected {kind} {above}{below}'

    return rule


def _choices(*options: str) -> Rule:
    return lambda value: None if value in options else f'{value!r} is not one of {", ".join(options)}'


def _time(units: str, allow_zero: bool = False) -> Rule:
    """A time string in one of ``units`` (e.g. ``'ep ba'``), positive (or zero if allowed); a
    ``dur`` fraction is at most 1."""
    allowed = units.split()
    examples = {'ep': '36ep', 'ba': '100ba', 'sp': '50000sp', 'dur': '0.1dur'}
    expected = (
        f'expected a {"non-negative" if allow_zero else "positive"} time in '
        f'{", ".join(TIME_UNITS[u] for u in allowed)}, '
        f'such as {" or ".join(repr(examples[u]) for u in allowed)}'
    )

    def rule(value: str) -> Optional[str]:
        try:
            amount, unit = parse_time(value)
        except ValueError as error:
            return f'{error}; {expected}'
        if unit not in allowed:
            return f'{value!r} is in a unit this key does not take; {expected}'
        if amount < 0 or (amount == 0 and not allow_zero) or (unit == 'dur' and amount > 1):
            return f'{value!r} is out of range; {expected}'
        return None

    return rule


def _placeholders(*names: str) -> Rule:
    """A ``str.format`` string whose only placeholders are ``names``."""
    allowed = ', '.join('{' + name + '}' for name in names)

    def rule(value: str) -> Optional[str]:
        try:
            fields = [field for _, field, _, _ in string.Formatter().parse(value) if field is not None]
        except ValueError as error:
            return f'{value!r} is not a valid format string ({error}); write braces only as {allowed}'
        unknown = [field for field in fields if field not in names]
        if unknown:
            return f'{value!r} has the unknown placeholder {{{unknown[0]}}}; the only placeholder is {allowed}'
        return None

    return rule


def _file_name(value: str) -> Optional[str]:
    if value and not set(value) & set('/\\\0{}') and value not in ('.', '..'):
        return None
    return f'{value!r} cannot name a run folder; use letters, digits, dots, dashes and underscores'


def _key(default: Any, rule: Optional[Rule] = None) -> Any:
    """A schema field with ``default`` (a mutable default becomes a factory) and its ``rule``."""
    return dataclasses.field(default=default, metadata={'rule': rule})


def _section(cls: type) -> Any:
    return dataclasses.field(default_factory=cls)


# --- the schema --------------------------------------------------------------------------------------


# 8 px: the smallest input a stride-32 net still maps to 1 x 1; 4096 px: 48 MiB a sample
_PIXELS = _between(8, 4096)


@dataclasses.dataclass
class ModelConfig:
    """``model:`` a torchvision model name (built with ``weights=None``) or ``module:callable``."""

    name: str = _key('resnet50')
    num_classes: int = _key(1000, _between(1))


@dataclasses.dataclass
class DataConfig:
    """``data:`` where the images come from and how they are cropped.

    ``path`` is an ImageNet folder with ``train/`` and ``val/`` class folders; ``null`` uses
    the embedded synthetic ImageNet of ``synthetic_train_samples`` / ``synthetic_eval_samples``.
    ``on_corrupt`` is what training *and* evaluation do with an image that cannot be decoded.
    """

    path: Optional[str] = _key(None)
    train_crop: int = _key(224, _PIXELS)
    eval_crop: int = _key(224, _PIXELS)
    eval_resize: Optional[int] = _key(None, _between(8, 8192))
    workers: int = _key(0, _between(0, 256))
    synthetic_train_samples: Optional[int] = _key(None, _between(1))
    synthetic_eval_samples: Optional[int] = _key(None, _between(1))
    on_corrupt: str = _key('raise', _choices('raise', 'skip'))


@dataclasses.dataclass
class OptimizerConfig:
    """``optimizer:`` Composer's DecoupledSGDW; ``lr`` is for ``reference_batch_size`` and is
    scaled linearly to the global batch size."""

    name: str = _key('decoupled_sgdw', _choices('decoupled_sgdw'))
    lr: float = _key(0.1, _between(0, open_low=True))
    reference_batch_size: int = _key(256, _between(1))
    momentum: float = _key(0.9, _between(0, 1, open_high=True))
    weight_decay: float = _key(0.0, _between(0))


@dataclasses.dataclass
class SchedulerConfig:
    """``scheduler:`` cosine decay after a linear warmup (Composer time strings: ``8ep``, ``100ba``)."""

    name: str = _key('cosine_with_warmup', _choices('cosine_with_warmup'))
    t_warmup: str = _key('0ba', _time('ep ba sp dur', allow_zero=True))
    alpha_f: float = _key(0.0, _between(0, 1))


@dataclasses.dataclass
class TrainConfig:
    """``train:`` duration, batch size, precision and checkpoints.

    ``gpu_precision`` applies on a GPU; on the CPU Composer's Trainer takes only fp32.
    ``save_folder`` may hold ``{name}``, the recipe's name.
    """

    max_duration: str = _key('1ep', _time('ep ba sp'))
    global_batch_size: int = _key(256, _between(1))
    eval_batch_size: Optional[int] = _key(None, _between(1))
    eval_interval: str = _key('1ep', _time('ep ba dur'))
    gpu_precision: str = _key('amp_fp16', _choices('amp_fp16', 'amp_bf16', 'fp32'))
    device: str = _key('auto', _choices('auto', 'cpu', 'gpu'))
    seed: int = _key(17, _between(0, 2**32 - 1))
    save_folder: str = _key('runs/{name}', _placeholders('name'))
    save_interval: str = _key('1ep', _time('ep ba dur'))
    save_num_checkpoints_to_keep: int = _key(
        -1, lambda n: None if n == -1 or n >= 1 else f'{n!r} is out of range; expected -1 (keep all) or a count >= 1'
    )


@dataclasses.dataclass
class Recipe:
    """A whole recipe. ``algorithms`` maps a registry name to its options (or true/false)."""

    name: str = _key(dataclasses.MISSING, _file_name)
    model: ModelConfig = _section(ModelConfig)
    data: DataConfig = _section(DataConfig)
    optimizer: OptimizerConfig = _section(OptimizerConfig)
    scheduler: SchedulerConfig = _section(SchedulerConfig)
    train: TrainConfig = _section(TrainConfig)
    algorithms: dict[str, Any] = _section(dict)
    source: str = dataclasses.field(default='<recipe>', compare=False, metadata={'internal': True})

    def enabled_algorithms(self) -> dict[str, dict[str, Any]]:
        """The algorithms that are on, each with its options, ``channels_last`` last."""
        enabled = {
            name: ({} if options is True else options)
            for name, options in self.algorithms.items()
            if options not in (False, None)
        }
        return dict(sorted(enabled.items(), key=lambda item: item[0] == 'channels_last'))

    def save_folder(self) -> Path:
        return Path(self.train.save_folder.format(name=self.name))


# --- checking ------------------------------------------------------------------------------------------


def closest(key: str, options: list[str]) -> str:
    """``'; did you mean ...'`` for the option closest to ``key``, or the list of valid options."""
    close = difflib.get_close_matches(key, options, n=1)
    return f"; did you mean '{close[0]}'?" if close else f'; valid keys: {", ".join(options)}'


def type_problem(value: Any, annotation: Any) -> Optional[str]:
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return None
    if isinstance(value, annotation) and not (annotation is int and isinstance(value, bool)):
        return None
    return f'expected {annotation.__name__}, got {type(value).__name__} {value!r}'


def _check_value(value: Any, annotation: Any, rule: Optional[Rule], where: str, error) -> Any:
    """``value`` checked against ``annotation`` (a dataclass, Optional, dict, int, float, str) and ``rule``."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        if value is None:
            return None
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise error(
                f'{where}: expected a mapping of {annotation.__name__} keys, got {type(value).__name__} {value!r}'
            )
        return _from_dict(annotation, value, where, error)
    if typing.get_origin(annotation) is dict:
        if not isinstance(value, dict):
            raise error(f'{where}: expected a mapping, got {type(value).__name__} {value!r}')
        return value
    problem = type_problem(value, annotation)
    if problem is None:
        value = float(value) if annotation is float else value
        problem = rule(value) if rule is not None else None
    if problem is not None:
        raise error(f'{where}: {problem}')
    return value


def _from_dict(cls: type, data: dict[str, Any], prefix: str, error) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get('internal')}
    values = {}
    for key, value in data.items():
        where = f'{prefix}.{key}' if prefix else str(key)
        if key not in fields:
            raise error(f'{where}: unknown key{closest(str(key), list(fields))}')
        values[key] = _check_value(value, hints[key], fields[key].metadata.get('rule'), where, error)
    missing = [
        name
        for name, f in fields.items()
        if name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise error(f'{prefix + "." if prefix else ""}{missing[0]}: required key is missing')
    return cls(**values)


def _check_together(recipe: Recipe, error) -> None:
    """The rules that tie two keys together."""
    data, train = recipe.data, recipe.train
    if data.eval_resize is not None and data.eval_resize < data.eval_crop:
        raise error(
            f'data.eval_resize: {data.eval_resize} is smaller than data.eval_crop {data.eval_crop}; '
            'the centre crop would pad the image: use eval_resize >= eval_crop'
        )
    if data.synthetic_train_samples is not None and data.synthetic_train_samples < train.global_batch_size:
        raise error(
            f'train.global_batch_size: {train.global_batch_size} is more than the '
            f'{data.synthetic_train_samples} samples of data.synthetic_train_samples, so no full batch '
            'would be trained; lower the batch size or raise the sample count'
        )
    warmup, warmup_unit = parse_time(recipe.scheduler.t_warmup)
    length, unit = parse_time(train.max_duration)
    in_batches = {'ep', 'ba'}  # the scheduler counts epochs in batches
    if warmup_unit != 'dur' and (warmup_unit in in_batches) != (unit in in_batches):
        raise error(
            f'scheduler.t_warmup: {recipe.scheduler.t_warmup!r} cannot be compared with train.max_duration '
            f'{train.max_duration!r}; give both in samples, or both in epochs or batches (or t_warmup in dur)'
        )
    if (warmup_unit == unit and warmup >= length) or (warmup_unit == 'dur' and warmup >= 1):
        raise error(
            f'scheduler.t_warmup: {recipe.scheduler.t_warmup!r} is not shorter than train.max_duration '
            f'{train.max_duration!r}; the cosine decay would never start'
        )


def recipe_from_dict(data: Any, source: str) -> Recipe:
    """The :class:`Recipe` in the parsed YAML ``data`` of the file ``source``, every key checked."""

    def error(message: str) -> RecipeError:
        return RecipeError(f'{source}: {message}')

    if not isinstance(data, dict):
        raise error(f'expected a mapping of recipe sections at the top, got {type(data).__name__}')
    recipe = _from_dict(Recipe, data, '', error)
    recipe.source = source
    _check_together(recipe, error)
    return recipe
