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


def _input_shape(text: str) -> tuple[int, ...]:
    """``'2,3,224,224'`` -> ``(2, 3, 224, 224)``; 4 (N,C,H,W) or 5 (N,C,D,H,W) positive ints."""
    try:
        shape = tuple(int(part) for part in text.split(','))
    except ValueError:
        shape = ()
    if len(shape) not in (4, 5) or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f'{text!r} is not an input shape; give 4 (N,C,H,W) or 5 (N,C,D,H,W) comma-separated '
            'positive integers, e.g. 2,3,224,224')
    return shape


def _model_factory(spec: str):
    """A no-argument callable building the model that ``spec`` names: a torchvision model name
    (built with ``weights=None``, and ``weights_backbone=None`` where the builder takes it) or
    ``module.path:callable``."""
    import difflib
    import functools
    import importlib
    import inspect

    if ':' in spec:
        module_name, _, attr = spec.partition(':')
        try:
            target = importlib.import_module(module_name)
            return functools.reduce(getattr, attr.split('.'), target)
        except (ImportError, AttributeError) as error:
            raise argparse.ArgumentTypeError(
                f'cannot load {spec!r} ({error}); give module.path:callable, importable from here, '
                'where the callable takes no argument and returns the model') from error
    import torchvision

    names = torchvision.models.list_models()
    if spec not in names:
        close = difflib.get_close_matches(spec, names, n=3)
        hint = f' Did you mean {", ".join(close)}?' if close else ''
        raise argparse.ArgumentTypeError(
            f'{spec!r} is no torchvision model name (see torchvision.models.list_models()) and no '
            f'module.path:callable.{hint}')
    builder = torchvision.models.get_model_builder(spec)
    kwargs = {'weights': None}
    if 'weights_backbone' in inspect.signature(builder).parameters:
        kwargs['weights_backbone'] = None
    return functools.partial(builder, **kwargs)


def _add_audit(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        'audit',
        help='convert a model to channels last and list every op that drops NHWC, forward and backward',
        description='Convert MODEL with apply_channels_last, run it on a random NHWC input (forward, '
        'then backward of the sum of its outputs) and print every layout break and exit conversion.',
    )
    parser.add_argument('model', metavar='MODEL', type=_model_factory,
                        help='a torchvision model name (e.g. resnet50) or module.path:callable')
    parser.add_argument('--input', type=_input_shape, default=(2, 3, 224, 224), metavar='N,C,H,W',
                        help='input shape, N,C,H,W or N,C,D,H,W (default: 2,3,224,224)')
    parser.add_argument('--eval', action='store_true',
                        help='audit an eval-mode forward pass only (default: train-mode forward and backward)')
    parser.add_argument('--strict', action='store_true', help='exit with code 1 if there is any layout break')
    parser.add_argument('--json', action='store_true', help='print the report as JSON (AuditReport.to_dict())')
    parser.set_defaults(run=_run_audit)


def _run_audit(args: argparse.Namespace) -> int:
    import json

    import torch

    from channels_last_algo.audit import audit_model
    from channels_last_algo.convert import apply_channels_last
    from channels_last_algo.layout import to_channels_last

    model = args.model()
    if not isinstance(model, torch.nn.Module):
        print(f'channels-last audit: error: MODEL built a {type(model).__name__}, not a torch.nn.Module',
              file=sys.stderr)
        return 2
    model.train(not args.eval)
    apply_channels_last(model)
    torch.manual_seed(0)
    example = to_channels_last(torch.randn(args.input))
    report = audit_model(model, example, backward=not args.eval)
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog='channels-last',
        description='Train conv nets in channels-last (NHWC) memory format, and check that they stay there.',
    )
    parser.add_argument('--version', action='version', version=f'%(prog)s {__version__}')
    subparsers = parser.add_subparsers(title='commands', metavar='COMMAND')
    _add_demo(subparsers)
    _add_audit(subparsers)
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
