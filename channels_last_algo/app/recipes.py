"""YAML recipes: load, override, validate every key, and build a Composer Trainer.

A recipe is one YAML file (see ``recipes/resnet50_imagenet.yaml``) with the sections of
:class:`~channels_last_algo.app.recipe_schema.Recipe`. ``--set key.path=value`` overrides are
applied first, their values read as YAML (``0.1``, ``true``, ``null``, ``[1, 2]``). Then every
key is checked before anything is built (:mod:`~channels_last_algo.app.recipe_schema`: types,
ranges, time strings, choices, placeholders) and every algorithm option: ``channels_last``'s
by the core's own option check, Composer's against their signatures and by constructing them.
Anything off raises :class:`RecipeError` naming the file, the key path and the fix.

Algorithms are named by their snake names: ``channels_last`` is this project's
:class:`~channels_last_algo.ChannelsLast`; Composer's built-in algorithms go by the names of
their packages (``blurpool``, ``ema``, ``label_smoothing``, ``progressive_resizing``, ...,
and ``composer_channels_last`` for Composer's own ChannelsLast). ``name: {options}`` or
``name: true`` turns one on, ``name: false`` (or leaving it out) turns it off. YAML 1.1 reads
an unquoted ``mode: on`` as a bool; the recipe layer reads it back as ``'on'`` / ``'off'``.

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

import functools
import importlib.util
import inspect
import os
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

from channels_last_algo.app.algorithm_ranges import (
    NOT_ON_THIS_DATA_PATH,
    algorithm_cross_problem,
    algorithm_option_problem,
)
from channels_last_algo.app.recipe_rules import closest, parse_time, type_problem
from channels_last_algo.app.recipe_schema import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    Recipe,
    RecipeError,
    SchedulerConfig,
    TrainConfig,
    check_durations,
    recipe_from_dict,
)
from channels_last_algo.app.recipe_yaml import YamlError, parse_yaml, read_yaml_file
from channels_last_algo.core.guard import OPTIONS

__all__ = [
    'DataConfig',
    'ModelConfig',
    'OptimizerConfig',
    'Recipe',
    'SMOKE_OVERRIDES',
    'RecipeError',
    'SchedulerConfig',
    'TrainConfig',
    'algorithm_registry',
    'build_algorithms',
    'build_datasets',
    'build_trainer',
    'device_and_precision',
    'load_recipe',
    'microbatch_size',
]

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

# The microbatch 'auto' takes on the CPU. Composer's 'auto' halves the microbatch on a CUDA out-of-memory
# error and refuses any other device: on the CPU memory runs out without an error to catch (the kernel kills
# the process). ResNet-50 in fp32 keeps about 40 MiB of activations per training image at 176 px and 65 MiB at
# 224 px (measured: torch 2.7, oneDNN), so the shipped recipe's 2048-image batch would need about 80 GiB in one
# pass; 32 images need 1.3 to 2.1 GiB. The gradients are summed over the microbatches, so the optimizer step and
# the learning rate are those of the global batch; BatchNorm's statistics are over 32 images (as over each GPU's
# share in data-parallel training).
CPU_MICROBATCH = 32

# What a constructor raises for a bad option, or for one it cannot run with here (Composer's extras, as
# MissingConditionalImportError); each becomes the one line naming the option.
_ERRORS = (ValueError, TypeError, AssertionError, NotImplementedError, KeyError, ArithmeticError, ImportError)


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


def _check_channels_last(options: dict[str, Any], where: str, error, signature_known: bool) -> None:
    """This project's options, by the core's check; YAML's ``on``/``off`` booleans read as modes.
    Other keys are left to the algorithm's signature when it is known (Composer installed)."""
    if isinstance(options.get('mode'), bool):
        options['mode'] = 'on' if options['mode'] else 'off'
    for key, value in options.items():
        if key not in OPTIONS:
            if signature_known:
                continue
            raise error(f'{where}.{key}: unknown option of ChannelsLast{closest(str(key), list(OPTIONS))}')
        valid, expected = OPTIONS[key]
        if not valid(value):
            raise error(f'{where}.{key}: expected {expected}, got {type(value).__name__} {value!r}')


def _option_problem(cls: type, key: str, value: Any, default: Any) -> Optional[str]:
    """What the signature of ``cls`` says is wrong with ``value``: a simple annotation's type,
    or a time string where the default is one."""
    try:
        annotation = typing.get_type_hints(cls.__init__).get(key)
    except Exception:  # annotations that do not resolve here: leave the value to the constructor
        annotation = None
    if typing.get_origin(annotation) is Union and value is not None:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = inner[0] if len(inner) == 1 else None
    if annotation in (bool, int, float, str) and value is not None and type_problem(value, annotation):
        return type_problem(value, annotation)
    if isinstance(default, str) and isinstance(value, str):
        try:
            parse_time(default)
        except ValueError:
            return None
        try:
            parse_time(value)
        except ValueError as exc:
            return f'{exc}; expected a time string such as {default!r}'
    return None


def _check_composer_options(name: str, cls: type, options: dict[str, Any], where: str, error) -> None:
    """Each option of the algorithm ``name`` by its signature, then by the range table, then the options together,
    then by constructing it."""
    parameters = inspect.signature(cls).parameters
    for key, value in options.items():
        if key not in parameters:
            raise error(f'{where}.{key}: unknown option of {cls.__name__}{closest(str(key), list(parameters))}')
        problem = _option_problem(cls, key, value, parameters[key].default) or algorithm_option_problem(
            name, key, value
        )
        if problem:
            raise error(f'{where}.{key}: {problem}')
    crossed = algorithm_cross_problem(name, cls, options)
    if crossed:
        raise error(f'{where}.{crossed[0]}: {crossed[1]}')
    try:
        cls(**options)
    except _ERRORS as exc:

        def fails_alone(key: str) -> bool:
            try:
                cls(**{key: options[key]})
            except _ERRORS:
                return True
            return False

        culprit = next((key for key in options if fails_alone(key)), None)
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise error(f'{where}{"." + culprit if culprit else ""}: {cls.__name__} refuses it: {message}') from exc


def _check_algorithms(recipe: Recipe, error) -> None:
    """Every algorithm name and option; Composer's need Composer, and are checked where it is installed."""
    registry = algorithm_registry() if importlib.util.find_spec('composer') is not None else None
    for name, options in recipe.algorithms.items():
        where = f'algorithms.{name}'
        if not isinstance(name, str):
            raise error(f'algorithms: {name!r} is no algorithm name; name each by its snake name, such as blurpool')
        if registry is not None and name not in registry:
            raise error(f'{where}: unknown algorithm{closest(name, sorted(registry))}')
        if options in (False, None):
            continue
        if name in NOT_ON_THIS_DATA_PATH:
            raise error(f'{where}: cannot run in a recipe: {NOT_ON_THIS_DATA_PATH[name]}; remove it or set it false')
        options = {} if options is True else options
        if not isinstance(options, dict):
            raise error(
                f'{where}: expected a mapping of options, true or false, got {type(options).__name__} {options!r}'
            )
        if name == 'channels_last':
            _check_channels_last(options, where, error, signature_known=registry is not None)
        if registry is not None:
            _check_composer_options(name, registry[name], options, where, error)


def _check_model(recipe: Recipe, error) -> None:
    from channels_last_algo.app.models import model_builder

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
    _check_algorithms(recipe, error)
    _check_model(recipe, error)
    return recipe


# --- building ------------------------------------------------------------------------------------------


@functools.cache
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
    for name in recipe.enabled_algorithms():
        if name not in registry:
            raise RecipeError(f'{recipe.source}: algorithms.{name}: unknown algorithm{closest(name, sorted(registry))}')
    return [registry[name](**options) for name, options in recipe.enabled_algorithms().items()]


def device_and_precision(recipe: Recipe) -> tuple[str, str]:
    """Composer's device name and precision for ``recipe`` here: fp32 on the CPU (all Composer's
    Trainer takes there), ``train.gpu_precision`` on a GPU."""
    import torch

    device = recipe.train.device
    if device == 'auto':
        device = 'gpu' if torch.cuda.is_available() else 'cpu'
    if device == 'gpu' and not torch.cuda.is_available():
        raise RecipeError(
            f'{recipe.source}: train.device: gpu was asked for but no CUDA device is visible; '
            'set train.device=auto or cpu'
        )
    return device, ('fp32' if device == 'cpu' else recipe.train.gpu_precision)


def _batch_sizes(recipe: Recipe) -> tuple[int, int]:
    world = int(os.environ.get('WORLD_SIZE', 1))  # the launcher's; the process group is not up yet
    train = recipe.train
    for key, size in (('global_batch_size', train.global_batch_size), ('eval_batch_size', train.eval_batch_size)):
        if size is not None and size % world:
            raise RecipeError(f'{recipe.source}: train.{key}: {size} must be a multiple of the world size ({world})')
    eval_size = train.global_batch_size if train.eval_batch_size is None else train.eval_batch_size
    return train.global_batch_size // world, eval_size // world


def build_datasets(recipe: Recipe, data_path: Optional[str] = None):
    """The recipe's train and eval datasets (NHWC uint8 samples): ``data_path`` (or
    ``data.path``) as an ImageNet folder, the synthetic set when neither is given. Both follow
    ``data.on_corrupt``; a corrupt image's error names that key."""
    from channels_last_algo.app.datasets import DataPathError, imagenet_dataset

    data = recipe.data
    path = data_path if data_path is not None else data.path
    image_size = max(data.train_crop, data.eval_resize or data.eval_crop)
    hint = f'or set data.on_corrupt: skip in {recipe.source} (--set data.on_corrupt=skip) to skip corrupt files'
    common = dict(
        data_path=path,
        num_classes=recipe.model.num_classes,
        seed=recipe.train.seed,
        on_corrupt=data.on_corrupt,
        corrupt_hint=hint,
    )
    try:
        train = imagenet_dataset(
            'train',
            crop_size=data.train_crop,
            synthetic_samples=data.synthetic_train_samples,
            synthetic_image_size=image_size,
            **common,
        )
        val = imagenet_dataset(
            'val',
            crop_size=data.eval_crop,
            resize_size=data.eval_resize,
            synthetic_samples=data.synthetic_eval_samples,
            synthetic_image_size=image_size,
            **common,
        )
    except DataPathError as exc:
        key = 'data.path' if data_path is None else '--data'
        raise RecipeError(f'{recipe.source}: {key}: {exc}') from exc
    return train, val


def microbatch_size(recipe: Recipe, device: str, rank_batch: int) -> Union[int, str]:
    """The images of one forward and backward pass on each rank: ``train.device_train_microbatch_size``,
    whose ``'auto'`` is Composer's on a GPU and :data:`CPU_MICROBATCH` (at most ``rank_batch``) on the CPU.

    Example:
        >>> recipe = load_recipe('recipes/resnet50_imagenet.yaml')
        >>> microbatch_size(recipe, 'cpu', 2048), microbatch_size(recipe, 'cpu', 8), microbatch_size(recipe, 'gpu', 8)
        (32, 8, 'auto')
    """
    size = recipe.train.device_train_microbatch_size
    if size != 'auto':
        return size
    return 'auto' if device == 'gpu' else min(rank_batch, CPU_MICROBATCH)


def _error(recipe: Recipe):
    """The :class:`RecipeError` maker for ``recipe``: its message starts with the recipe file."""
    return lambda message: RecipeError(f'{recipe.source}: {message}')


def _training_set_name(recipe: Recipe, data_path: Optional[str]) -> str:
    """Where the training images come from, as the recipe or the command line said it."""
    if data_path is not None:
        return f'--data {data_path}'
    if recipe.data.path is not None:
        return f'data.path {recipe.data.path}'
    return 'data.synthetic_train_samples' if recipe.data.synthetic_train_samples else 'the synthetic ImageNet'


def _loaders(recipe: Recipe, data_path: Optional[str], device: str, batches: tuple[int, int]) -> tuple[Any, Any]:
    """The training DataSpec and the evaluator, for the rank's ``batches`` (training, evaluation); the
    evaluator splits its batches into microbatches as training does."""
    from composer.core import Evaluator

    from channels_last_algo.app.data import build_data_spec

    train_batch, eval_batch = batches
    train_data, eval_data = build_datasets(recipe, data_path)
    check_durations(recipe, len(train_data), _training_set_name(recipe, data_path), _error(recipe))
    options = dict(workers=recipe.data.workers, seed=recipe.train.seed)
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

    from channels_last_algo.app.checkpoints import RunCheckpoints
    from channels_last_algo.app.models import build_model

    reproducibility.seed_all(recipe.train.seed)
    classes = recipe.model.num_classes
    try:
        network = build_model(recipe.model.name, num_classes=classes)
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
    :mod:`~channels_last_algo.app.optimizers`, the algorithms, fp32 on CPU and
    ``train.gpu_precision`` on a GPU, microbatches of :func:`microbatch_size`, and atomic
    checkpoints in the recipe's save folder.

    A step that cannot fit the device's memory is refused first, before the folder is touched
    (:func:`~channels_last_algo.app.step_memory.check_step_memory`). The folder is then locked for
    the run (:class:`~channels_last_algo.app.run_folder.RunFolder`, on rank 0, released by
    ``trainer.close()`` or when the process ends); an earlier run's checkpoints there are refused
    unless ``resume`` (True: the newest readable one; a path: that one) or ``overwrite``.
    ``trainer_options`` go to the Trainer.
    """
    from composer import Trainer

    from channels_last_algo.app.optimizers import build_optimizer, build_scheduler
    from channels_last_algo.app.run_folder import RunFolder
    from channels_last_algo.app.step_memory import check_step_memory

    device, precision = device_and_precision(recipe)
    batches = _batch_sizes(recipe)
    check_step_memory(recipe, device, precision, batches)  # a step that cannot fit is refused before the folder
    run = RunFolder(recipe.save_folder())
    writer = int(os.environ.get('RANK', 0)) == 0  # only rank 0 writes checkpoints
    if writer:
        run.lock()
    try:
        max_duration = recipe.train.max_duration
        start = run.prepare(resume, overwrite, max_duration) if writer else run.resume_point(resume, max_duration)
        train_loader, evaluator = _loaders(recipe, data_path, device, batches)
        model, checkpoints = _model_and_checkpoints(recipe, run, start, writer)
        return Trainer(
            model=model,
            train_dataloader=train_loader,
            eval_dataloader=evaluator,
            optimizers=build_optimizer(recipe, model.parameters()),
            schedulers=build_scheduler(recipe),
            algorithms=build_algorithms(recipe),
            callbacks=[checkpoints, *trainer_options.pop('callbacks', [])],
            load_path=None if start is None else str(start),
            **_schedule_options(recipe, device, precision, batches[0]),
            **trainer_options,
        )
    except BaseException:
        run.unlock()
        raise
