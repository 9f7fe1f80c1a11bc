"""YAML recipes: load, validate against a typed schema, override, and build a Composer Trainer.

A recipe is one YAML file (see ``recipes/resnet50_imagenet.yaml``) with the sections of
:class:`Recipe`. Every key is checked before anything is built: an unknown key (with the
closest valid name), a wrong type, an unknown algorithm or algorithm option all raise
:class:`RecipeError` naming the file and the key path. ``--set key.path=value`` overrides are
applied first, their values read as YAML (``0.1``, ``true``, ``null``, ``[1, 2]``).

Algorithms are named by their snake names: ``channels_last`` is this project's
:class:`~channels_last_algo.ChannelsLast`; Composer's built-in algorithms go by the names of
their packages (``blurpool``, ``ema``, ``label_smoothing``, ``progressive_resizing``, ...,
and ``composer_channels_last`` for Composer's own ChannelsLast). ``name: {options}`` or
``name: true`` turns one on, ``name: false`` (or leaving it out) turns it off.

Example:
    >>> recipe = load_recipe('recipes/resnet50_imagenet.yaml', ['optimizer.lr=0.1'])
    >>> recipe.optimizer.lr, 'channels_last' in recipe.enabled_algorithms()
    (0.1, True)
    >>> load_recipe('recipes/resnet50_imagenet.yaml', ['optimizer.lrr=0.1'])  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ...
    RecipeError: recipes/resnet50_imagenet.yaml: optimizer.lrr: unknown key; did you mean 'lr'?
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import yaml

__all__ = [
    'DataConfig',
    'ModelConfig',
    'OptimizerConfig',
    'Recipe',
    'RecipeError',
    'SchedulerConfig',
    'TrainConfig',
    'algorithm_registry',
    'build_algorithms',
    'build_datasets',
    'build_trainer',
    'device_and_precision',
    'load_recipe',
]


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file, the key path and the fix."""


@dataclasses.dataclass
class ModelConfig:
    """``model:`` a torchvision model name (built with ``weights=None``) or ``module:callable``."""

    name: str = 'resnet50'
    num_classes: int = 1000


@dataclasses.dataclass
class DataConfig:
    """``data:`` where the images come from and how they are cropped.

    ``path`` is an ImageNet folder with ``train/`` and ``val/`` class folders; ``null`` uses
    the embedded synthetic ImageNet of ``synthetic_train_samples`` / ``synthetic_eval_samples``.
    """

    path: Optional[str] = None
    train_crop: int = 224
    eval_crop: int = 224
    eval_resize: Optional[int] = None
    workers: int = 0
    synthetic_train_samples: Optional[int] = None
    synthetic_eval_samples: Optional[int] = None
    on_corrupt: str = 'raise'


@dataclasses.dataclass
class OptimizerConfig:
    """``optimizer:`` Composer's DecoupledSGDW; ``lr`` is for ``reference_batch_size`` and is
    scaled linearly to the global batch size."""

    name: str = 'decoupled_sgdw'
    lr: float = 0.1
    reference_batch_size: int = 256
    momentum: float = 0.9
    weight_decay: float = 0.0


@dataclasses.dataclass
class SchedulerConfig:
    """``scheduler:`` cosine decay after a linear warmup (Composer time strings: ``8ep``, ``100ba``)."""

    name: str = 'cosine_with_warmup'
    t_warmup: str = '0ba'
    alpha_f: float = 0.0


@dataclasses.dataclass
class TrainConfig:
    """``train:`` duration, batch size, precision and checkpoints.

    ``gpu_precision`` applies on a GPU; on the CPU Composer's Trainer takes only fp32.
    """

    max_duration: str = '1ep'
    global_batch_size: int = 256
    eval_batch_size: Optional[int] = None
    eval_interval: str = '1ep'
    gpu_precision: str = 'amp_fp16'
    device: str = 'auto'
    seed: int = 17
    save_folder: str = 'runs/{name}'
    save_interval: str = '1ep'
    save_num_checkpoints_to_keep: int = -1


@dataclasses.dataclass
class Recipe:
    """A whole recipe. ``algorithms`` maps a registry name to its options (or true/false)."""

    name: str
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    algorithms: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str = dataclasses.field(default='<recipe>', compare=False, metadata={'internal': True})

    def enabled_algorithms(self) -> dict[str, dict[str, Any]]:
        """The algorithms that are on, each with its options, ``channels_last`` last."""
        enabled = {name: ({} if options is True else options)
                   for name, options in self.algorithms.items() if options not in (False, None)}
        return dict(sorted(enabled.items(), key=lambda item: item[0] == 'channels_last'))

    def save_folder(self) -> Path:
        return Path(self.train.save_folder.format(name=self.name))


_CHOICES = {
    'optimizer.name': ('decoupled_sgdw',),
    'scheduler.name': ('cosine_with_warmup',),
    'train.gpu_precision': ('amp_fp16', 'amp_bf16', 'fp32'),
    'train.device': ('auto', 'cpu', 'gpu'),
    'data.on_corrupt': ('raise', 'skip'),
}


# --- validation ----------------------------------------------------------------------------------------


def _closest(key: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(options), n=1)
    return f"; did you mean '{close[0]}'?" if close else f'; valid keys: {", ".join(options)}'


def _type_name(annotation: Any) -> str:
    return getattr(annotation, '__name__', str(annotation))


def _check_value(value: Any, annotation: Any, where: str, error) -> Any:
    """``value`` checked against ``annotation`` (a dataclass, Optional, dict, int, float, str, bool)."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        (inner,) = [a for a in options if a is not type(None)]
        return _check_value(value, inner, where, error)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise error(f'{where}: expected a mapping of {annotation.__name__} keys, got {type(value).__name__} {value!r}')
        return _from_dict(annotation, value, where, error)
    if origin is dict or annotation is Any:
        if origin is dict and not isinstance(value, dict):
            raise error(f'{where}: expected a mapping, got {type(value).__name__} {value!r}')
        return value
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, annotation) or (annotation is int and isinstance(value, bool)):
        raise error(f'{where}: expected {_type_name(annotation)}, got {type(value).__name__} {value!r}')
    return value


def _from_dict(cls: type, data: dict[str, Any], prefix: str, error) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get('internal')}
    values = {}
    for key, value in data.items():
        where = f'{prefix}.{key}' if prefix else str(key)
        if key not in fields:
            raise error(f'{where}: unknown key{_closest(str(key), list(fields))}')
        values[key] = _check_value(value, hints[key], where, error)
        if where in _CHOICES and values[key] not in _CHOICES[where]:
            raise error(f'{where}: {values[key]!r} is not one of {", ".join(_CHOICES[where])}')
    missing = [name for name, f in fields.items()
               if name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise error(f'{prefix + "." if prefix else ""}{missing[0]}: required key is missing')
    return cls(**values)


def _apply_override(data: dict[str, Any], override: str, error) -> None:
    path, sep, text = override.partition('=')
    if not sep or not path:
        raise error(f'--set {override!r}: expected KEY.PATH=VALUE, e.g. optimizer.lr=0.1')
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError as exc:
        raise error(f'--set {override!r}: the value is not valid YAML ({exc.problem})') from exc
    keys = path.split('.')
    node = data
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None or child is True:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise error(f'--set {override!r}: {".".join(keys[:depth + 1])} is {child!r}, not a mapping')
        node = child
    node[keys[-1]] = value


def _check_algorithms(recipe: Recipe, error) -> None:
    registry = algorithm_registry()
    for name, options in recipe.algorithms.items():
        where = f'algorithms.{name}'
        if name not in registry:
            raise error(f'{where}: unknown algorithm{_closest(name, sorted(registry))}')
        if options in (True, False, None):
            continue
        if not isinstance(options, dict):
            raise error(f'{where}: expected a mapping of options, true or false, got {type(options).__name__} {options!r}')
        parameters = inspect.signature(registry[name]).parameters
        for key in options:
            if key not in parameters:
                raise error(f'{where}.{key}: unknown option of {registry[name].__name__}'
                            f'{_closest(str(key), list(parameters))}')


def load_recipe(path: Union[str, os.PathLike], overrides: Sequence[str] = ()) -> Recipe:
    """Read, override and validate the recipe at ``path``; :class:`RecipeError` if anything is off."""
    path = Path(path)

    def error(message: str) -> RecipeError:
        return RecipeError(f'{path}: {message}')

    if not path.is_file():
        raise RecipeError(f'{path}: no such recipe file' + (' (it is a folder)' if path.is_dir() else ''))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, 'problem_mark', None)
        where = f' at line {mark.line + 1}, column {mark.column + 1}' if mark else ''
        raise error(f'not valid YAML{where}: {getattr(exc, "problem", exc)}') from exc
    if not isinstance(data, dict):
        raise error(f'expected a mapping of recipe sections at the top, got {type(data).__name__}')
    for override in overrides:
        _apply_override(data, override, error)
    recipe = _from_dict(Recipe, data, '', error)
    recipe.source = str(path)
    _check_algorithms(recipe, error)
    return recipe


# --- building ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def algorithm_registry() -> dict[str, type]:
    """Algorithm classes by snake name: this project's ``channels_last`` and Composer's built-ins
    (by their package names; Composer's ChannelsLast as ``composer_channels_last``)."""
    import composer.algorithms
    from composer.core import Algorithm

    from channels_last_algo.integrations.composer import ChannelsLast

    registry: dict[str, type] = {}
    for attr in composer.algorithms.__all__:
        cls = getattr(composer.algorithms, attr)
        if isinstance(cls, type) and issubclass(cls, Algorithm):
            name = re.sub(r'^composer\.algorithms\.([a-z0-9_]+)\..*$', r'\1', cls.__module__)
            registry['composer_' + name if name == 'channels_last' else name] = cls
    registry['channels_last'] = ChannelsLast
    return registry


def build_algorithms(recipe: Recipe) -> list[Any]:
    """The recipe's algorithm objects, in recipe order with ``channels_last`` last, so that it
    restrides the layers other algorithms swap in at ``Event.INIT`` (BlurPool's, say)."""
    registry = algorithm_registry()
    return [registry[name](**options) for name, options in recipe.enabled_algorithms().items()]


def device_and_precision(recipe: Recipe) -> tuple[str, str]:
    """Composer's device name and precision for ``recipe`` here: fp32 on the CPU (all Composer's
    Trainer takes there), ``train.gpu_precision`` on a GPU."""
    import torch

    device = recipe.train.device
    if device == 'auto':
        device = 'gpu' if torch.cuda.is_available() else 'cpu'
    if device == 'gpu' and not torch.cuda.is_available():
        raise RecipeError(f'{recipe.source}: train.device: gpu was asked for but no CUDA device is visible; '
                          'set train.device=auto or cpu')
    return device, ('fp32' if device == 'cpu' else recipe.train.gpu_precision)


def _batch_sizes(recipe: Recipe) -> tuple[int, int]:
    from composer.utils import dist

    world = dist.get_world_size()
    train = recipe.train
    for key, size in (('global_batch_size', train.global_batch_size), ('eval_batch_size', train.eval_batch_size)):
        if size is not None and (size < 1 or size % world):
            raise RecipeError(f'{recipe.source}: train.{key}: {size} must be a positive multiple of the '
                              f'world size ({world})')
    eval_size = train.global_batch_size if train.eval_batch_size is None else train.eval_batch_size
    return train.global_batch_size // world, eval_size // world


def build_datasets(recipe: Recipe, data_path: Optional[str] = None):
    """The recipe's train and eval datasets (NHWC uint8 samples): ``data_path`` (or
    ``data.path``) as an ImageNet folder, the synthetic set when neither is given."""
    from channels_last_algo.app.data import DataPathError, imagenet_dataset

    data = recipe.data
    path = data_path if data_path is not None else data.path
    common = dict(data_path=path, num_classes=recipe.model.num_classes, seed=recipe.train.seed, on_corrupt=data.on_corrupt)
    try:
        train = imagenet_dataset('train', crop_size=data.train_crop, synthetic_samples=data.synthetic_train_samples,
                                 synthetic_image_size=max(data.train_crop, data.eval_resize or data.eval_crop), **common)
        val = imagenet_dataset('val', crop_size=data.eval_crop, resize_size=data.eval_resize,
                               synthetic_samples=data.synthetic_eval_samples,
                               synthetic_image_size=max(data.train_crop, data.eval_resize or data.eval_crop), **common)
    except DataPathError as exc:
        key = 'data.path' if data_path is None else '--data'
        raise RecipeError(f'{recipe.source}: {key}: {exc}') from exc
    return train, val


def build_trainer(recipe: Recipe, data_path: Optional[str] = None, resume: bool = False, **trainer_options: Any):
    """A Composer ``Trainer`` for ``recipe``: the model, NHWC loaders, DecoupledSGDW with the
    linearly scaled learning rate, cosine-with-warmup schedule, the algorithms, fp32 on CPU and
    ``train.gpu_precision`` on a GPU, checkpoints in the recipe's save folder. With ``resume``
    it continues from the latest checkpoint there. ``trainer_options`` go to the Trainer."""
    from composer import Trainer
    from composer.models import ComposerClassifier
    from composer.optim import CosineAnnealingWithWarmupScheduler, DecoupledSGDW
    from composer.utils import reproducibility

    from channels_last_algo.app.data import build_data_spec
    from channels_last_algo.app.models import build_model

    device, precision = device_and_precision(recipe)
    train_batch, eval_batch = _batch_sizes(recipe)
    train_data, eval_data = build_datasets(recipe, data_path)
    save_folder = recipe.save_folder()
    load_path = None
    if resume:
        latest = save_folder / 'latest-rank0.pt'
        if not latest.exists():
            raise RecipeError(f'{recipe.source}: --resume: no checkpoint {latest} to resume from; train once '
                              'without --resume first (or set train.save_folder to the run to resume)')
        load_path = str(latest)

    reproducibility.seed_all(recipe.train.seed)
    try:
        module = build_model(recipe.model.name, num_classes=recipe.model.num_classes)
    except (ValueError, TypeError) as exc:
        raise RecipeError(f'{recipe.source}: model.name: {exc}') from exc
    model = ComposerClassifier(module, num_classes=recipe.model.num_classes)
    loader_options = dict(workers=recipe.data.workers, seed=recipe.train.seed)
    opt = recipe.optimizer
    lr = opt.lr * recipe.train.global_batch_size / opt.reference_batch_size
    optimizer = DecoupledSGDW(model.parameters(), lr=lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    scheduler = CosineAnnealingWithWarmupScheduler(t_warmup=recipe.scheduler.t_warmup, alpha_f=recipe.scheduler.alpha_f)
    return Trainer(
        model=model,
        train_dataloader=build_data_spec(train_data, batch_size=train_batch, train=True, **loader_options),
        eval_dataloader=build_data_spec(eval_data, batch_size=eval_batch, train=False, **loader_options),
        eval_interval=recipe.train.eval_interval,
        max_duration=recipe.train.max_duration,
        optimizers=optimizer,
        schedulers=scheduler,
        algorithms=build_algorithms(recipe),
        device=device,
        precision=precision,
        seed=recipe.train.seed,
        save_folder=str(save_folder),
        save_interval=recipe.train.save_interval,
        save_num_checkpoints_to_keep=recipe.train.save_num_checkpoints_to_keep,
        save_overwrite=not resume,
        load_path=load_path,
        run_name=recipe.name,
        **trainer_options,
    )
