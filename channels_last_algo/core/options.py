"""The options of a channels-last run, checked in one place.

:data:`OPTIONS` says what each option of :class:`~channels_last_algo.core.guard.LayoutGuard`
(and so of the trainer integrations built on it, and of a recipe's ``algorithms.channels_last``)
accepts; :func:`check_options` refuses the first invalid value with one message, so a string
where a bool belongs is refused instead of read as truthy.

Example:
    >>> check_options(mode='auto', strict=False)
    >>> check_options(strict='no')
    Traceback (most recent call last):
    ...
    ValueError: strict must be True or False, got 'no'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from channels_last_algo.core.inputs import check_inputs
from channels_last_algo.core.weight_layout import WEIGHTS

__all__ = ['MODES', 'OPTIONS', 'check_options']

MODES = ('on', 'off', 'auto')


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


# The options of LayoutGuard and of every trainer integration built on it: name -> (valid, what is expected).
OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    'mode': (lambda value: isinstance(value, str) and value in MODES, f'one of {", ".join(repr(m) for m in MODES)}'),
    'audit_steps': (
        lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0,
        'an int >= 0 (0 turns the audit off)',
    ),
    'strict': (_is_bool, 'True or False'),
    'repair': (_is_bool, 'True or False'),
    'fuse_eval': (_is_bool, 'True or False'),
    'weights': (lambda value: value in WEIGHTS, f'one of {", ".join(repr(w) for w in WEIGHTS)}'),
    'inputs': (
        check_inputs,
        "'auto' (the batch tensors fed to a convolution), 'all', a list of batch keys / positions, or a predicate",
    ),
}


def check_options(table: Mapping[str, tuple[Callable[[Any], bool], str]] = OPTIONS, /, **options: Any) -> None:
    """Raise ``ValueError`` naming the first of ``options`` whose value ``table`` (:data:`OPTIONS`
    by default; an integration passes its own for the options only it has) calls invalid.

    Example:
        >>> check_options({'network': (lambda value: isinstance(value, str), 'a str')}, network=1)
        Traceback (most recent call last):
        ...
        ValueError: network must be a str, got 1
    """
    for name, value in options.items():
        valid, expected = table[name]
        if not valid(value):
            raise ValueError(f'{name} must be {expected}, got {value!r}')
