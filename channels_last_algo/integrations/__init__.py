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
    """What every trainer adapter shares of the :class:`~channels_last_algo.core.guard.LayoutGuard`
    it drives (``self.guard``): the audit report, auto mode's decision, the ``fuse_eval`` option,
    the checkpointed state and a ``repr`` that rebuilds the object with the options as asked."""

    guard: Any

    @property
    def report(self) -> Any:
        """The layout audit of the audited steps so far (None before any)."""
        return self.guard.report

    @property
    def decision(self) -> Any:
        """Auto mode's decision, once made (or loaded from a checkpoint)."""
        return self.guard.decision

    @property
    def fuse_eval(self) -> bool:
        """Whether evaluation passes run on a fused copy of the network (settable between passes)."""
        return self.guard.fuse_eval

    @fuse_eval.setter
    def fuse_eval(self, value: bool) -> None:
        self.guard.fuse_eval = value

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own state of the object and the guard's (auto mode's decision)."""
        return {**super().state_dict(), **self.guard.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state)

    def __repr__(self) -> str:
        return type(self).__name__ + repr(self.guard).removeprefix(type(self.guard).__name__)
