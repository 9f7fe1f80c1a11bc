"""Adapters from a trainer's events to the core: they decide *when*, the core does *what*.

Each integration lives in its own module and imports its trainer at the top, so importing
this package costs nothing; :func:`require` turns a missing trainer into one line that says
what to install.

Example:
    >>> require('torch', 'core')
    >>> require('no_such_trainer', 'extra')
    Traceback (most recent call last):
    ...
    ImportError: this needs the no_such_trainer package, which is not installed: pip install 'channels-last-algo[extra]'
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__all__ = ['INTEGRATIONS', 'integration_attribute', 'require']

# Public name -> (module that defines it, the package it needs, the extra that installs it).
INTEGRATIONS: dict[str, tuple[str, str, str]] = {
    'ChannelsLast': ('channels_last_algo.integrations.composer', 'composer', 'composer'),
    'ChannelsLastCallback': ('channels_last_algo.integrations.lightning', 'lightning', 'lightning'),
    'FusedEval': ('channels_last_algo.integrations.composer_fused_eval', 'composer', 'composer'),
    'FusedEvalCallback': ('channels_last_algo.integrations.lightning_fused_eval', 'lightning', 'lightning'),
}


def require(package: str, extra: str) -> None:
    """Raise an ``ImportError`` naming the install command unless ``package`` is importable."""
    if importlib.util.find_spec(package) is None:
        raise ImportError(
            f"this needs the {package} package, which is not installed: pip install 'channels-last-algo[{extra}]'"
        )


def integration_attribute(name: str, owner: str) -> Any:
    """The integration object ``name`` for ``owner``'s module ``__getattr__``."""
    if name not in INTEGRATIONS:
        raise AttributeError(f'module {owner!r} has no attribute {name!r}')
    module, package, extra = INTEGRATIONS[name]
    try:
        require(package, extra)
    except ImportError as error:
        raise ImportError(f'{owner}.{name}: {error}') from None
    return getattr(importlib.import_module(module), name)
