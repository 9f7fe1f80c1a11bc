"""The backward hooks a model had before a watch began, run under a watch of their own while it lasts.

Autograd calls backward hooks outside every torch function mode, so a watched step does not see what
they do: a module's full backward hook that flattens ``grad_output[0].view(n, -1)``, or a hook on a
convolution weight that clips each filter's gradient through ``grad.view(out_channels, -1)``,
registered when the model was built. :class:`BackwardHooks` puts each in its place in the model's
hook tables wrapped (:func:`~channels_last_algo.core.view_watch.hook_watched`) while a step is
watched, and the hooks themselves back when it ends, so the model keeps its own hooks (and pickles
as it did). Hooks registered during a watched step are wrapped where they are registered.
:func:`hook_first` puts the package's own gradient hook before a weight's other hooks.

Example:
    >>> import torch
    >>> conv = torch.nn.Conv2d(3, 4, 3)
    >>> handle = conv.weight.register_hook(lambda grad: grad * 2)
    >>> original = list(conv.weight._backward_hooks.values())
    >>> hooks = BackwardHooks()
    >>> hooks.watch(conv, owner=None)
    >>> list(conv.weight._backward_hooks.values()) == original
    False
    >>> hooks.restore()
    >>> list(conv.weight._backward_hooks.values()) == original
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from channels_last_algo.core.view_watch import contiguous_gradient, hook_watched

__all__ = ['BackwardHooks', 'hook_first']


class BackwardHooks:
    """The model's backward hooks, wrapped by :meth:`watch` and given back by :meth:`restore`."""

    def __init__(self) -> None:
        self._wrapped: list[tuple[dict, Any, Any]] = []  # (hook table, key, the hook itself)

    def watch(self, model: Optional[torch.nn.Module], owner: Any) -> None:
        """Wrap the full backward hooks of ``model``'s modules and the hooks on its parameters (their
        gradients are the weights'), reporting to ``owner``; nothing where they already are."""
        if self._wrapped or model is None:
            return
        for module in model.modules():
            self._wrap(module._backward_hooks, owner)
        for parameter in model.parameters():
            self._wrap(parameter._backward_hooks, owner, weight=parameter)

    def _wrap(self, table: Optional[dict], owner: Any, weight: Optional[torch.nn.Parameter] = None) -> None:
        for key, hook in list((table or {}).items()):
            if hook is not contiguous_gradient:  # the package's own, put first on a weight (ViewedOutputs)
                self._wrapped.append((table, key, hook))
                table[key] = hook_watched(hook, owner, weight)

    def restore(self) -> None:
        """Every wrapped hook back in its place (a hook removed meanwhile stays removed)."""
        for table, key, hook in self._wrapped:
            if key in table:
                table[key] = hook
        self._wrapped = []


def hook_first(tensor: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> None:
    """``hook`` registered on ``tensor`` to run before its other hooks. Autograd runs them in the
    order of the table's underlying dict (``move_to_end`` does not change it): the others go back after."""
    table, key = tensor._backward_hooks, tensor.register_hook(hook).id
    others = [(k, h) for k, h in table.items() if k != key] if table is not None else []
    for k, _ in others:
        del table[k]
    table.update(others)
