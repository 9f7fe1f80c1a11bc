"""``channels-last export``: a model (or the network a recipe trained) fused for NHWC inference and saved
with ``torch.export``.

Example::

    $ channels-last export resnet50 resnet50.pt2 --weights resnet50.pt
    $ channels-last export --recipe recipes/resnet50_imagenet.yaml \\
          --checkpoint runs/resnet50_imagenet/latest-rank0.pt resnet50.pt2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from channels_last_algo.app.cli.model_arguments import build_for, check_input, input_shape, model_name
from channels_last_algo.app.cli.recipe_commands import require_composer
from channels_last_algo.app.cli.shared_arguments import UsageError, check_writable, positive_int
from channels_last_algo.app.recipes.loading import load_recipe
from channels_last_algo.core.fuse import export_for_inference

__all__ = ['add_export']


def add_export(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        'export',
        help='fuse a model for NHWC inference and save it with torch.export (.pt2)',
        description='Build MODEL (with --weights loaded into it), or the network a recipe trained (--recipe, with the '
        "layers its algorithms swap in, such as BlurPool's, and the EMA weights of a --checkpoint it wrote), fold its "
        'BatchNorms and fuse its convolutions with their activations and residual adds (fuse_for_inference), check '
        'the result against the model on a random input of the --input shape, and save it with torch.export to OUT. '
        'It loads without this package: torch.export.load(OUT).module()(images).',
    )
    parser.add_argument(
        'model',
        metavar='MODEL',
        type=model_name,
        nargs='?',
        help='a torchvision model name (e.g. resnet50) or module.path:callable; or give --recipe',
    )
    parser.add_argument('out', metavar='OUT', help='the .pt2 file to write')
    parser.add_argument('--recipe', metavar='RECIPE', help='export the network of this YAML recipe (instead of MODEL)')
    parser.add_argument(
        '--checkpoint',
        metavar='FILE',
        help='with --recipe: a checkpoint its run wrote (e.g. '
        'runs/NAME/latest-rank0.pt); its EMA weights when the recipe uses EMA',
    )
    parser.add_argument(
        '--training-weights',
        action='store_true',
        help="with --checkpoint: the trained weights, not EMA's moving averages",
    )
    parser.add_argument(
        '--set',
        dest='overrides',
        action='append',
        default=[],
        metavar='KEY=VALUE',
        help='with --recipe: the overrides the run was trained with (repeatable)',
    )
    _add_export_model_options(parser)
    parser.set_defaults(run=_run_export)


def _add_export_model_options(parser: argparse.ArgumentParser) -> None:
    """export's --input, --static-batch, --num-classes and --weights."""
    parser.add_argument(
        '--input',
        type=input_shape,
        default=(2, 3, 224, 224),
        metavar='N,C,H,W',
        help='the example input shape (default: 2,3,224,224). The saved program takes any batch size but only '
        'these channels, height and width (torch.export traces the fused network for them); export again for '
        'another image size',
    )
    parser.add_argument('--static-batch', action='store_true', help='fix the batch size to N too')
    parser.add_argument('--num-classes', type=positive_int, metavar='K', help="the model's number of classes")
    parser.add_argument(
        '--weights',
        metavar='FILE',
        help="a state_dict saved with torch.save (a ComposerModel's, "
        "with its 'module.' prefix, too); default: the random initial weights",
    )


def _read_weights(path: str) -> dict:
    """The state_dict in ``path`` (loaded with ``weights_only=True``), without the ``module.``
    prefix a ComposerModel's state_dict puts on every key."""
    if not Path(path).is_file():
        raise ValueError(
            f'cannot read weights from {path!r}: it is no regular file; give a file written with torch.save'
        )
    try:
        state = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as error:  # missing file, not a torch file, or objects weights_only refuses
        raise ValueError(
            f'cannot read weights from {path!r}: {str(error).splitlines()[0]}; give a file written with '
            'torch.save(model.state_dict(), FILE) (from a Composer checkpoint you trust: save '
            "torch.load(CHECKPOINT, weights_only=False)['state']['model'])"
        ) from error
    if not isinstance(state, dict) or not all(isinstance(key, str) for key in state):
        raise ValueError(
            f'{path!r} holds a {type(state).__name__}, not a state_dict; give a file written with '
            'torch.save(model.state_dict(), FILE)'
        )
    if state and all(key.startswith('module.') for key in state):
        state = {key[len('module.') :]: value for key, value in state.items()}
    return state


def _state_dict_problem(error: Exception) -> str:
    """``load_state_dict``'s many-line refusal in one line: its first problem, and how many more.

    Example:
        >>> error = RuntimeError('Error(s) in loading state_dict for Net:\\n\\tMissing key(s): "a".\\n\\tx')
        >>> _state_dict_problem(error)
        'Missing key(s): "a". (and 1 more problem)'
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith('Error(s) in loading state_dict'):
        more = len(lines) - 2
        return lines[1] + (f' (and {more} more problem{"s" if more > 1 else ""})' if more else '')
    return lines[0] if lines else type(error).__name__


def _export_model(args: argparse.Namespace):
    """The model ``export`` saves: MODEL with --weights, or --recipe's network with --checkpoint's weights."""
    if (args.model is None) == (args.recipe is None) or (args.recipe is None) != (args.checkpoint is None):
        raise ValueError(
            'give MODEL (with --weights FILE to load a state_dict), or --recipe RECIPE with --checkpoint '
            'FILE (a checkpoint its run wrote), not both'
        )
    if args.recipe is not None:
        recipe = load_recipe(args.recipe, args.overrides)
        require_composer()
        from channels_last_algo.app.runs.run_checkpoints import model_from_checkpoint  # on Composer's State

        model = model_from_checkpoint(recipe, args.checkpoint, ema=not args.training_weights)
        check_input(model, args.input, recipe.model.name)
        return model
    model = build_for(
        args.model, args.input, train=False, **({} if args.num_classes is None else {'num_classes': args.num_classes})
    )
    if args.weights:
        try:
            model.load_state_dict(_read_weights(args.weights))
        except (ValueError, RuntimeError) as error:
            raise ValueError(f'--weights {args.weights}: {_state_dict_problem(error)}') from error
    return model


def _run_export(args: argparse.Namespace) -> int:
    check_writable(args.out, 'OUT', '.pt2', [args.weights, args.checkpoint, args.recipe])
    if len(args.input) != 4:
        raise UsageError(f'--input {",".join(map(str, args.input))}: export takes N,C,H,W (it fuses 2D convolutions)')
    try:
        model = _export_model(args)
    except ValueError as error:
        print(f'channels-last export: error: {error}', file=sys.stderr)
        return 2
    torch.manual_seed(0)
    try:
        _, summary = export_for_inference(
            model.eval(), args.out, torch.randn(args.input), dynamic_batch=not args.static_batch
        )
    except ValueError as error:
        print(f'channels-last export: error: {error}', file=sys.stderr)
        return 2
    size = Path(args.out).stat().st_size
    print(f'{type(model).__name__}: {summary}')
    batch = args.input[0] if args.static_batch else 'N'
    print(
        f'wrote {args.out} ({size / 2**20:.1f} MiB); run it with torch.export.load({str(args.out)!r}).module() '
        f'on NHWC images of {batch} x {" x ".join(map(str, args.input[1:]))} only'
    )
    return 0
