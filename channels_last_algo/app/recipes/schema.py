"""The recipe schema: typed sections, the rule each key must satisfy, and Composer time strings.

Every key of a recipe is declared once here, with its type, a *rule*
(:mod:`~channels_last_algo.app.recipes.value_rules`: a range, a set of choices, a time string's units, a
format string's placeholders) and what it means, from which :mod:`~channels_last_algo.app.recipes.keys`
prints the reference (``channels-last train --help-keys``). :func:`recipe_from_dict` checks a parsed
YAML mapping against the schema before anything is built, the keys that depend on each other too
(:func:`check_durations` compares the times in samples), and raises :class:`RecipeError` with the
key path and what would be valid. An evaluation or checkpoint interval longer than the run is no
error: it happens at the end, and :func:`check_durations` returns a note that says so. Nothing here
needs Composer or torch.

Example:
    >>> recipe = recipe_from_dict({'name': 'r', 'train': {'max_duration': '2ep'}}, 'r.yaml')
    >>> recipe.train.max_duration, recipe.save_folder().as_posix()
    ('2ep', 'runs/r')
    >>> recipe_from_dict({'name': 'r', 'optimizer': {'lr': -1}}, 'r.yaml')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    channels_last_algo.app.recipes.schema.RecipeError: r.yaml: optimizer.lr: -1.0 is out of range; expected a ... > 0
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

from channels_last_algo.app.recipes.value_rules import (
    Rule,
    between,
    choices,
    closest,
    count_or,
    file_name,
    parse_time,
    path_text,
    placeholders,
    time_string,
    type_problem,
)

__all__ = [
    'DataConfig',
    'ModelConfig',
    'OptimizerConfig',
    'Recipe',
    'RecipeError',
    'SchedulerConfig',
    'TrainConfig',
    'check_durations',
    'recipe_from_dict',
]


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file, the key path and the fix."""


def _key(default: Any, rule: Optional[Rule] = None, *, doc: str) -> Any:
    """A schema field with ``default``, its ``rule`` and ``doc``, what it means (the key reference prints both)."""
    return dataclasses.field(default=default, metadata={'rule': rule, 'doc': doc})


def _section(cls: type, doc: str) -> Any:
    return dataclasses.field(default_factory=cls, metadata={'doc': doc})


# --- the schema --------------------------------------------------------------------------------------


# 8 px: the smallest input a stride-32 net still maps to 1 x 1; 4096 px: 48 MiB a sample
_PIXELS = between(8, 4096)


@dataclasses.dataclass
class ModelConfig:
    """``model:`` a torchvision model name (built with ``weights=None``) or ``module:callable``."""

    name: str = _key('resnet50', doc='a torchvision model name (built with weights=None) or module.path:callable')
    # 100,000: beyond any classification set a conv net is trained on here (ImageNet-21k has 21,841 classes),
    # and a ResNet-50 classifier of that size already holds 200 M parameters
    num_classes: int = _key(
        1000, between(1, 100_000), doc="the classifier's outputs (and the synthetic data's classes)"
    )


@dataclasses.dataclass
class DataConfig:
    """``data:`` where the images come from and how they are cropped.

    ``path`` is an ImageNet folder with ``train/`` and ``val/`` class folders; ``null`` uses
    the embedded synthetic ImageNet of ``synthetic_train_samples`` / ``synthetic_eval_samples``.
    ``on_corrupt`` is what training *and* evaluation do with an image that cannot be decoded.
    """

    path: Optional[str] = _key(
        None,
        path_text,
        doc='an ImageNet folder with train/ and val/ class folders (--data overrides it); null: synthetic data',
    )
    train_crop: int = _key(224, _PIXELS, doc='training crop in px (random resized crop and flip)')
    eval_crop: int = _key(224, _PIXELS, doc='evaluation centre crop in px')
    eval_resize: Optional[int] = _key(
        None, between(8, 8192), doc="evaluation: the short side's size before the crop; null: eval_crop * 232 / 224"
    )
    workers: int = _key(
        0,
        between(0, 256),
        doc='the most data loader worker processes per rank: each loader starts min(workers, the cores this process '
        'may use); 0: load in the training process',
    )
    synthetic_train_samples: Optional[int] = _key(
        None, between(1), doc="synthetic training images (without a path); null: ImageNet's 1,281,167"
    )
    synthetic_eval_samples: Optional[int] = _key(
        None, between(1), doc="synthetic evaluation images (without a path); null: ImageNet's 50,000"
    )
    on_corrupt: str = _key(
        'raise', choices('raise', 'skip'), doc='what training and evaluation do with an image that cannot be decoded'
    )


@dataclasses.dataclass
class OptimizerConfig:
    """``optimizer:`` Composer's DecoupledSGDW; ``lr`` is for ``reference_batch_size`` and is
    scaled linearly to the global batch size."""

    name: str = _key('decoupled_sgdw', choices('decoupled_sgdw'), doc="the optimizer: Composer's DecoupledSGDW")
    lr: float = _key(
        0.1,
        between(0, open_low=True),
        doc='the learning rate at reference_batch_size, scaled linearly to train.global_batch_size',
    )
    reference_batch_size: int = _key(256, between(1), doc='the global batch size that lr is given for')
    momentum: float = _key(0.9, between(0, 1, open_high=True), doc='SGD momentum')
    weight_decay: float = _key(0.0, between(0), doc='decoupled weight decay')


@dataclasses.dataclass
class SchedulerConfig:
    """``scheduler:`` cosine decay after a linear warmup (Composer time strings: ``8ep``, ``100ba``)."""

    name: str = _key(
        'cosine_with_warmup', choices('cosine_with_warmup'), doc='the schedule: cosine decay after a linear warmup'
    )
    t_warmup: str = _key('0ba', time_string('ep ba sp dur', allow_zero=True), doc='the linear warmup before the decay')
    alpha_f: float = _key(0.0, between(0, 1), doc='the final learning rate, as a fraction of the peak')


@dataclasses.dataclass
class TrainConfig:
    """``train:`` duration, batch size, precision and checkpoints.

    ``gpu_precision`` applies on a GPU; on the CPU Composer's Trainer takes only fp32.
    ``save_folder`` may hold ``{name}``, the recipe's name.
    """

    max_duration: str = _key('1ep', time_string('ep ba sp'), doc='how long to train')
    global_batch_size: int = _key(
        256, between(1), doc='images per optimizer step over all ranks (each rank loads global / world size)'
    )
    device_train_microbatch_size: Union[int, str] = _key(
        'auto',
        count_or('auto', 'fit the device'),
        doc="images per forward and backward pass on each rank, for training and evaluation; a rank's batch is "
        'split into microbatches and their gradients summed, one optimizer step per global batch (so the '
        "learning rate stays that of the global batch). 'auto': Composer's, halving on CUDA out-of-memory, on a "
        "GPU; on the CPU, which has no out-of-memory error to catch, 32 (or the rank's batch if smaller)",
    )
    eval_batch_size: Optional[int] = _key(
        None, between(1), doc='evaluation images per batch over all ranks; null: global_batch_size'
    )
    eval_subset_num_batches: int = _key(
        -1, count_or(-1, 'the whole set'), doc='evaluation batches per rank at each evaluation'
    )
    eval_interval: str = _key(
        '1ep', time_string('ep ba dur'), doc='evaluate this often, and at the end (only there if longer than the run)'
    )
    gpu_precision: str = _key(
        'amp_fp16', choices('amp_fp16', 'amp_bf16', 'fp32'), doc='the precision on a GPU (the CPU trains in fp32)'
    )
    device: str = _key(
        'auto', choices('auto', 'cpu', 'gpu'), doc='where to train; auto: the GPU when CUDA is visible, else the CPU'
    )
    seed: int = _key(17, between(0, 2**32 - 1), doc='the seed of weights, data order and augmentation')
    save_folder: str = _key(
        'runs/{name}', placeholders('name'), doc="the run's checkpoint folder, locked while it trains"
    )
    save_interval: str = _key(
        '1ep',
        time_string('ep ba dur'),
        doc='write a checkpoint this often and at the end, before that evaluation (only there if longer than the run)',
    )
    save_num_checkpoints_to_keep: int = _key(
        -1, count_or(-1, 'keep all'), doc='the newest checkpoints kept in save_folder; older ones are deleted'
    )


@dataclasses.dataclass
class Recipe:
    """A whole recipe. ``algorithms`` maps a registry name to its options (or true/false)."""

    name: str = _key(dataclasses.MISSING, file_name, doc="the run's name: the {name} of train.save_folder")
    model: ModelConfig = _section(ModelConfig, 'the network')
    data: DataConfig = _section(DataConfig, 'the images')
    optimizer: OptimizerConfig = _section(OptimizerConfig, 'the optimizer')
    scheduler: SchedulerConfig = _section(SchedulerConfig, 'the learning-rate schedule')
    train: TrainConfig = _section(TrainConfig, 'duration, batches, device and checkpoints')
    algorithms: dict[str, Any] = _section(
        dict,
        "algorithm name -> its options, true (its defaults) or false (off): channels_last (this project's), "
        "Composer's by package name (blurpool, ema, label_smoothing, progressive_resizing, cutmix, ...; "
        "composer_channels_last is Composer's ChannelsLast), each option checked against the algorithm's signature",
    )
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


def _check_value(value: Any, annotation: Any, rule: Optional[Rule], where: str, error) -> Any:
    """``value`` checked against ``annotation`` (a dataclass, Optional, Union, dict, int, float, str) and ``rule``."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None and len(inner) < len(typing.get_args(annotation)):
            return None
        annotation = inner[0] if len(inner) == 1 else annotation
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


# what a warmup as long as the run does, and the keys that fix it
_NO_DECAY = (
    'the cosine decay would never start: give a scheduler.t_warmup shorter than train.max_duration (a tenth of it, '
    'say) or a longer train.max_duration'
)
# the intervals that also happen at the end of the run, so that one longer than the run happens there only
_AT_END = ('eval_interval', 'save_interval')


def _check_together(recipe: Recipe, error) -> None:
    """The rules that tie two keys together; the durations too when the training set's size is in the recipe."""
    data = recipe.data
    if data.eval_resize is not None and data.eval_resize < data.eval_crop:
        raise error(
            f'data.eval_resize: {data.eval_resize} is smaller than data.eval_crop {data.eval_crop}; '
            'the centre crop would pad the image: use eval_resize >= eval_crop'
        )
    warmup_unit, unit = parse_time(recipe.scheduler.t_warmup)[1], parse_time(recipe.train.max_duration)[1]
    in_batches = {'ep', 'ba'}  # Composer's scheduler counts epochs in batches, and refuses samples against those
    if warmup_unit != 'dur' and (warmup_unit in in_batches) != (unit in in_batches):
        raise error(
            f'scheduler.t_warmup: {recipe.scheduler.t_warmup!r} cannot be compared with train.max_duration '
            f'{recipe.train.max_duration!r}; give both in samples, or both in epochs or batches (or t_warmup in dur)'
        )
    warmup, length = parse_time(recipe.scheduler.t_warmup)[0], parse_time(recipe.train.max_duration)[0]
    if (warmup_unit == unit and warmup >= length) or (warmup_unit == 'dur' and warmup >= 1):
        raise error(
            f'scheduler.t_warmup: {recipe.scheduler.t_warmup!r} is not shorter than train.max_duration '
            f'{recipe.train.max_duration!r}; {_NO_DECAY}'
        )
    if data.path is None and data.synthetic_train_samples is not None:
        check_durations(recipe, data.synthetic_train_samples, 'data.synthetic_train_samples', error)
    if {'channels_last', 'composer_channels_last'} <= recipe.enabled_algorithms().keys():
        raise error(
            "algorithms.composer_channels_last: on beside algorithms.channels_last, whose weight layout Composer's "
            "model.to(channels_last) would undo; keep one (channels_last does what Composer's does and more)"
        )


def check_durations(recipe: Recipe, train_samples: int, samples_from: str, error) -> tuple[Recipe, Optional[str]]:
    """The recipe's times in samples through the training set's size, ``train_samples`` images (from ``samples_from``,
    for the messages): an ``error`` for what would change the training (no full batch an epoch, a warmup not shorter
    than the run); returned, the recipe as it runs, each evaluation or checkpoint interval longer than the run set to
    ``'1dur'`` (once, at the end, as Composer does), and one note naming those keys (None when there are none).

    Example:
        >>> recipe = recipe_from_dict({'name': 'r', 'train': {'max_duration': '3ba', 'global_batch_size': 4}}, 'r.yaml')
        >>> as_run, note = check_durations(recipe, 16, 'data.synthetic_train_samples', RecipeError)
        >>> as_run.train.eval_interval, as_run.train.save_interval
        ('1dur', '1dur')
        >>> print(note)  # doctest: +ELLIPSIS
        train.eval_interval '1ep' (16 samples) and train.save_interval '1ep' (16 samples) are longer than ...
    """
    batch = recipe.train.global_batch_size
    epoch = train_samples // batch
    if epoch < 1:
        raise error(
            f'train.global_batch_size: {batch} is more than the {train_samples} samples of {samples_from}, so no '
            'full batch would be trained; lower the batch size or add samples'
        )
    run = recipe.train.max_duration
    per_unit = {'ep': epoch * batch, 'ba': batch, 'sp': 1}
    length = parse_time(run)[0] * per_unit[parse_time(run)[1]]

    def samples(text: str) -> float:
        amount, unit = parse_time(text)
        return amount * length if unit == 'dur' else amount * per_unit[unit]

    scale = (
        f'{length:,} samples; {batch} images a batch, {epoch} batches an epoch of the {train_samples} samples '
        f'of {samples_from}'
    )
    warmup = recipe.scheduler.t_warmup
    if samples(warmup) >= length and samples(warmup) > 0:
        raise error(
            f'scheduler.t_warmup: {warmup!r} ({samples(warmup):,.0f} samples) is not shorter than train.max_duration '
            f'{run!r} ({scale}); {_NO_DECAY}'
        )
    return _intervals_at_end(recipe, samples, scale)


def _intervals_at_end(recipe: Recipe, samples: Callable[[str], float], scale: str) -> tuple[Recipe, Optional[str]]:
    """``recipe`` with each evaluation or checkpoint interval longer than the run set to ``'1dur'``, and the note
    naming them (None when none is); ``samples`` measures a time string in samples, ``scale`` says how."""
    run = recipe.train.max_duration
    at_end = {key: getattr(recipe.train, key) for key in _AT_END if samples(getattr(recipe.train, key)) > samples(run)}
    if not at_end:
        return recipe, None
    named = ' and '.join(f'train.{key} {value!r} ({samples(value):,.0f} samples)' for key, value in at_end.items())
    note = (
        f'{named} {"are" if len(at_end) > 1 else "is"} longer than train.max_duration {run!r} ({scale}), '
        f'so {"each happens" if len(at_end) > 1 else "it happens"} once, at the end of the run'
    )
    as_run = dataclasses.replace(recipe.train, **dict.fromkeys(at_end, '1dur'))
    return dataclasses.replace(recipe, train=as_run), note


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
