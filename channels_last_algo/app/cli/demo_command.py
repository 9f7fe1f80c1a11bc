"""``channels-last demo``: a small conv net trained with and without channels last, layouts and step times.

Example::

    $ channels-last demo --steps 20 --batch-size 32 --image-size 64
"""

from __future__ import annotations

import argparse
import sys

from channels_last_algo.app.cli.model_arguments import check_fits
from channels_last_algo.app.cli.shared_arguments import positive_int
from channels_last_algo.app.runs.demo import run_demo

__all__ = ['add_demo']


def add_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        'demo',
        help='train a small conv net with and without ChannelsLast; print layouts and step times',
    )
    parser.add_argument(
        '--steps',
        type=positive_int,
        default=20,
        help='timed training steps per variant (default 20; 6 or more give the speedup an interval)',
    )
    parser.add_argument('--batch-size', type=positive_int, default=32, help='images per training step (default 32)')
    parser.add_argument(
        '--image-size', type=positive_int, default=64, help='input height and width in px, >= 2 (default 64)'
    )
    parser.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    shape = (args.batch_size, 3, args.image_size, args.image_size)
    check_fits(
        'channels_last_algo.app.runs.demo:TinyResNet', shape, True, f'--batch-size {shape[0]} --image-size {shape[2]}'
    )
    try:
        run_demo(steps=args.steps, batch_size=args.batch_size, image_size=args.image_size)
    except ValueError as error:
        print(f'channels-last demo: error: {error}', file=sys.stderr)
        return 2
    return 0
