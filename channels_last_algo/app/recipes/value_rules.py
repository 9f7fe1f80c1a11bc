"""The rules a recipe value must satisfy: its type, a range, a set of choices, a time string's units,
a format string's placeholders; each a function from the value to the problem with it (``None`` when
it is valid) that also says what it accepts (``rule.expected``, which the key reference prints).

The schema (:mod:`~channels_last_algo.app.recipes.schema`) gives each key one rule, and the table of
Composer's algorithm options (:mod:`~channels_last_algo.app.recipes.algorithm_ranges`) one per option.
Nothing here needs Composer or torch: time strings such as ``'36ep'`` are parsed by :func:`parse_time`.

Example:
    >>> between(0, 1)(1.5)
    '1.5 is out of range; expected a finite number >= 0 and <= 1'
    >>> time_string('ep ba').expected
    "a positive time in epochs, batches, such as '36ep' or '100ba'"
    >>> parse_time('36ep'), parse_time('0.5dur')
    ((36, 'ep'), (0.5, 'dur'))
    >>> type_problem('1e-3', float)
    "expected float, got str '1e-3'; YAML reads 1e-3 as text: write 1.0e-3"
"""

from __future__ import annotations

import difflib
import math
import re
import string
import typing
from collections.abc import Callable
from typing import Any, Optional, Union

import yaml

__all__ = [
    'TIME_UNITS',
    'Rule',
    'between',
    'choices',
    'closest',
    'count_or',
    'described',
    'file_name',
    'parse_time',
    'path_text',
    'placeholders',
    'shown',
    'time_string',
    'type_problem',
]

Rule = Callable[[Any], Optional[str]]  # the problem with a value ('... expected ...'), or None when it is valid

_TIME = re.compile(r'^([0-9]*\.?[0-9]+(?:e[0-9]+)?)(ep|ba|sp|tok|dur|iter)$')
TIME_UNITS = {'ep': 'epochs', 'ba': 'batches', 'sp': 'samples', 'dur': 'a fraction of the whole run'}


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


def described(expected: str, problem: Rule) -> Rule:
    """``problem`` with the text of what it accepts (``rule.expected``), which the key reference prints."""
    problem.expected = expected  # type: ignore[attr-defined]
    return problem


def _number(bound: float) -> str:
    """A bound as written: ``4294967295``, ``0.5``."""
    return str(int(bound)) if bound == int(bound) else f'{bound:g}'


def between(low: float, high: float = math.inf, *, open_low: bool = False, open_high: bool = False) -> Rule:
    """A finite number in a range (``open_*``: the bound itself excluded)."""
    above = f'> {_number(low)}' if open_low else f'>= {_number(low)}'
    below = '' if high == math.inf else (f' and < {_number(high)}' if open_high else f' and <= {_number(high)}')

    def rule(value: float) -> Optional[str]:
        inside = (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
        if (isinstance(value, int) or math.isfinite(value)) and inside:  # math.isfinite overflows on 10**400
            return None
        kind = 'a finite number' if isinstance(value, float) else 'an integer'
        return f'{shown(value)} is out of range; expected {kind} {above}{below}'

    return described(above + below, rule)


def shown(value: Any) -> str:
    """``repr(value)``, but an integer too long to print whole (Python refuses over 4300 digits) by its size.

    Example:
        >>> shown(12), shown(10**5000)
        ('12', 'an integer of 5001 digits')
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        digits = len(str(abs(value))) if value.bit_length() < 14000 else _digits(value)
        return f'{"a negative" if value < 0 else "an"} integer of {digits} digits'
    return repr(value)


def _digits(value: int) -> int:
    """The decimal digits of ``|value|``, for integers too long to turn into text."""
    digits = int(abs(value).bit_length() * math.log10(2))
    return digits + (abs(value) >= 10**digits)


def choices(*options: str) -> Rule:
    expected = f'one of {", ".join(options)}'
    return described(expected, lambda value: None if value in options else f'{value!r} is not {expected}')


def count_or(special: Any, meaning: str) -> Rule:
    """An integer >= 1, or ``special`` (meaning ``meaning``)."""
    expected = f'{special!r} ({meaning}) or an integer >= 1'

    def rule(value: Any) -> Optional[str]:
        if value == special or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return None
        return f'{shown(value)} is {"out of range" if isinstance(value, int) else "not valid"}; expected {expected}'

    return described(expected, rule)


def time_string(units: str, allow_zero: bool = False) -> Rule:
    """A time string in one of ``units`` (e.g. ``'ep ba'``), positive (or zero if allowed); a
    ``dur`` fraction is at most 1."""
    allowed = units.split()
    examples = {'ep': '36ep', 'ba': '100ba', 'sp': '50000sp', 'dur': '0.1dur'}
    expected = (
        f'a {"non-negative" if allow_zero else "positive"} time in '
        f'{", ".join(TIME_UNITS[u] for u in allowed)}, '
        f'such as {" or ".join(repr(examples[u]) for u in allowed)}'
    )

    def rule(value: str) -> Optional[str]:
        try:
            amount, unit = parse_time(value)
        except ValueError as error:
            return f'{error}; expected {expected}'
        if unit not in allowed:
            return f'{value!r} is in a unit this key does not take; expected {expected}'
        if amount < 0 or (amount == 0 and not allow_zero) or (unit == 'dur' and amount > 1):
            return f'{value!r} is out of range; expected {expected}'
        return None

    return described(expected, rule)


def placeholders(*names: str) -> Rule:
    """A ``str.format`` string whose only placeholders are ``names``."""
    allowed = ', '.join('{' + name + '}' for name in names)

    def rule(value: str) -> Optional[str]:
        if '\0' in value:
            return f'{value!r} holds a NUL byte, which no path can'
        try:
            parts = [(field, spec, conversion) for _, field, spec, conversion in string.Formatter().parse(value)]
        except ValueError as error:
            return f'{value!r} is not a valid format string ({error}); write braces only as {allowed}'
        fields = [field for field, _, _ in parts if field is not None]
        unknown = [field for field in fields if field not in names]
        if unknown:
            return f'{value!r} has the unknown placeholder {{{unknown[0]}}}; the only placeholder is {allowed}'
        if any(field is not None and (spec or conversion) for field, spec, conversion in parts):
            return f'{value!r} formats a placeholder (a : or ! inside braces); write it as {allowed}'
        return None

    return described(f'a path; the only placeholder is {allowed}', rule)


def path_text(value: str) -> Optional[str]:
    """A path: any text but a NUL byte, which no file system takes."""
    return f'{value!r} holds a NUL byte, which no path can' if '\0' in value else None


described('a path', path_text)


def file_name(value: str) -> Optional[str]:
    if re.fullmatch(r'[A-Za-z0-9._-]{1,200}', value) and value not in ('.', '..'):
        return None
    return f'{value!r} cannot name a run folder; use letters, digits, dots, dashes and underscores'


described('a folder name: letters, digits, dots, dashes and underscores', file_name)


def closest(key: str, options: list[str]) -> str:
    """``'; did you mean ...'`` for the option closest to ``key``, or the list of valid options."""
    close = difflib.get_close_matches(str(key), [str(option) for option in options], n=1)
    return f"; did you mean '{close[0]}'?" if close else f'; valid keys: {", ".join(options)}'


def type_problem(value: Any, annotation: Any) -> Optional[str]:
    """What is wrong with the type of ``value`` for ``annotation`` (a type, or a Union of types), or None.

    Example:
        >>> type_problem(2, Union[int, str]), type_problem(1.5, Union[int, str])
        (None, 'expected int or str, got float 1.5')
    """
    options = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    for option in options:
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None
        if isinstance(value, option) and not (option is int and isinstance(value, bool)):
            return None
    expected = f'expected {" or ".join(option.__name__ for option in options)}, got {type(value).__name__} {value!r}'
    return expected + _number_as_text_hint(value, options)


def _number_as_text_hint(value: Any, options: list[Any]) -> str:
    """Why YAML read a number as text, and how to write it: YAML 1.1 takes ``1e-3`` and ``1.0e3`` as strings
    (a float needs a dot and a signed exponent, ``1.0e-3``); '' when ``value`` is no such text.

    Example:
        >>> _number_as_text_hint('1e-3', [float]), _number_as_text_hint('1e3', [int])
        ('; YAML reads 1e-3 as text: write 1.0e-3', '; YAML reads 1e3 as text: write 1000')
    """
    if not isinstance(value, str) or not ({int, float} & set(options)):
        return ''
    try:
        number = float(value)
    except ValueError:
        return ''
    if not math.isfinite(number) or (float not in options and number != int(number)):
        return ''
    if not isinstance(yaml.safe_load(value), str):
        return f'; it is quoted: write {value} without quotes'
    if float not in options:
        written = str(int(number))
    else:
        mantissa, exponent = f'{number:e}'.split('e')
        mantissa = mantissa.rstrip('0') + ('0' if mantissa.rstrip('0').endswith('.') else '')
        written = mantissa + (f'e{int(exponent):+d}' if int(exponent) else '')
    return f'; YAML reads {value} as text: write {written}'
