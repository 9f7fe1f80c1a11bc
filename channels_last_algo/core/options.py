"""The options of a channels-last run, declared once.

:data:`OPTIONS` holds each option of :class:`~channels_last_algo.core.guard.LayoutGuard`, in the
order of its keyword-only signature, which the Composer algorithm, the Lightning callback and a
recipe's ``algorithms.channels_last`` share: its default, what it accepts and what it means.
``fuse_eval`` is theirs only (:data:`INTEGRATION_ONLY`): it adds the fused-evaluation object.
:func:`check_options` refuses the first invalid value with one message (a string where a bool
belongs is refused, not read as truthy), :func:`options_repr` writes the call that rebuilds an
object, and :func:`options_reference` writes ``docs/options.md``.

Example:
    >>> check_options(mode='auto', strict=False)
    >>> check_options(strict='no')
    Traceback (most recent call last):
    ...
    ValueError: strict must be True or False, got 'no'
    >>> OPTIONS['weights'].default
    'auto'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from channels_last_algo.core.inputs import check_inputs
from channels_last_algo.core.weight_layout import WEIGHTS

__all__ = ['INTEGRATION_ONLY', 'MODES', 'OPTIONS', 'Option', 'check_options', 'options_reference', 'options_repr']

MODES = ('on', 'off', 'auto')


@dataclasses.dataclass(frozen=True)
class Option:
    """One option: its default, its check, what the check accepts (for messages) and what it means."""

    default: Any
    valid: Callable[[Any], bool]
    accepts: str
    meaning: str


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _one_of(choices: tuple[str, ...]) -> tuple[Callable[[Any], bool], str]:
    return (lambda value: isinstance(value, str) and value in choices), f'one of {", ".join(map(repr, choices))}'


OPTIONS: dict[str, Option] = {
    'mode': Option(
        'on',
        *_one_of(MODES),
        "'on': NHWC; 'off': nothing is done; 'auto': time both layouts on the first batch, keep the faster",
    ),
    'audit_steps': Option(
        0,
        lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0,
        'an int >= 0 (0 turns the audit off)',
        'audit this many first training steps for ops that drop NHWC (shown after them)',
    ),
    'strict': Option(False, _is_bool, 'True or False', 'stop with LayoutBreakError at the first audited layout break'),
    'repair': Option(True, _is_bool, 'True or False', 'swap the layers that drop NHWC for ones that keep it'),
    'inputs': Option(
        'auto',
        check_inputs,
        "'auto' (the batch tensors fed to a convolution), 'all', a list of batch keys / positions, or a predicate",
        'which 4D/5D batch tensors go NHWC',
    ),
    'weights': Option(
        'auto',
        *_one_of(WEIGHTS),
        "'auto': channels-last weights unless sharding or an optimizer that flattens them needs them "
        "contiguous; 'contiguous': contiguous weights, NHWC activations",
    ),
    'fuse_eval': Option(
        False,
        _is_bool,
        'True or False',
        'evaluate on a fused copy (BatchNorm folded, convolutions fused): adds FusedEval or FusedEvalCallback',
    ),
}

# The options of the integrations only: each adds a second object beside the guard.
INTEGRATION_ONLY = ('fuse_eval',)

# Always shown by options_repr; the others only where they differ from their default.
_SHOWN = ('mode', 'audit_steps', 'strict')


def check_options(table: Mapping[str, Option] = OPTIONS, /, **options: Any) -> None:
    """Raise ``ValueError`` naming the first of ``options`` whose value ``table`` (:data:`OPTIONS`
    by default; an integration passes its own for the options only it has) calls invalid.

    Example:
        >>> check_options({'network': Option(None, lambda value: isinstance(value, str), 'a str', '')}, network=1)
        Traceback (most recent call last):
        ...
        ValueError: network must be a str, got 1
    """
    for name, value in options.items():
        if not table[name].valid(value):
            raise ValueError(f'{name} must be {table[name].accepts}, got {value!r}')


def options_repr(owner: str, options: Mapping[str, Any]) -> str:
    """The call that rebuilds ``owner`` with ``options``: mode, audit_steps and strict, then the
    options that differ from their default, in :data:`OPTIONS` order.

    Example:
        >>> options_repr('ChannelsLast', {'mode': 'auto', 'audit_steps': 0, 'strict': False, 'repair': False})
        "ChannelsLast(mode='auto', audit_steps=0, strict=False, repair=False)"
    """
    shown = [
        f'{name}={_shown(options[name])}'
        for name in OPTIONS
        if name in options and (name in _SHOWN or options[name] != OPTIONS[name].default)
    ]
    return f'{owner}({", ".join(shown)})'


def _shown(value: Any) -> str:
    """A value as the call writes it; a predicate by its name."""
    return getattr(value, '__name__', 'predicate') if callable(value) else repr(value)


def options_reference() -> str:
    """``docs/options.md``: every option with its default, what it accepts and what it means."""
    rows = [
        f'| `{name}` | `{option.default!r}` | {option.accepts} | {option.meaning} |' for name, option in OPTIONS.items()
    ]
    return (
        '# Options\n\n'
        'Generated from `channels_last_algo/core/options.py` (`OPTIONS`); do not edit by hand.\n\n'
        'The same keyword-only options in `LayoutGuard`, `ChannelsLast` (Composer), `ChannelsLastCallback`\n'
        "(Lightning) and a recipe's `algorithms.channels_last`, in this order.\n\n"
        '| option | default | accepts | meaning |\n|---|---|---|---|\n' + '\n'.join(rows) + '\n'
    )
