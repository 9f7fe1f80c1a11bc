"""The recipe's algorithms: their registry by snake name, the check of every option, and building them.

``channels_last`` is this project's :class:`~channels_last_algo.ChannelsLast`, checked by the core's own
option check; Composer's built-in algorithms go by the names of their packages (``blurpool``, ``ema``,
``label_smoothing``, ..., and ``composer_channels_last`` for Composer's own ChannelsLast) and are checked
against their signatures, the range table (:mod:`~channels_last_algo.app.recipes.algorithm_ranges`) and
by constructing them, where Composer is installed.

Example::

    algorithm_registry()['blurpool']          # composer.algorithms.BlurPool
    build_algorithms(load_recipe('recipes/resnet50_imagenet.yaml'))   # [..., ChannelsLast(...)], channels_last last
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
import typing
from typing import Any, Optional, Union

from channels_last_algo.app.recipes.algorithm_ranges import (
    NOT_ON_THIS_DATA_PATH,
    algorithm_cross_problem,
    algorithm_option_problem,
)
from channels_last_algo.app.recipes.schema import Recipe, RecipeError
from channels_last_algo.app.recipes.value_rules import closest, parse_time, type_problem
from channels_last_algo.core.options import OPTIONS

__all__ = ['algorithm_registry', 'build_algorithms', 'check_algorithms']

# What a constructor raises for a bad option, or for one it cannot run with here (Composer's extras, as
# MissingConditionalImportError); each becomes the one line naming the option.
_ERRORS = (ValueError, TypeError, AssertionError, NotImplementedError, KeyError, ArithmeticError, ImportError)


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
        if not OPTIONS[key].valid(value):
            raise error(f'{where}.{key}: expected {OPTIONS[key].accepts}, got {type(value).__name__} {value!r}')


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


def check_algorithms(recipe: Recipe, error) -> None:
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
