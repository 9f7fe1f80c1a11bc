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

__all__ = ['INTEGRATIONS', 'GuardedIntegration', 'integration_attribute', 'require']

# Public name -> (module that defines it, the package it needs, the extra that installs it).
INTEGRATIONS: dict[str, tuple[str, str, str]] = {
    'ChannelsLast': ('channels_last_algo.integrations.composer', 'composer', 'composer'),
    'ChannelsLastCallback': ('channels_last_algo.integrations.lightning', 'lightning', 'lightning'),
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


class GuardedIntegration:
    """What every trainer adapter shows of the :class:`~channels_last_algo.core.guard.LayoutGuard`
    it drives (``self.guard``) and its ``fuse_eval`` option: the audit report, auto mode's
    decision, and a ``repr`` that rebuilds the object."""

    guard: Any
    fuse_eval: bool

    @property
    def report(self) -> Any:
        """The layout audit of the audited steps so far (None before any)."""
        return self.guard.report

    @property
    def decision(self) -> Any:
        """Auto mode's decision, once made (or loaded from a checkpoint)."""
        return self.guard.decision

    def __repr__(self) -> str:
        return (
            f'{type(self).__name__}(mode={self.guard.mode!r}, audit_steps={self.guard.audit_steps}, '
            f'strict={self.guard.strict}{", fuse_eval=True" if self.fuse_eval else ""}'
            f'{"" if self.guard.repair else ", repair=False"}'
            f'{"" if self.guard.inputs.inputs == "auto" else f", inputs={self.guard.inputs!r}"})'
        )
