"""The random state, the buffer values and the attributes of a module at one moment, for an extra pass that
must leave no trace.

The repair check runs a swapped layer's original beside it, and the view watch rehearses a compiled
forward eagerly: each pass draws random numbers, updates running statistics and advances what a forward
counts in attributes of its own (``self.calls += 1``, a warm-up ramp) or collects in them (a list of losses, a
metric's state) that the real pass must not see.

Example:
    >>> import torch
    >>> bn = torch.nn.BatchNorm2d(3)
    >>> state = SavedState(bn)
    >>> with state.buffer_copies():
    ...     _ = bn(torch.randn(2, 3, 4, 4))
    >>> state.restore_random_state()
    >>> bn.running_mean.abs().sum().item(), int(bn.num_batches_tracked)
    (0.0, 0)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
from collections.abc import Callable, Iterator
from typing import Any, Optional

import numpy as np
import torch
from torch.nn.parameter import is_lazy

__all__ = [
    'AttributeState',
    'BufferState',
    'ParameterValues',
    'RandomStates',
    'SavedState',
    'leaving_no_trace',
    'plain_attributes',
    'put_back',
    'random_states_kept',
]

_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # torch's own attributes of every module
_PLAIN = frozenset({bool, int, float, complex, str, bytes, type(None)})
_CONTAINERS = (list, dict, set, collections.deque)
_BY_VALUE_UP_TO = 1 << 20  # elements: a tensor kept in an attribute (a metric's state) is saved by value up to this


def plain_attributes(module: torch.nn.Module) -> list[tuple[dict, str, Any]]:
    """Where ``module`` and its submodules hold plain values (numbers, strings, None) in attributes of their own, and
    the values now: what a forward that counts its calls rebinds.

    Example:
        >>> counter = torch.nn.Identity()
        >>> counter.calls = 0
        >>> saved = plain_attributes(counter)
        >>> counter.calls += 1
        >>> put_back(saved)
        >>> counter.calls
        0
    """
    return [
        (vars(m), key, value)
        for m in module.modules()
        for key, value in list(vars(m).items())
        if key not in _MODULE_INTERNALS and type(value) in _PLAIN
    ]


def put_back(attributes: list[tuple[dict, str, Any]]) -> None:
    """The attributes :func:`plain_attributes` read, as they were then."""
    for namespace, key, value in attributes:
        namespace[key] = value


def _kept(value: Any) -> bool:
    """State a pass may rebind or fill: a plain value, a container, a tensor (never a function or module)."""
    return type(value) in _PLAIN or isinstance(value, (*_CONTAINERS, torch.Tensor))


def _refill(value: Any) -> Callable[[], Any]:
    """What puts ``value``'s contents back as they are now: a tensor's values (up to :data:`_BY_VALUE_UP_TO`
    elements), a container's items and the values of the tensors among them (up to as many in all: a dataset kept
    in a list is not copied); nothing for the rest."""
    if isinstance(value, torch.Tensor) and value.numel() <= _BY_VALUE_UP_TO:
        saved = value.detach().clone()
        return lambda: value.data.copy_(saved) if value.shape == saved.shape else None
    if not isinstance(value, _CONTAINERS):
        return lambda: None
    items = list(value.items()) if isinstance(value, dict) else list(value)
    tensors = [
        item for item in (value.values() if isinstance(value, dict) else value) if isinstance(item, torch.Tensor)
    ]
    inner = [_refill(tensor) for tensor in tensors] if sum(t.numel() for t in tensors) <= _BY_VALUE_UP_TO else []
    held = _held(value)

    def refill() -> None:
        if _held(value) != held:  # only a container the pass changed: one that refuses changes (diffusers'
            value.clear()  # FrozenDict config) is left as it is
            value.update(items) if isinstance(value, (dict, set)) else value.extend(items)
        for tensor in inner:
            tensor()

    return refill


def _held(container: Any) -> list[int]:
    """Which objects ``container`` holds, by identity (a dict's keys and values, in order; a set's in any)."""
    if isinstance(container, dict):
        return [id(part) for item in container.items() for part in item]
    return sorted(map(id, container)) if isinstance(container, set) else [id(item) for item in container]


class AttributeState:
    """What ``module`` and its submodules hold in attributes of their own (not parameters, buffers, submodules or
    hooks) at one moment: plain values a pass rebinds (``self.calls += 1``), lists, dicts and sets it fills
    (``self.outputs.append(loss)``) and tensors it updates (a torchmetrics metric's state). :meth:`put_back`
    restores them and drops such attributes the pass added; functions and other objects stay as they are.

    Example:
        >>> head = torch.nn.Linear(2, 2)
        >>> head.outputs, head.calls = [], 0
        >>> state = AttributeState(head)
        >>> head.outputs.append(1.0); head.calls += 1; head.first = torch.ones(1)
        >>> state.put_back()
        >>> head.outputs, head.calls, hasattr(head, 'first')
        ([], 0, False)
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._saved = [
            (vars(m), {key: (value, _refill(value)) for key, value in vars(m).items() if _own(key, value)})
            for m in module.modules()
        ]

    def put_back(self) -> None:
        for namespace, saved in self._saved:
            for key in [key for key, value in namespace.items() if key not in saved and _own(key, value)]:
                del namespace[key]
            for key, (value, refill) in saved.items():
                namespace[key] = value
                refill()


def _own(key: str, value: Any) -> bool:
    return key not in _MODULE_INTERNALS and _kept(value)


@dataclasses.dataclass(frozen=True)
class RandomStates:
    """The torch (CPU and, once initialized, CUDA), Python and NumPy random states at one moment."""

    cpu: torch.Tensor
    cuda: Optional[list[torch.Tensor]]
    python: Any
    numpy: Any

    @classmethod
    def take(cls) -> RandomStates:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), cuda, random.getstate(), np.random.get_state())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        np.random.set_state(self.numpy)


@contextlib.contextmanager
def random_states_kept() -> Iterator[None]:
    """Inside, draw freely (a batch taken from a loader ahead of its loop): every random state is put back after.

    Example:
        >>> with random_states_kept():
        ...     drawn = torch.rand(1)
        >>> bool(torch.rand(1) == drawn)
        True
    """
    states = RandomStates.take()
    try:
        yield
    finally:
        states.restore()


class BufferState:
    """``module``'s buffers where they are held (a module and a name) and their values now. :meth:`restore` binds
    each object to its name again, where a pass bound another (``self.ema = 0.9 * self.ema + ...``), and writes its
    values back through ``.data``: a graph that saved it (BatchNorm's) keeps its version counter. A buffer a pass
    registers (a cache made on the first call) stays."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.held = [
            (owner, name, buffer, buffer.detach().clone())
            for owner in module.modules()
            for name, buffer in owner._buffers.items()
            if buffer is not None
        ]

    def restore(self) -> None:
        with torch.no_grad():
            for owner, name, buffer, value in self.held:
                owner._buffers[name] = buffer
                if buffer.shape == value.shape:
                    buffer.data.copy_(value)
                else:  # resized in place
                    buffer.data = value.clone()


class ParameterValues:
    """The values of ``module``'s parameters now, for a pass whose forward may write them in place where no
    optimizer does (an EMA codebook kept as a frozen ``Parameter``, a gain clamped through ``.data``).
    :meth:`restore` writes them back through ``.data``, into each parameter's layout now, so its version counter
    (which a saved graph checks) stays as it is. Parameters not materialized yet (lazy modules) are left alone.

    Example:
        >>> scale = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        >>> holder = torch.nn.Module(); holder.scale = scale
        >>> values = ParameterValues(holder)
        >>> _ = scale.mul_(0.5)
        >>> values.restore()
        >>> scale.tolist()
        [1.0, 1.0]
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.held = [(p, p.detach().clone()) for p in module.parameters() if not is_lazy(p)]

    def restore(self) -> None:
        with torch.no_grad():
            for parameter, value in self.held:
                if parameter.shape == value.shape:
                    parameter.data.copy_(value)


class SavedState:
    """The random states, the values of ``module``'s buffers (:class:`BufferState`) and parameters
    (:class:`ParameterValues`), and its attributes now."""

    def __init__(self, module: Optional[torch.nn.Module] = None) -> None:
        self.random = RandomStates.take()
        self.buffers = None if module is None else BufferState(module)
        self.parameters = None if module is None else ParameterValues(module)
        self.attributes = None if module is None else AttributeState(module)

    def restore_random_state(self) -> None:
        self.random.restore()

    def restore(self) -> None:
        """The random state, the buffer and parameter values and the attributes as they were."""
        self.restore_random_state()
        if self.attributes is not None:
            self.attributes.put_back()
        if self.buffers is not None:
            self.buffers.restore()
        if self.parameters is not None:
            self.parameters.restore()

    @contextlib.contextmanager
    def buffer_copies(self) -> Iterator[None]:
        """Inside, every buffer saved is a copy of its saved value, where it is held: an extra pass updates the
        copies, and the buffers held now (the same objects, or those a pass since bound there) keep their values
        and version counters."""
        held = [(owner, name, owner._buffers.get(name), value) for owner, name, _, value in self.buffers.held]
        for owner, name, _, value in held:
            owner._buffers[name] = value.clone(memory_format=torch.preserve_format)
        try:
            yield
        finally:
            for owner, name, now, _ in held:
                owner._buffers[name] = now


@contextlib.contextmanager
def leaving_no_trace(module: torch.nn.Module) -> Iterator[None]:
    """An extra pass of ``module`` inside: on copies of its buffers, and the random state, the parameters' values
    and the attributes put back after.

    Example:
        >>> bn = torch.nn.BatchNorm2d(3)
        >>> with leaving_no_trace(bn):
        ...     _ = bn(torch.randn(2, 3, 4, 4))
        >>> int(bn.num_batches_tracked)
        0
    """
    state = SavedState(module)
    try:
        with state.buffer_copies():
            yield
    finally:
        state.restore_random_state()
        state.parameters.restore()
        state.attributes.put_back()
