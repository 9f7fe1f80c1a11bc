"""Build a model from a name: a torchvision model (never with pretrained weights) or a callable.

Example:
    >>> model = build_model('resnet18', num_classes=10)
    >>> model.fc.out_features
    10
    >>> build_model('resnet5O')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: 'resnet5O' is no torchvision model name (...) and no module.path:callable. Did you mean resnet50, ...?
    >>> input_shape_problem(model, (2, 1, 64, 64), 'resnet18')
    "resnet18's first convolution conv1 takes 3 channels; give N,3,H,W"
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

__all__ = ['build_model', 'first_convolution', 'input_shape_problem', 'model_builder']


def model_builder(spec: str) -> Callable[..., Any]:
    """The callable that ``spec`` names: a torchvision model name, bound to ``weights=None``
    (and ``weights_backbone=None`` where the builder takes it, so nothing is downloaded), or
    ``module.path:callable``. ValueError naming ``spec`` and what would fix it otherwise."""
    if ':' in spec:
        module_name, _, attr = spec.partition(':')
        try:
            return functools.reduce(getattr, attr.split('.'), importlib.import_module(module_name))
        except Exception as error:  # not found, or the module's own code failed (a SyntaxError, a relative name)
            raise ValueError(
                f'cannot load {spec!r} ({error}); give module.path:callable, importable from '
                'here, where the callable returns the model'
            ) from error
    import torchvision

    names = torchvision.models.list_models()
    if spec not in names:
        close = difflib.get_close_matches(spec, names, n=3)
        hint = f' Did you mean {", ".join(close)}?' if close else ''
        raise ValueError(
            f'{spec!r} is no torchvision model name (see torchvision.models.list_models()) and no '
            f'module.path:callable.{hint}'
        )
    builder = torchvision.models.get_model_builder(spec)
    kwargs: dict[str, Any] = {'weights': None}
    if 'weights_backbone' in inspect.signature(builder).parameters:
        kwargs['weights_backbone'] = None
    return functools.partial(builder, **kwargs)


def build_model(spec: str, num_classes: Optional[int] = None) -> torch.nn.Module:
    """The model ``spec`` names (see :func:`model_builder`), with ``num_classes`` outputs if given."""
    builder = model_builder(spec)
    model = builder() if num_classes is None else builder(num_classes=num_classes)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f'{spec!r} built a {type(model).__name__}, not a torch.nn.Module')
    return model


def first_convolution(model: torch.nn.Module) -> Optional[tuple[str, torch.nn.Module]]:
    """The path and module of the first convolution registered in ``model`` (its stem in torchvision's
    and timm's models), or None when it has none."""
    convolutions = (item for item in model.named_modules() if isinstance(item[1], torch.nn.modules.conv._ConvNd))
    return next(convolutions, None)


def input_shape_problem(model: torch.nn.Module, shape: Sequence[int], name: str) -> Optional[str]:
    """Why ``shape`` cannot be an input of ``model`` named ``name``: the rank or the channel count its first
    convolution (:func:`first_convolution`) takes; None when it fits or there is no convolution to ask."""
    found = first_convolution(model)
    if found is None:
        return None
    path, conv = found
    spatial = len(conv.kernel_size)
    channels = conv.in_channels  # 0 for a lazy convolution, which takes any
    wanted = f'N,{channels or "C"},{",".join("L" if spatial == 1 else "DHW"[-spatial:])}'
    where = f"{name}'s first convolution {path or '(the model itself)'}"
    if len(shape) != spatial + 2:
        return f'{where} is a {type(conv).__name__}, which takes {spatial + 2}D input; give {wanted}'
    if channels and shape[1] != channels:
        return f'{where} takes {channels} channels; give {wanted}'
    return None
