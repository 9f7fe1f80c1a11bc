"""The ``channels-last`` command.

Example:
    $ channels-last --version
    $ channels-last demo --steps 5
    $ channels-last train recipes/resnet50_imagenet.yaml --smoke
    $ channels-last train --help-keys
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from channels_last_algo import __version__

__all__ = ['UsageError', 'main']


class UsageError(ValueError):
    """A command line that cannot run; the message names the argument at fault and the fix."""


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        'demo',
        help='train a small conv net with and without ChannelsLast; print layouts and step times',
    )
    parser.add_argument(
        '--steps',
        type=_positive_int,
        default=20,
        help='timed training steps per variant (default 20; 6 or more give the speedup an interval)',
    )
    parser.add_argument('--batch-size', type=_positive_int, default=32, help='images per training step (default 32)')
    parser.add_argument(
        '--image-size', type=_positive_int, default=64, help='input height and width in px, >= 2 (default 64)'
    )
    parser.set_defaults(run=_run_demo)


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f'{text!r} is not a positive integer')
    return value


def _count(text: str) -> int:
    """argparse type: an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f'{text!r} is not an integer >= 0')
    return value


def _seconds(text: str) -> float:
    """A finite number of seconds > 0, for argparse."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f'{text!r} is not a positive finite number of seconds')
    return value


def _run_demo(args: argparse.Namespace) -> int:
    from channels_last_algo.app.demo import run_demo

    shape = (args.batch_size, 3, args.image_size, args.image_size)
    _check_fits(
        'channels_last_algo.app.demo:TinyResNet', shape, True, f'--batch-size {shape[0]} --image-size {shape[2]}'
    )
    try:
        run_demo(steps=args.steps, batch_size=args.batch_size, image_size=args.image_size)
    except ValueError as error:
        print(f'channels-last demo: error: {error}', file=sys.stderr)
        return 2
    return 0


def _input_shape(text: str) -> tuple[int, ...]:
    """``'2,3,224,224'`` -> ``(2, 3, 224, 224)``; 4 (N,C,H,W) or 5 (N,C,D,H,W) positive ints."""
    try:
        shape = tuple(int(part) for part in text.split(','))
    except ValueError:
        shape = ()
    if len(shape) not in (4, 5) or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f'{text!r} is not an input shape; give 4 (N,C,H,W) or 5 (N,C,D,H,W) comma-separated '
            'positive integers, e.g. 2,3,224,224'
        )
    return shape


def _model_name(spec: str) -> str:
    """argparse type for MODEL: ``spec``, once :func:`~channels_last_algo.app.models.model_builder` finds it."""
    from channels_last_algo.app.models import model_builder

    try:
        model_builder(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return spec


def _first_line(error: BaseException) -> str:
    """``Type: the first line of the message``."""
    return f'{type(error).__name__}: {(str(error).strip().splitlines() or [""])[0]}'


def _build(spec: str, **options: Any):
    """The model MODEL names; UsageError when the callable builds something else."""
    import torch

    from channels_last_algo.app.models import model_builder

    try:
        model = model_builder(spec)(**options)
    except Exception as error:  # the user's callable, or a torchvision builder refusing an option
        raise UsageError(f'MODEL {spec}: building it failed: {_first_line(error)}') from error
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f'MODEL built a {type(model).__name__}, not a torch.nn.Module')
    return model


def _check_input(model: Any, shape: Sequence[int], name: str) -> None:
    """UsageError naming ``--input`` when ``shape`` does not fit the first convolution of ``model``."""
    from channels_last_algo.app.models import input_shape_problem

    problem = input_shape_problem(model, shape, name)
    if problem is not None:
        raise UsageError(f'--input {",".join(map(str, shape))}: {problem}')


def _check_fits(spec: str, shape: Sequence[int], train: bool, given: str, **options: Any) -> None:
    """UsageError naming ``given`` (the arguments that set ``shape``) when one pass of the model ``spec`` names
    over an input of ``shape`` cannot fit this machine's free memory, counted on ``meta`` before any allocation."""
    import functools

    from channels_last_algo.app.models import model_builder
    from channels_last_algo.app.step_memory import REFUSE_ABOVE, available_bytes, input_pass_bytes, size_text

    available = available_bytes('cpu')
    need = input_pass_bytes(functools.partial(model_builder(spec), **options), tuple(shape), train)
    if available is not None and need is not None and need > REFUSE_ABOVE * available:
        raise UsageError(
            f'{given}: one {"training" if train else "forward"} pass of {spec} on it needs about {size_text(need)}, '
            f'more than the {size_text(available)} free here; give a smaller input'
        )


def _build_for(spec: str, shape: Sequence[int], train: bool, **options: Any):
    """The model MODEL names, once ``shape`` (``--input``) is known to fit its memory and its first convolution:
    a pass too large for this machine's free memory is refused before anything is allocated."""
    _check_fits(spec, shape, train, f'--input {",".join(map(str, shape))}', **options)
    model = _build(spec, **options)
    _check_input(model, shape, spec)
    return model


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL and --input, as the audit and the doctor take them."""
    parser.add_argument(
        'model',
        metavar='MODEL',
        type=_model_name,
        help='a torchvision model name (e.g. resnet50) or module.path:callable',
    )
    parser.add_argument(
        '--input',
        type=_input_shape,
        default=(2, 3, 224, 224),
        metavar='N,C,H,W',
        help='input shape, N,C,H,W or N,C,D,H,W (default: 2,3,224,224)',
    )


def _add_audit(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        'audit',
        help='convert a model to channels last and list every op that drops NHWC, forward and backward',
        description='Convert MODEL with apply_channels_last, run it on a random NHWC input (forward, '
        'then backward of the sum of its outputs) and print every layout break and exit conversion.',
    )
    _add_model_arguments(parser)
    parser.add_argument(
        '--eval',
        action='store_true',
        help='audit an eval-mode forward pass only (default: train-mode forward and backward)',
    )
    parser.add_argument('--strict', action='store_true', help='exit with code 1 if there is any layout break')
    parser.add_argument(
        '--no-repair',
        action='store_true',
        help='restride only (plain channels last); by default the layers that drop NHWC are repaired',
    )
    parser.add_argument('--json', action='store_true', help='print the report as JSON (AuditReport.to_dict())')
    parser.set_defaults(run=_run_audit)


def _run_audit(args: argparse.Namespace) -> int:
    import json

    import torch

    from channels_last_algo.core.audit import audit_model
    from channels_last_algo.core.convert import apply_channels_last
    from channels_last_algo.core.layout import to_channels_last

    model = _build_for(args.model, args.input, train=not args.eval)
    model.train(not args.eval)
    apply_channels_last(model, repair=not args.no_repair)
    torch.manual_seed(0)
    example = to_channels_last(torch.randn(args.input))
    try:
        report = audit_model(model, example, backward=not args.eval)
    except Exception as error:  # the model's own refusal of this input (a BatchNorm over a single value, ...)
        where = 'eval forward' if args.eval else 'train-mode forward and backward'
        raise UsageError(
            f'MODEL {args.model} fails on a random input of --input {",".join(map(str, args.input))} '
            f'({where}): {_first_line(error)}; give an input shape the model takes'
        ) from error
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        mode = 'eval forward' if args.eval else 'train forward + backward'
        print(f'{type(model).__name__}, NHWC input {tuple(args.input)}, {mode}')
        print(report)
    if args.strict and not report.ok:
        print(f'channels-last audit: strict: {len(report.breaks)} layout breaks', file=sys.stderr)
        return 1
    return 0


def _add_doctor(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        'doctor',
        help='check that channels last trains MODEL here without a crash and with NCHW numbers',
        description='On this torch and hardware: list the layers of MODEL that match a known layout kernel bug '
        'and the safe path they get, run a channels-last training step without and with the safe paths (each in '
        'a child process, so a crash is a result), compare one step with NCHW in float32 and float64, and list '
        'the layout breaks left with their cost. Exit code 0 when channels last is safe and right, 1 otherwise.',
    )
    _add_model_arguments(parser)
    parser.add_argument('--device', help='where to train (default: cuda when available, else cpu)')
    parser.add_argument('--strict', action='store_true', help='also exit with code 1 if a layout break is left')
    parser.add_argument(
        '--timeout', type=_seconds, default=600.0, metavar='S', help='seconds each child process may run (default 600)'
    )
    parser.add_argument('--json', action='store_true', help='print the report as JSON (DoctorReport.to_dict())')
    parser.set_defaults(run=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    import json

    from channels_last_algo.app.models import model_builder
    from channels_last_algo.core.safety.doctor import doctor

    _build_for(args.model, args.input, train=True)  # here, before the child processes start
    try:
        report = doctor(
            model_builder(args.model), args.input, device=args.device, strict=args.strict, timeout=args.timeout
        )
    except (TypeError, ValueError) as error:
        print(f'channels-last doctor: error: {error}', file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return report.exit_code


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


def _require_composer() -> None:
    """UsageError with the install command when Composer, which runs the recipes, is not installed."""
    from channels_last_algo.integrations import require

    try:
        require('composer', 'composer')
    except ImportError as error:
        raise UsageError(str(error)) from None


def _load(args: argparse.Namespace):
    """The recipe of RECIPE with the --smoke overrides (if asked) and then --set's, checked (which needs no
    Composer), then Composer there to run it."""
    from channels_last_algo.app.recipes import SMOKE_OVERRIDES, load_recipe

    recipe = load_recipe(args.recipe, [*(SMOKE_OVERRIDES if args.smoke else ()), *args.overrides])
    _require_composer()
    return recipe


class _PrintRecipeKeys(argparse.Action):
    """``--help-keys``: print every recipe key (the reference docs/recipe_keys.md holds) and exit."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        from channels_last_algo.app.recipe_keys import recipe_keys_reference

        print(recipe_keys_reference(), end='')
        parser.exit()


def _add_train(subparsers: argparse._SubParsersAction) -> None:
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
    from channels_last_algo.app.train import train_recipe

    recipe = _load(args)
    result = train_recipe(
        recipe, data_path=args.data, resume=args.resume, overwrite=args.overwrite, check_data=args.check_data
    )
    if result.metrics:
        print(f'channels-last train: evaluation at the end ({result.end}):\n{result.format_metrics()}')
    print(f'channels-last train: done; checkpoints in {recipe.save_folder()}')
    return 0


def _add_compare(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        'compare',
        help="time a recipe's training steps with channels last off, on, and Composer's",
        description="Train RECIPE's model on its data with channels last off (NCHW), with Composer's "
        'ChannelsLast and with this project, interleaved step by step after warm-up; print images/s, '
        'speedups and the layout audit of each.',
    )
    _add_recipe_arguments(parser, smoke='--batches 3 --warmup 1 unless given')
    parser.add_argument(
        '--batches', type=_positive_int, help='timed training steps per variant (default 10; 3 with --smoke)'
    )
    parser.add_argument('--warmup', type=_count, help='untimed steps per variant first (default 2; 1 with --smoke)')
    parser.add_argument('--json', metavar='FILE', help='also write the results as JSON to FILE')
    parser.set_defaults(run=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    import json

    from channels_last_algo.app.compare import compare_recipe, format_comparison

    if args.json:
        _check_writable(args.json, '--json', '.json', [args.recipe])
    recipe = _load(args)
    batches = args.batches if args.batches is not None else (3 if args.smoke else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    result = compare_recipe(recipe, batches=batches, warmup=warmup, data_path=args.data)
    print(format_comparison(result))
    if args.json:
        with open(args.json, 'w') as file:
            json.dump(result, file, indent=2)
    return 0


def _add_export(subparsers: argparse._SubParsersAction) -> None:
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
        type=_model_name,
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
        type=_input_shape,
        default=(2, 3, 224, 224),
        metavar='N,C,H,W',
        help='the example input shape (default: 2,3,224,224). The saved program takes any batch size but only '
        'these channels, height and width (torch.export traces the fused network for them); export again for '
        'another image size',
    )
    parser.add_argument('--static-batch', action='store_true', help='fix the batch size to N too')
    parser.add_argument('--num-classes', type=_positive_int, metavar='K', help="the model's number of classes")
    parser.add_argument(
        '--weights',
        metavar='FILE',
        help="a state_dict saved with torch.save (a ComposerModel's, "
        "with its 'module.' prefix, too); default: the random initial weights",
    )


def _read_weights(path: str) -> dict:
    """The state_dict in ``path`` (loaded with ``weights_only=True``), without the ``module.``
    prefix a ComposerModel's state_dict puts on every key."""
    import torch

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
        from channels_last_algo.app.recipes import load_recipe

        recipe = load_recipe(args.recipe, args.overrides)
        _require_composer()
        from channels_last_algo.app.checkpoints import model_from_checkpoint  # on Composer's State

        model = model_from_checkpoint(recipe, args.checkpoint, ema=not args.training_weights)
        _check_input(model, args.input, recipe.model.name)
        return model
    model = _build_for(
        args.model, args.input, train=False, **({} if args.num_classes is None else {'num_classes': args.num_classes})
    )
    if args.weights:
        try:
            model.load_state_dict(_read_weights(args.weights))
        except (ValueError, RuntimeError) as error:
            raise ValueError(f'--weights {args.weights}: {_state_dict_problem(error)}') from error
    return model


def _check_writable(path: str, what: str, suffix: str, inputs: Sequence[Optional[str]] = ()) -> None:
    """UsageError naming ``what`` (the argument) when the file ``path`` cannot be written, or writing it could
    destroy something: a link (the write would replace its target), a pipe or device, one of the command's
    ``inputs``, or an existing file that is no ``suffix`` file (a checkpoint, a recipe). Checked before any work."""
    target = Path(path)
    try:
        problem = _write_problem(target, suffix, [Path(p) for p in inputs if p])
    except OSError as error:  # a name too long, a loop of links
        problem = f'cannot be looked at ({error.strerror or error})'
    if problem:
        raise UsageError(f'{what} {path}: {problem}')


def _write_problem(target: Path, suffix: str, inputs: list[Path]) -> Optional[str]:
    if target.is_symlink():
        return 'is a link; writing would replace the file it points to: give the path of a new file'
    if target.is_dir():
        return 'is a folder; give a file name in it'
    if not target.parent.is_dir():
        found = 'is a file' if target.parent.exists() else 'does not exist'
        return f'its folder {target.parent} {found}; create the folder or give another path'
    if target.exists():
        if not target.is_file():
            return 'is a pipe, socket or device, not a regular file; give the path of a file'
        if any(p.exists() and target.samefile(p) for p in inputs):
            return 'is one of the files this command reads; give the path of a new file'
        if target.suffix != suffix:
            return f'exists and is no {suffix} file (it would be overwritten); give a new file name or remove it'
    if not os.access(target.parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return 'cannot be written here (permission denied); give a writable path'
    return None


def _run_export(args: argparse.Namespace) -> int:
    import torch

    from channels_last_algo.core.fuse import export_for_inference

    _check_writable(args.out, 'OUT', '.pt2', [args.weights, args.checkpoint, args.recipe])
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog='channels-last',
        description='Train conv nets in channels-last (NHWC) memory format, and check that they stay there.',
    )
    parser.add_argument('--version', action='version', version=f'%(prog)s {__version__}')
    subparsers = parser.add_subparsers(title='commands', metavar='COMMAND', dest='command')
    _add_demo(subparsers)
    _add_audit(subparsers)
    _add_train(subparsers)
    _add_compare(subparsers)
    _add_export(subparsers)
    _add_doctor(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``channels-last`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, 'run'):
        parser.print_help()
        return 0
    from channels_last_algo.app.recipes import RecipeError
    from channels_last_algo.app.run_folder import RunFolderError
    from channels_last_algo.app.train import RunError

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
    import tempfile

    from channels_last_algo.app.train import failure_place, write_traceback

    where = failure_place(error)
    return f'{_first_line(error)} (in {where}); {write_traceback(error, Path(tempfile.gettempdir()))}'


if __name__ == '__main__':
    sys.exit(main())
