"""The forward hook that makes a module's NHWC outputs channels first: where a ``.view()`` of them needs NCHW strides.

:class:`~channels_last_algo.core.viewed_outputs.ViewedOutputs` puts it on the module whose output code views
(:class:`Placements`), before the module's own hooks. A module of one tensor in and one out gets a form
``torch.jit.script`` compiles, so that the model still scripts and makes the output contiguous there as eager
does; the copy counts as an exit in the layout audit. A module outside the model (a teacher's) has its hook taken
off when the run ends (:meth:`Placements.release_outside`): the module is the user's.

``torch.save(model)`` pickles each hook as a ``torch.fx.GraphModule`` making the same outputs contiguous
(:func:`portable_form`, through :mod:`~channels_last_algo.core.hook_pickling`), which torch alone loads, so the
model loads and views as before where this package is not installed. Outputs in a container other than tuples,
lists, dicts of str or int keys and namedtuples a module defines (a dataclass) keep the package's hook, and need
the package to load.
``apply_channels_last`` (and so a guard) given a loaded model takes the hooks back as its own (:func:`take_back`):
``torch.jit.script`` compiles those, not the graph modules.

Example:
    >>> import torch
    >>> conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    >>> _ = make_outputs_channels_first(conv, one_tensor=True)
    >>> conv(torch.randn(1, 3, 5, 5).to(memory_format=torch.channels_last)).is_contiguous()
    True
"""

from __future__ import annotations

import inspect
import operator
import sys
import weakref
from typing import Any, Union

import torch
from torch.utils._pytree import tree_map_only
from torch.utils.hooks import RemovableHandle

from channels_last_algo.core.audit import exit_copies, tensors_in
from channels_last_algo.core.hook_pickling import pickle_hooks_as, stop_pickling_hooks_as
from channels_last_algo.core.module_calls import in_graph_capture
from channels_last_algo.core.view_watch import nhwc

__all__ = [
    'ChannelsFirstOutputs',
    'Placements',
    'channels_first_output',
    'channels_first_outputs',
    'make_outputs_channels_first',
    'portable_form',
    'take_back',
]

Layout = Union[bool, tuple, None]  # per tensor: made contiguous; a container: (its type, its parts' layouts)


def make_outputs_channels_first(module: torch.nn.Module, one_tensor: bool) -> RemovableHandle:
    """Hook ``module`` (before its own hooks) to return its NHWC outputs contiguous; ``one_tensor``: it was seen
    returning one tensor, and its forward takes one argument too, the form TorchScript compiles."""
    scriptable = one_tensor and _one_tensor_in(module)
    handle = module.register_forward_hook(channels_first_output if scriptable else ChannelsFirstOutputs(), prepend=True)
    pickle_hooks_as(module, portable_form)
    return handle


def _channels_first(output: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.contiguous() if nhwc(t) else t, output)


def channels_first_outputs(module: torch.nn.Module, args: tuple, output: Any) -> Any:
    """A forward hook: ``output`` with its NHWC tensors made contiguous (channels first), which the
    layout audit counts as exits."""
    if in_graph_capture():
        return _channels_first(output)
    with exit_copies():
        return _channels_first(output)


def channels_first_output(module: Any, args: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    """:func:`channels_first_outputs` for a module of one tensor in and one out, in a form
    ``torch.jit.script`` compiles: a scripted model makes the output contiguous as eager does."""
    if torch.jit.is_scripting():
        return output.contiguous()
    return _eager_channels_first(module, args, output)


@torch.jit.unused
def _eager_channels_first(module: Any, args: Any, output: Any) -> Any:
    return channels_first_outputs(module, args, output)


class ChannelsFirstOutputs:
    """:func:`channels_first_outputs` as a hook that keeps the layout of the first outputs it gets eagerly, for
    its portable form (read once: a step's outputs keep their structure)."""

    def __init__(self) -> None:
        self.seen = False
        self.layout: Layout = None  # None: not seen yet, or outputs in a container the portable form cannot rebuild

    def __call__(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if not self.seen and not in_graph_capture():
            self.seen, self.layout = True, _layout(output)
        return channels_first_outputs(module, args, output)


def _layout(output: Any) -> Layout:
    """Per tensor of ``output``, whether the portable form makes it contiguous, through tuples, lists, dicts of
    str or int keys and namedtuples a module defines; None where tensors sit in another container. Each 4D/5D tensor
    that is NHWC or contiguous is (a no-op on a contiguous one): one contiguous here because the tensors before it
    were made so may come NHWC where the model runs loaded (its weights channels last)."""
    if isinstance(output, torch.Tensor):
        return nhwc(output) or (output.dim() in (4, 5) and output.is_contiguous())
    if type(output) in (tuple, list, dict) or _importable_namedtuple(type(output)):
        keys = list(output) if type(output) is dict else range(len(output))
        parts = {key: _layout(output[key]) for key in keys}
        whole = all(isinstance(key, (str, int)) for key in keys) and None not in parts.values()
        return (type(output), parts) if whole else None
    return None if tensors_in(output) else False


def portable_form(hook: Any) -> Any:
    """The form ``torch.save`` keeps of a hook of this module: a ``torch.fx.GraphModule`` making the same
    tensors contiguous; any other hook, and one whose outputs it cannot rebuild, as it is."""
    if hook is channels_first_output:
        return _graph_hook(True, 'output')
    if isinstance(hook, ChannelsFirstOutputs) and hook.layout is not None:
        return _graph_hook(hook.layout, 'outputs')
    return hook


def _graph_hook(layout: Layout, kind: str) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.placeholder('module')
    graph.placeholder('args')
    graph.output(_rebuilt(graph, graph.placeholder('output'), layout))
    hook = torch.fx.GraphModule(torch.nn.Module(), graph)
    hook.channels_first_hook = kind  # kept by pickling: how take_back knows it
    return hook


def _rebuilt(graph: torch.fx.Graph, node: torch.fx.Node, layout: Layout) -> Any:
    """``node`` with the tensors ``layout`` marks made contiguous; a container without one, as it is."""
    if layout is True:
        return graph.call_method('contiguous', (node,))
    if layout is False or True not in _marks(layout):
        return node
    kind, parts = layout
    rebuilt = {
        key: _rebuilt(graph, graph.call_function(operator.getitem, (node, key)), part) for key, part in parts.items()
    }
    if kind in (tuple, list, dict):
        return rebuilt if kind is dict else kind(rebuilt.values())
    return graph.call_function(kind, tuple(rebuilt.values()))  # a namedtuple


def _importable_namedtuple(kind: type) -> bool:
    """A namedtuple class a graph module's code can import by its module and name (one defined in a function cannot)."""
    if not (issubclass(kind, tuple) and hasattr(kind, '_fields')):
        return False
    found: Any = sys.modules.get(kind.__module__)
    for name in kind.__qualname__.split('.'):
        found = getattr(found, name, None)
    return found is kind


def _marks(layout: Layout) -> list[bool]:
    if isinstance(layout, bool):
        return [layout]
    return [mark for part in layout[1].values() for mark in _marks(part)]


def take_back(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Put this package's hook back in place of each portable form in ``model`` (a loaded model's, which then
    scripts again): the modules that carry one of its hooks. ``apply_channels_last`` calls it, as it puts the
    swapped layers back."""
    return [module for module in model.modules() if _taken_back(module)]


def _taken_back(module: torch.nn.Module) -> bool:
    hooks, portable = module._forward_hooks, False
    for key, hook in list(hooks.items()):
        kind = getattr(hook, 'channels_first_hook', None) if isinstance(hook, torch.fx.GraphModule) else None
        if kind is not None:
            scriptable = kind == 'output' and _one_tensor_in(module)
            hooks[key], portable = channels_first_output if scriptable else ChannelsFirstOutputs(), True
    if portable:
        pickle_hooks_as(module, portable_form)
    return any(hook is channels_first_output or isinstance(hook, ChannelsFirstOutputs) for hook in hooks.values())


class Placements:
    """The modules of ``model`` whose outputs are made channels first (those a loaded model's hooks name, at
    start), and the hooks on modules outside it (a teacher's), which :meth:`release_outside` takes off."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._modules: weakref.WeakSet = weakref.WeakSet(take_back(model))
        self._outside: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._pending: list[tuple[torch.nn.Module, bool, bool]] = []  # placed in the step under way

    def __contains__(self, module: torch.nn.Module) -> bool:
        return module in self._modules or any(module is pending for pending, _, _ in self._pending)

    def place(self, module: torch.nn.Module, one_tensor: bool, outside: bool) -> None:
        """Make ``module``'s NHWC outputs channels first (:func:`make_outputs_channels_first`) from :meth:`settle` on,
        not in the step under way: its backward may run the forward again (activation checkpointing), which must do
        as the forward did (selective checkpointing replays the forward's ops one by one)."""
        self._pending.append((module, one_tensor, outside))

    def settle(self) -> None:
        """Hook the modules placed since the last call: a watched step or forward is over."""
        pending, self._pending = self._pending, []
        for module, one_tensor, outside in pending:
            handle = make_outputs_channels_first(module, one_tensor)
            self._modules.add(module)
            if outside:
                self._outside[module] = handle

    def release_outside(self) -> list[torch.nn.Module]:
        """Take the hooks off the modules outside the model: they outlive the run. Those modules, to be placed
        again where a later run views their outputs."""
        self.settle()
        released = list(self._outside.items())
        for module, handle in released:
            handle.remove()
            stop_pickling_hooks_as(module)
            self._modules.discard(module)
        self._outside.clear()
        return [module for module, _ in released]


def _one_tensor_in(module: torch.nn.Module) -> bool:
    """Whether ``module.forward`` takes one argument (the hook TorchScript types as ``Tuple[Tensor]``)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1 and next(iter(parameters)).kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
