"""A module whose forward hooks pickle in another form than they run in.

``torch.save(model)`` pickles each module's forward hooks with it, a function by the name of its module, so
a hook of this package would make the saved model load only where the package is installed.
:func:`pickle_hooks_as` gives one module a pickled state in which each forward hook is ``form(hook)``: a
form torch alone loads (:mod:`~channels_last_algo.core.channels_first_outputs` gives its hooks one).
``copy.deepcopy`` (EMA, ``AveragedModel``, Lightning's copies) keeps the hooks as they run. The module's
class is not touched: its own ``__getstate__`` and ``__deepcopy__`` (a parametrized module's, a swapped
layer's) still make the state; the form only replaces hooks in it. :func:`stop_pickling_hooks_as` undoes it.

Example:
    >>> import copy, pickle, torch
    >>> relu = torch.nn.ReLU()
    >>> _ = relu.register_forward_hook(print)
    >>> pickle_hooks_as(relu, repr)
    >>> pickled, copied = pickle.loads(pickle.dumps(relu)), copy.deepcopy(relu)
    >>> list(pickled._forward_hooks.values()), list(copied._forward_hooks.values())
    (['<built-in function print>'], [<built-in function print>])
"""

from __future__ import annotations

import collections
import types
from collections.abc import Callable
from typing import Any

import torch

from channels_last_algo.core.swap import deep_copy_from_state

__all__ = ['pickle_hooks_as', 'stop_pickling_hooks_as']

_OWN = ('__getstate__', '__deepcopy__', '_hook_pickling_form')  # what pickle_hooks_as puts on the module


def pickle_hooks_as(module: torch.nn.Module, form: Callable[[Any], Any]) -> None:
    """From now on ``module`` pickles with ``form(hook)`` in place of each forward hook; copies keep the hooks."""
    own = vars(module)  # not through Module.__setattr__: a form that is a module is no submodule
    own['_hook_pickling_form'] = form
    own['__getstate__'] = types.MethodType(_pickled_state, module)  # found on the instance before the class
    own['__deepcopy__'] = types.MethodType(_deep_copy, module)


def stop_pickling_hooks_as(module: torch.nn.Module) -> None:
    """``module`` pickles as its class makes it again."""
    for name in _OWN:
        vars(module).pop(name, None)


def _pickled_state(module: torch.nn.Module) -> Any:
    state = type(module).__getstate__(module)  # the class's own: a parametrized module's refuses pickling
    if not isinstance(state, dict):  # a class's own kind of state: as it makes it
        return state
    state = {name: value for name, value in state.items() if name not in _OWN}
    form = vars(module)['_hook_pickling_form']
    if '_forward_hooks' in state:
        state['_forward_hooks'] = collections.OrderedDict((key, form(h)) for key, h in state['_forward_hooks'].items())
    return state


def _deep_copy(module: torch.nn.Module, memo: dict) -> torch.nn.Module:
    """``copy.deepcopy`` as without the pickled form: the class's own, else the state copied (methods bound to
    ``module`` in it are bound to the copy, so the copy pickles in the form too)."""
    cls = type(module)
    if hasattr(cls, '__deepcopy__'):
        return cls.__deepcopy__(module, memo)
    return deep_copy_from_state(module, cls.__getstate__(module), memo)
