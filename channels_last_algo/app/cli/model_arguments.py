"""MODEL and ``--input`` on the command line: the argparse types, and the model built once the input is known
to fit this machine's memory and the model's first convolution.

Example:
    >>> input_shape('2,3,32,32'), model_name('resnet18')
    ((2, 3, 32, 32), 'resnet18')
    >>> model = build_for('resnet18', (2, 3, 32, 32), train=False)
    >>> check_input(model, (2, 1, 32, 32), 'resnet18')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    channels_last_algo.app.cli.shared_arguments.UsageError: --input 2,1,32,32: resnet18's first convolution ...
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from typing import Any

import torch

from channels_last_algo.app.cli.shared_arguments import UsageError, first_line
from channels_last_algo.app.recipes.footprints import input_pass_bytes
from channels_last_algo.app.recipes.models import input_shape_problem, model_builder
from channels_last_algo.app.recipes.step_memory import REFUSE_ABOVE, available_bytes, size_text

__all__ = ['add_model_arguments', 'build_for', 'check_fits', 'check_input', 'input_shape', 'model_name']


def input_shape(text: str) -> tuple[int, ...]:
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


def model_name(spec: str) -> str:
    """argparse type for MODEL: ``spec``, once :func:`~channels_last_algo.app.recipes.models.model_builder` finds it."""
    try:
        model_builder(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return spec


def _build(spec: str, **options: Any):
    """The model MODEL names; UsageError when the callable builds something else."""
    try:
        model = model_builder(spec)(**options)
    except Exception as error:  # the user's callable, or a torchvision builder refusing an option
        raise UsageError(f'MODEL {spec}: building it failed: {first_line(error)}') from error
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f'MODEL built a {type(model).__name__}, not a torch.nn.Module')
    return model


def check_input(model: Any, shape: Sequence[int], name: str) -> None:
    """UsageError naming ``--input`` when ``shape`` does not fit the first convolution of ``model``."""
    problem = input_shape_problem(model, shape, name)
    if problem is not None:
        raise UsageError(f'--input {",".join(map(str, shape))}: {problem}')


def check_fits(spec: str, shape: Sequence[int], train: bool, given: str, **options: Any) -> None:
    """UsageError naming ``given`` (the arguments that set ``shape``) when one pass of the model ``spec`` names
    over an input of ``shape`` cannot fit this machine's free memory, counted on ``meta`` before any allocation."""
    available = available_bytes('cpu')
    need = input_pass_bytes(functools.partial(model_builder(spec), **options), tuple(shape), train)
    if available is not None and need is not None and need > REFUSE_ABOVE * available:
        raise UsageError(
            f'{given}: one {"training" if train else "forward"} pass of {spec} on it needs about {size_text(need)}, '
            f'more than the {size_text(available)} free here; give a smaller input'
        )


def build_for(spec: str, shape: Sequence[int], train: bool, **options: Any):
    """The model MODEL names, once ``shape`` (``--input``) is known to fit its memory and its first convolution:
    a pass too large for this machine's free memory is refused before anything is allocated."""
    check_fits(spec, shape, train, f'--input {",".join(map(str, shape))}', **options)
    model = _build(spec, **options)
    check_input(model, shape, spec)
    return model


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL and --input, as the audit and the doctor take them."""
    parser.add_argument(
        'model',
        metavar='MODEL',
        type=model_name,
        help='a torchvision model name (e.g. resnet50) or module.path:callable',
    )
    parser.add_argument(
        '--input',
        type=input_shape,
        default=(2, 3, 224, 224),
        metavar='N,C,H,W',
        help='input shape, N,C,H,W or N,C,D,H,W (default: 2,3,224,224)',
    )
