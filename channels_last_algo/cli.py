"""The ``channels-last`` command.

Example:
    $ channels-last --version
    $ channels-last demo --steps 5
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from channels_last_algo import __version__

__all__ = ['main']


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        'demo',
        help='train a small conv net with and without ChannelsLast; print layouts and step times',
    )
    parser.add_argument('--steps', type=int, default=20, help='timed training steps per variant')
    parser.add_argument('--batch-size', type=int, default=32)
    parser.add_argument('--image-size', type=int, default=64)
    parser.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from channels_last_algo.demo import run_demo

    run_demo(steps=args.steps, batch_size=args.batch_size, image_size=args.image_size)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog='channels-last',
        description='Train conv nets in channels-last (NHWC) memory format, and check that they stay there.',
    )
    parser.add_argument('--version', action='version', version=f'%(prog)s {__version__}')
    subparsers = parser.add_subparsers(title='commands', metavar='COMMAND')
    _add_demo(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``channels-last`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, 'run'):
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == '__main__':
    sys.exit(main())
