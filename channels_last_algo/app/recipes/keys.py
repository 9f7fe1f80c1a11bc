"""The reference of every recipe key, made from the schema's own fields, rules and meanings.

``channels-last train --help-keys`` prints :func:`recipe_keys_reference`, and
``docs/recipe_keys.md`` is its output (a test regenerates and compares it), so the reference
cannot drift from what :mod:`~channels_last_algo.app.recipes.schema` checks.

Example:
    >>> schema_keys()[:3]
    ['name', 'model.name', 'model.num_classes']
    >>> print(recipe_keys_reference().split('## train')[1].splitlines()[2])
    - `train.max_duration`: how long to train
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from channels_last_algo.app.recipes.algorithm_ranges import ALGORITHM_RANGES
from channels_last_algo.app.recipes.loading import SMOKE_OVERRIDES
from channels_last_algo.app.recipes.schema import Recipe
from channels_last_algo.app.recipes.value_rules import TIME_UNITS
from channels_last_algo.core.options import OPTIONS

__all__ = ['recipe_keys_reference', 'schema_keys']

_HEADER = """# Recipe keys

Every key of a recipe (`recipes/resnet50_imagenet.yaml`), made from the schema that checks it
(`channels_last_algo/app/recipes/schema.py`). `channels-last train --help-keys` prints this page;
regenerate it with `channels-last train --help-keys > docs/recipe_keys.md` (`tests/app/test_recipe_keys.py`
fails when it is out of date). A key's default is its value when a recipe leaves it out. Set any
key on the command line with `--set KEY=VALUE`, the value read as YAML (`0.1`, `true`, `null`, `[1, 2]`).
Time strings: {units}."""


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if not f.metadata.get('internal')]


def _yaml(value: Any) -> str:
    """A default as a recipe would write it: ``None`` -> ``null``, ``True`` -> ``true``."""
    if value is None or isinstance(value, bool):
        return {None: 'null', True: 'true', False: 'false'}[value]
    return str(value)


def _type_name(annotation: Any) -> str:
    """``Optional[int]`` -> ``'int or null'``, ``dict[str, Any]`` -> ``'mapping'``."""
    if typing.get_origin(annotation) is dict:
        return 'mapping'
    options = typing.get_args(annotation) or (annotation,)
    return ' or '.join('null' if option is type(None) else option.__name__ for option in options)


def _entry(path: str, meaning: str, details: list[str]) -> str:
    return f'- `{path}`: {meaning}\n  ' + '; '.join(details)


def _field_entry(field: dataclasses.Field, annotation: Any, path: str) -> str:
    """One key's entry: its meaning, type, default and what its rule accepts."""
    default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
    details = [_type_name(annotation), 'required' if default is dataclasses.MISSING else f'default: `{_yaml(default)}`']
    expected = getattr(field.metadata.get('rule'), 'expected', None)
    return _entry(path, field.metadata['doc'], details + ([f'accepts: {expected}'] if expected else []))


def _section(field: dataclasses.Field, annotation: Any) -> str:
    """The reference of one top-level key: a section's keys, or the key itself (with channels_last's options)."""
    if dataclasses.is_dataclass(annotation):
        hints = typing.get_type_hints(annotation)
        entries = [_field_entry(f, hints[f.name], f'{field.name}.{f.name}') for f in _fields(annotation)]
        return f'## {field.name}: {field.metadata["doc"]}\n\n' + '\n'.join(entries)
    entries = [_field_entry(field, annotation, field.name)]
    if field.name == 'algorithms':
        entries += [
            _entry(
                f'algorithms.channels_last.{name}',
                option.meaning,
                [f'default: `{_yaml(option.default)}`', f'accepts: {option.accepts}'],
            )
            for name, option in OPTIONS.items()
        ]
    return f'## {field.name}\n\n' + '\n'.join(entries)


def schema_keys() -> list[str]:
    """Every key path the schema checks, in schema order (sections themselves left out, ``algorithms`` in)."""
    hints = typing.get_type_hints(Recipe)
    keys = []
    for field in _fields(Recipe):
        section = hints[field.name]
        if dataclasses.is_dataclass(section):
            keys += [f'{field.name}.{f.name}' for f in _fields(section)]
        else:
            keys.append(field.name)
    return keys


def _algorithm_ranges() -> str:
    """Each Composer algorithm option's valid values (:data:`.algorithm_ranges.ALGORITHM_RANGES`)."""
    lines = [
        '## Composer algorithm options\n\nBeyond its type (from the constructor), each option of a Composer '
        'algorithm is checked against its valid values:\n'
    ]
    for name, options in ALGORITHM_RANGES.items():
        ranges = '; '.join(f'`{option}` {rule.expected}' for option, rule in options.items())
        lines.append(f'- `algorithms.{name}`: {ranges or "no option with a range"}')
    return '\n'.join(lines)


def recipe_keys_reference() -> str:
    """The Markdown reference of every recipe key (what ``--help-keys`` prints and ``docs/recipe_keys.md`` holds)."""
    units = ', '.join(f'`{unit}` ({meaning})' for unit, meaning in TIME_UNITS.items())
    hints = typing.get_type_hints(Recipe)
    parts = [_HEADER.format(units=units), *(_section(field, hints[field.name]) for field in _fields(Recipe))]
    parts.append(_algorithm_ranges())
    smoke = '\n'.join(f'- `{override}`' for override in SMOKE_OVERRIDES)
    parts.append(
        '## --smoke\n\n`channels-last train --smoke` and `channels-last compare --smoke` apply these '
        'overrides before any `--set` (which wins), for a run of a minute or two that checks the recipe '
        'works here (with `--data`, 4 batches of the real images and one evaluation batch):'
        f'\n\n{smoke}'
    )
    return '\n\n'.join(parts) + '\n'
