"""The commands on a model: ``audit`` (every op that drops NHWC, forward and backward) and ``doctor``
(whether channels last trains the model here without a crash and with NCHW's numbers).

Example::

    $ channels-last audit resnet50 --input 8,3,224,224 --strict
    $ channels-last doctor resnet50 --json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from channels_last_algo.app.cli.model_arguments import add_model_arguments, build_for
from channels_last_algo.app.cli.shared_arguments import UsageError, first_line, seconds
from channels_last_algo.app.recipes.models import model_builder
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.layout import to_channels_last
from channels_last_algo.core.model_audit import audit_model
from channels_last_algo.core.safety.diagnostics import doctor

__all__ = ['add_audit', 'add_doctor']


def add_audit(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        'audit',
        help='convert a model to channels last and list every op that drops NHWC, forward and backward',
        description='Convert MODEL with apply_channels_last, run it on a random NHWC input (forward, '
        'then backward of the sum of its outputs) and print every layout break and exit conversion.',
    )
    add_model_arguments(parser)
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
    model = build_for(args.model, args.input, train=not args.eval)
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
            f'({where}): {first_line(error)}; give an input shape the model takes'
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


def add_doctor(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        'doctor',
        help='check that channels last trains MODEL here without a crash and with NCHW numbers',
        description='On this torch and hardware: list the layers of MODEL that match a known layout kernel bug '
        'and the safe path they get, run a channels-last training step without and with the safe paths (each in '
        'a child process, so a crash is a result), compare one step with NCHW in float32 and float64, and list '
        'the layout breaks left with their cost. Exit code 0 when channels last is safe and right, 1 otherwise.',
    )
    add_model_arguments(parser)
    parser.add_argument('--device', help='where to train (default: cuda when available, else cpu)')
    parser.add_argument('--strict', action='store_true', help='also exit with code 1 if a layout break is left')
    parser.add_argument(
        '--timeout', type=seconds, default=600.0, metavar='S', help='seconds each child process may run (default 600)'
    )
    parser.add_argument('--json', action='store_true', help='print the report as JSON (DoctorReport.to_dict())')
    parser.set_defaults(run=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    build_for(args.model, args.input, train=True)  # here, before the child processes start
    try:
        report = doctor(
            model_builder(args.model), args.input, device=args.device, strict=args.strict, timeout=args.timeout
        )
    except (TypeError, ValueError) as error:
        print(f'channels-last doctor: error: {error}', file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return report.exit_code
