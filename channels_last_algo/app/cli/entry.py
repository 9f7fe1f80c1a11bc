"""The ``channels-last`` command: its parser with every subcommand, and its entry point.

Example:
    $ channels-last --version
    $ channels-last demo --steps 5
    $ channels-last train recipes/resnet50_imagenet.yaml --smoke
    $ channels-last train --help-keys
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from channels_last_algo import __version__
from channels_last_algo.app.cli.demo_command import add_demo
from channels_last_algo.app.cli.export_command import add_export
from channels_last_algo.app.cli.model_commands import add_audit, add_doctor
from channels_last_algo.app.cli.recipe_commands import add_compare, add_train
from channels_last_algo.app.cli.shared_arguments import UsageError, first_line
from channels_last_algo.app.recipes.schema import RecipeError
from channels_last_algo.app.runs.checkpoint_files import RunFolderError
from channels_last_algo.app.runs.train import RunError, failure_place, write_traceback

__all__ = ['build_parser', 'main']


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog='channels-last',
        description='Train conv nets in channels-last (NHWC) memory format, and check that they stay there.',
    )
    parser.add_argument('--version', action='version', version=f'%(prog)s {__version__}')
    subparsers = parser.add_subparsers(title='commands', metavar='COMMAND', dest='command')
    add_demo(subparsers)
    add_audit(subparsers)
    add_train(subparsers)
    add_compare(subparsers)
    add_export(subparsers)
    add_doctor(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``channels-last`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, 'run'):
        parser.print_help()
        return 0
    try:
        return args.run(args)
    except (UsageError, RecipeError, RunFolderError, RunError) as error:
        print(f'channels-last {args.command}: error: {error}', file=sys.stderr)
        return 2
    except Exception as error:  # anything else: still one line, the traceback kept in a file
        print(f'channels-last {args.command}: error: {_unexpected(error)}', file=sys.stderr)
        return 2


def _unexpected(error: Exception) -> str:
    """An error no check foresaw, in one line: what, where, and the file with its traceback."""
    where = failure_place(error)
    return f'{first_line(error)} (in {where}); {write_traceback(error, Path(tempfile.gettempdir()))}'


if __name__ == '__main__':
    sys.exit(main())
