"""The public functions' first check: a model argument that is not a module, refused in one line.

Without it, ``apply_channels_last(MyNet)`` or ``audit_model(state_dict, x)`` ends in an
``AttributeError`` from deep inside a module walk that names neither the call nor the fix.

Example:
    >>> require_module(torch.nn.Conv2d(3, 8, 3), 'apply_channels_last')
    >>> require_module(torch.nn.Conv2d, 'apply_channels_last')
    Traceback (most recent call last):
    ...
    TypeError: apply_channels_last: model is the class Conv2d, not a torch.nn.Module; pass an instance: Conv2d(...)
"""

from __future__ import annotations

import collections.abc
import os
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = [
    'ExampleInputError',
    'example_input_error',
    'require_flags',
    'require_input',
    'require_loop',
    'require_module',
    'require_optimizers',
    'require_positive',
    'require_state',
    'why',
    'write_problem',
]


def why(error: BaseException) -> str:
    """``error`` in one line: its type and its message's first line."""
    return f'{type(error).__name__}: {(str(error).strip().splitlines() or [""])[0]}'


class ExampleInputError(ValueError):
    """The model itself raises on the example input: it is not the positional arguments its forward takes."""


def example_input_error(caller: str, model: torch.nn.Module, error: BaseException, hint: str = '') -> ExampleInputError:
    """The :class:`ExampleInputError` of ``caller`` for ``model``, which raised ``error`` on the example input.

    Example:
        >>> net = torch.nn.Conv2d(3, 8, 3)
        >>> try:
        ...     net(torch.zeros(1, 4, 8, 8))
        ... except RuntimeError as error:
        ...     print(str(example_input_error('audit_model', net, error))[:64])
        audit_model: Conv2d itself raises on example_input (RuntimeError
    """
    return ExampleInputError(
        f'{caller}: {type(model).__name__} itself raises on example_input ({why(error)}); give the positional '
        f'arguments its forward takes (a tuple for several){hint}'
    )


def _shown(value: Any) -> str:
    """``value`` in a few words on one line: a scalar's repr, cut short; else its type."""
    if isinstance(value, type):
        return f'the class {value.__name__}'
    if isinstance(value, (str, int, float, bool, type(None))):
        text = repr(value).replace('\n', ' ')
        return f'{type(value).__name__} {text if len(text) <= 60 else text[:57] + "..."}'
    return f'a {type(value).__name__}'


def _module_hint(value: Any) -> str:
    """What the caller most likely meant to pass instead of ``value``."""
    if isinstance(value, type) and issubclass(value, torch.nn.Module):
        return f'pass an instance: {value.__name__}(...)'
    if isinstance(value, dict):
        return 'that looks like a state_dict: build the model, load_state_dict(it), and pass the model'
    if callable(value):
        return 'call it to build the model, and pass the model'
    return 'pass the network (a torch.nn.Module)'


def require_module(model: Any, caller: str) -> None:
    """TypeError naming ``caller`` and the fix unless ``model`` is a ``torch.nn.Module``."""
    if isinstance(model, torch.nn.Module):
        return
    raise TypeError(f'{caller}: model is {_shown(model)}, not a torch.nn.Module; {_module_hint(model)}')


def require_input(example_input: Any, caller: str) -> None:
    """TypeError naming ``caller`` unless ``example_input`` is a tensor or a tuple of positional inputs.

    Example:
        >>> require_input([torch.zeros(1)], 'audit_model')
        Traceback (most recent call last):
        ...
        TypeError: audit_model: example_input is a list; pass one tensor, or a tuple of the model's positional inputs
    """
    if isinstance(example_input, (torch.Tensor, tuple)):
        return
    raise TypeError(
        f'{caller}: example_input is a {type(example_input).__name__}; pass one tensor, or a tuple of the '
        "model's positional inputs"
    )


def require_positive(caller: str, **numbers: Any) -> None:
    """ValueError naming ``caller`` and the argument unless each is a real number above 0.

    Example:
        >>> require_positive('fuse_for_inference', rtol=-1)
        Traceback (most recent call last):
        ...
        ValueError: fuse_for_inference: rtol must be a number above 0, got -1
    """
    for name, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f'{caller}: {name} must be a number above 0, got {value!r}')


def write_problem(target: Path, suffix: str, inputs: tuple[Path, ...] = ()) -> Optional[str]:
    """Why writing the file ``target`` could fail or destroy something, or None: a link (the write would replace
    its target), a folder, a missing folder, a pipe or device, one of ``inputs``, an existing file that is no
    ``suffix`` file (a checkpoint, a recipe), no permission.

    Example:
        >>> write_problem(Path('/'), '.pt2')
        'is a folder; give a file name in it'
    """
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


def require_flags(caller: str, **flags: Any) -> None:
    """ValueError naming ``caller`` and the flag unless each is True or False (``'no'`` is truthy, ``None`` falsy:
    either would silently mean what the caller did not write).

    Example:
        >>> require_flags('apply_channels_last', repair=True, kernel_safety='no')
        Traceback (most recent call last):
        ...
        ValueError: apply_channels_last: kernel_safety must be True or False, got str 'no'
    """
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f'{caller}: {name} must be True or False, got {type(value).__name__} {value!r}')


def require_loop(loop: Any, caller: str) -> None:
    """TypeError naming ``caller`` unless ``loop`` is None or a str (the name of an evaluation loop).

    Example:
        >>> require_loop(['validate'], 'LayoutGuard.on_batch')
        Traceback (most recent call last):
        ...
        TypeError: LayoutGuard.on_batch: loop names the batch's loop with a str ('validate', 'predict'), got a list
    """
    if loop is None or isinstance(loop, str):
        return
    raise TypeError(f"{caller}: loop names the batch's loop with a str ('validate', 'predict'), got {_shown(loop)}")


def require_optimizers(optimizers: Any, caller: str) -> None:
    """TypeError naming ``caller`` unless ``optimizers`` is None, an optimizer, or a list or tuple of them.

    Example:
        >>> require_optimizers([torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)], 'x')
        >>> require_optimizers('sgd', 'apply_channels_last')
        Traceback (most recent call last):
        ...
        TypeError: apply_channels_last: optimizers must be a torch.optim.Optimizer or a list of them, got str 'sgd'
    """
    entries = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    if optimizers is None or all(isinstance(entry, torch.optim.Optimizer) for entry in entries):
        return
    wrong = next(entry for entry in entries if not isinstance(entry, torch.optim.Optimizer))
    raise TypeError(f'{caller}: optimizers must be a torch.optim.Optimizer or a list of them, got {_shown(wrong)}')


def require_state(state: Any, caller: str) -> None:
    """TypeError naming ``caller`` unless ``state`` is a mapping (a ``state_dict``), a sequence or a tensor.

    Example:
        >>> require_state(torch.nn.Linear(2, 2), 'canonical_state')
        Traceback (most recent call last):
        ...
        TypeError: canonical_state: takes a state_dict, got a Linear: pass model.state_dict()
    """
    if isinstance(state, (torch.Tensor, list, tuple, collections.abc.Mapping)):
        return
    hint = 'pass model.state_dict()' if isinstance(state, torch.nn.Module) else 'pass a state_dict'
    raise TypeError(f'{caller}: takes a state_dict, got {_shown(state)}: {hint}')
