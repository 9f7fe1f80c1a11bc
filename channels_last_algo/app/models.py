"""Build a model from a name: a torchvision model (never with pretrained weights) or a callable.

Example:
    >>> model = build_model('resnet18', num_classes=10)
    >>> model.fc.out_features
    10
    >>> build_model('resnet5O')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: 'resnet5O' is no torchvision model name (...) and no module.path:callable. Did you mean resnet50, ...?
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any, Optional

import torch

__all__ = ['build_model', 'model_builder']


def model_builder(spec: str) -> Callable[..., Any]:
    """The callable that ``spec`` names: a torchvision model name, bound to ``weights=None``
    (and ``weights_backbone=None`` where the builder takes it, so nothing is downloaded), or
    ``module.path:callable``. ValueError naming ``spec`` and what would fix it otherwise."""
    if ':' in spec:
        module_name, _, attr = spec.partition(':')
        try:
            return functools.reduce(getattr, attr.split('.'), importlib.import_module(module_name))
        except (ImportError, AttributeError) as error:
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
