"""The options every benchmark shares, declared once: timed rounds, warm-up, torch threads, the
results folder and the results' file name. Each script gives its own defaults, help and, where
its command line names them otherwise (``--repeats``, ``--steps``, ``--threads-per-rank``), flags.

Example:
    >>> parser = benchmark_parser('A benchmark.', rounds=Option(9, 'timed rounds'), warmup=Option(1), out='results')
    >>> args = parser.parse_args(['--rounds', '3'])
    >>> args.rounds, args.warmup, args.out
    (3, 1, None)
    >>> benchmark_parser('A.', rounds=Option(7, flag='--repeats'), out='results').parse_args([]).repeats
    7
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Optional

__all__ = ['Option', 'benchmark_parser', 'parse_step_args']


@dataclasses.dataclass(frozen=True)
class Option:
    """A shared option as one script has it: its default, its help, and its flag if not the usual."""

    default: Any
    help: Optional[str] = None
    flag: Optional[str] = None


def _parser(doc: str, epilog: bool) -> argparse.ArgumentParser:
    """The description is the first paragraph of ``doc``; with ``epilog``, the rest follows the options."""
    description, _, rest = doc.partition('\n\n')
    if not (epilog and rest):
        return argparse.ArgumentParser(description=description)
    return argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=rest
    )


def benchmark_parser(
    doc: str,
    *,
    out: str,
    rounds: Optional[Option] = None,
    warmup: Optional[Option] = None,
    threads: Optional[Option] = None,
    name: Optional[Option] = None,
    epilog: bool = True,
) -> argparse.ArgumentParser:
    """A parser for the script documented by ``doc`` with the shared options it takes: ``--rounds``,
    ``--warmup``, ``--threads`` (integers) and ``--name`` where given, and ``--out`` (a folder,
    help ``out``); the script adds its own options after."""
    parser = _parser(doc, epilog)
    for usual, option in (('--rounds', rounds), ('--warmup', warmup), ('--threads', threads)):
        if option is not None:
            parser.add_argument(option.flag or usual, type=int, default=option.default, help=option.help)
    parser.add_argument('--out', type=Path, help=out)
    if name is not None:
        parser.add_argument('--name', default=name.default, help=name.help)
    return parser


def parse_step_args(
    doc: str,
    argv: Optional[list[str]],
    name: str,
    models: tuple,
    default: list,
    *,
    rounds: int,
    warmup: int,
    image_size: Optional[int] = None,
    image_size_help: str = '',
    min_image_size: int = 1,
) -> argparse.Namespace:
    """The command line of a benchmark that times training steps of models, parsed and checked: the shared options
    (``--out``: the folder for ``name``.json and .md), ``--models`` (of ``models``, ``default`` where none is named),
    ``--batch-size`` (8) and ``--image-size`` (``image_size``; None: each model's own, as ``image_size_help`` says).
    Values that cannot be run stop with the parser's usage.

    Example:
        >>> args = parse_step_args('A.', ['--batch-size', '4'], 'a', ('a', 'b'), ['a'], rounds=3, warmup=1)
        >>> args.models, args.batch_size, args.image_size, args.rounds
        (['a'], 4, None, 3)
    """
    parser = benchmark_parser(
        doc, warmup=Option(warmup), rounds=Option(rounds), out=f'folder for {name}.json and .md', epilog=False
    )
    parser.add_argument('--models', nargs='+', default=default, choices=models, metavar='MODEL')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--image-size', type=int, default=image_size, help=image_size_help or None)
    args = parser.parse_args(argv)
    size = args.image_size if args.image_size is not None else min_image_size
    if args.rounds < 1 or args.warmup < 0 or args.batch_size < 2 or size < min_image_size:
        parser.error(
            f'need --rounds >= 1, --warmup >= 0, --batch-size >= 2 (BatchNorm) and --image-size >= {min_image_size}'
        )
    return args
