"""What every ``channels-last`` command shares: :class:`UsageError`, the argparse types of its numbers,
and the check of a file it is asked to write.

Example:
    >>> positive_int('3'), count('0'), seconds('1.5')
    (3, 0, 1.5)
    >>> first_line(ValueError('no such model\\nmore'))
    'ValueError: no such model'
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

from channels_last_algo.core.argument_checks import why as first_line
from channels_last_algo.core.argument_checks import write_problem

__all__ = ['UsageError', 'check_writable', 'count', 'first_line', 'positive_int', 'seconds']


class UsageError(ValueError):
    """A command line that cannot run; the message names the argument at fault and the fix."""


def _integer_at_least(minimum: int, words: str) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum``, refused as ``'TEXT' is not WORDS``."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f'{text!r} is not {words}')
        return value

    return integer


positive_int = _integer_at_least(1, 'a positive integer')
"""argparse type: an int >= 1."""
count = _integer_at_least(0, 'an integer >= 0')
"""argparse type: an int >= 0."""


def seconds(text: str) -> float:
    """A finite number of seconds > 0, for argparse."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f'{text!r} is not a positive finite number of seconds')
    return value


def check_writable(path: str, what: str, suffix: str, inputs: Sequence[Optional[str]] = ()) -> None:
    """UsageError naming ``what`` (the argument) when the file ``path`` cannot be written, or writing it could
    destroy something: a link (the write would replace its target), a pipe or device, one of the command's
    ``inputs``, or an existing file that is no ``suffix`` file (a checkpoint, a recipe). Checked before any work."""
    target = Path(path)
    try:
        problem = write_problem(target, suffix, tuple(Path(p) for p in inputs if p))
    except OSError as error:  # a name too long, a loop of links
        problem = f'cannot be looked at ({error.strerror or error})'
    if problem:
        raise UsageError(f'{what} {path}: {problem}')
