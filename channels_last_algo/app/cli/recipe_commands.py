"""The commands on a recipe: ``train`` (Composer's Trainer, checkpoints in a locked run folder) and
``compare`` (the recipe's steps timed with channels last off, Composer's and this project's).

Example::

    $ channels-last train recipes/resnet50_imagenet.yaml --smoke
    $ channels-last compare recipes/resnet50_imagenet.yaml --batches 8 --json compare.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from channels_last_algo.app.cli.shared_arguments import UsageError, check_writable, count, positive_int
from channels_last_algo.app.recipes.keys import recipe_keys_reference
from channels_last_algo.app.recipes.loading import SMOKE_OVERRIDES, load_recipe
from channels_last_algo.app.runs.compare import compare_recipe, format_comparison
from channels_last_algo.app.runs.train import train_recipe
from channels_last_algo.integrations import require

__all__ = ['add_compare', 'add_train', 'require_composer']


def _add_recipe_arguments(parser: argparse.ArgumentParser, smoke: str) -> None:
    """RECIPE, --data, --set, and --smoke, whose help ends with ``smoke``."""
    parser.add_argument('recipe', metavar='RECIPE', help='a YAML recipe, e.g. recipes/resnet50_imagenet.yaml')
    parser.add_argument(
        '--data',
        metavar='PATH',
        help='an ImageNet folder with train/ and val/ (default: the '
        "recipe's data.path, else the embedded synthetic ImageNet)",
    )
    parser.add_argument(
        '--set',
        dest='overrides',
        action='append',
        default=[],
        metavar='KEY=VALUE',
        help='override a recipe key, e.g. --set optimizer.lr=0.1 (repeatable; VALUE is YAML; '
        'every key: channels-last train --help-keys)',
    )
    parser.add_argument(
        '--smoke',
        action='store_true',
        help='shrink the recipe to check that it runs here in a minute or two (2 CPU cores): 4 batches of 16, '
        f'64 synthetic training and 16 evaluation images; {smoke}. Applied before --set, which wins '
        '(the overrides: channels-last train --help-keys)',
    )


def require_composer() -> None:
    """UsageError with the install command when Composer, which runs the recipes, is not installed."""
    try:
        require('composer', 'composer')
    except ImportError as error:
        raise UsageError(str(error)) from None


def _load(args: argparse.Namespace):
    """The recipe of RECIPE with the --smoke overrides (if asked) and then --set's, checked (which needs no
    Composer), then Composer there to run it."""
    recipe = load_recipe(args.recipe, [*(SMOKE_OVERRIDES if args.smoke else ()), *args.overrides])
    require_composer()
    return recipe


class _PrintRecipeKeys(argparse.Action):
    """``--help-keys``: print every recipe key (the reference docs/recipe_keys.md holds) and exit."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(recipe_keys_reference(), end='')
        parser.exit()


def add_train(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        'train',
        help="train a recipe with Composer's Trainer",
        description='Train RECIPE with Composer, saving checkpoints atomically to its '
        'train.save_folder, which the run locks. A folder that holds the checkpoints of an '
        'earlier run is refused unless --resume continues them or --overwrite replaces '
        'them. The final evaluation metrics are printed at the end.',
    )
    _add_recipe_arguments(parser, smoke='one evaluation batch and one checkpoint, in runs/NAME-smoke')
    parser.add_argument(
        '--help-keys',
        action=_PrintRecipeKeys,
        help='print every recipe key with its type, default, accepted values and meaning, and exit',
    )
    parser.add_argument(
        '--resume',
        nargs='?',
        const=True,
        default=False,
        metavar='CHECKPOINT',
        help='continue from the newest readable checkpoint in the save folder, or from CHECKPOINT',
    )
    parser.add_argument(
        '--overwrite',
        action='store_true',
        help='delete the checkpoints of an earlier run in the save folder instead of refusing it',
    )
    parser.add_argument(
        '--check-data',
        action='store_true',
        help='decode every image of train/ and val/ once before training (JPEGs at 1/8 scale) and '
        'stop on a corrupt one unless data.on_corrupt is skip',
    )
    parser.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    recipe = _load(args)
    result = train_recipe(
        recipe, data_path=args.data, resume=args.resume, overwrite=args.overwrite, check_data=args.check_data
    )
    if result.metrics:
        print(f'channels-last train: evaluation at the end ({result.end}):\n{result.format_metrics()}')
    print(f'channels-last train: done; checkpoints in {recipe.save_folder()}')
    return 0


def add_compare(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        'compare',
        help="time a recipe's training steps with channels last off, on, and Composer's",
        description="Train RECIPE's model on its data with channels last off (NCHW), with Composer's "
        'ChannelsLast and with this project, interleaved step by step after warm-up; print images/s, '
        'speedups with their 95% intervals (a tie where one holds 1.0) and the layout audit of each.',
    )
    _add_recipe_arguments(parser, smoke='--batches 3 --warmup 1 unless given')
    parser.add_argument(
        '--batches',
        type=positive_int,
        help='timed training steps per variant (default 10; 3 with --smoke; 6 or more give the speedups an '
        'interval, and more steps a narrower one)',
    )
    parser.add_argument('--warmup', type=count, help='untimed steps per variant first (default 2; 1 with --smoke)')
    parser.add_argument('--json', metavar='FILE', help='also write the results as JSON to FILE')
    parser.set_defaults(run=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    if args.json:
        check_writable(args.json, '--json', '.json', [args.recipe])
    recipe = _load(args)
    batches = args.batches if args.batches is not None else (3 if args.smoke else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    result = compare_recipe(recipe, batches=batches, warmup=warmup, data_path=args.data)
    print(format_comparison(result))
    if args.json:
        with open(args.json, 'w') as file:
            json.dump(result, file, indent=2)
    return 0
