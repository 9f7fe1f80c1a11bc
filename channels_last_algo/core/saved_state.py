"""The random state, the buffer values and the plain attributes of a module at one moment, for an extra pass that
must leave no trace.

The repair check runs a swapped layer's original beside it, and the view watch rehearses a compiled
forward eagerly: each pass draws random numbers, updates running statistics and advances what a forward
counts in attributes of its own (``self.calls += 1``, a warm-up ramp) that the real pass must not see.

Example:
    >>> import torch
    >>> bn = torch.nn.BatchNorm2d(3)
    >>> state = SavedState(bn)
    >>> with state.buffer_copies(bn):
    ...     _ = bn(torch.randn(2, 3, 4, 4))
    >>> state.restore_random_state()
    >>> bn.running_mean.abs().sum().item(), int(bn.num_batches_tracked)
    (0.0, 0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch

__all__ = ['SavedState', 'leaving_no_trace', 'plain_attributes', 'put_back']

_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # torch's own attributes of every module
_PLAIN = frozenset({bool, int, float, complex, str, bytes, type(None)})


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


class SavedState:
    """The random state (CPU and CUDA), the values of ``module``'s buffers and its plain attributes now. Buffers are
    written back through ``.data``: a graph that saved them (BatchNorm's) keeps its version counters."""

    def __init__(self, module: Optional[torch.nn.Module] = None) -> None:
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.buffers = [] if module is None else [(b, b.detach().clone()) for b in module.buffers()]
        self.attributes = [] if module is None else plain_attributes(module)

    def restore_random_state(self) -> None:
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def restore(self) -> None:
        """The random state, the buffer values and the plain attributes as they were."""
        self.restore_random_state()
        put_back(self.attributes)
        with torch.no_grad():
            for buffer, value in self.buffers:
                buffer.data.copy_(value)

    @contextlib.contextmanager
    def buffer_copies(self, module: torch.nn.Module) -> Iterator[None]:
        """Inside, every buffer of ``module`` is a copy of its saved value: an extra pass updates the
        copies, and the real buffers keep their values and version counters."""
        values = {id(buffer): value for buffer, value in self.buffers}
        held = [(m, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None]
        for owner, name, buffer in held:
            owner._buffers[name] = values[id(buffer)].clone(memory_format=torch.preserve_format)
        try:
            yield
        finally:
            for owner, name, buffer in held:
                owner._buffers[name] = buffer


@contextlib.contextmanager
def leaving_no_trace(module: torch.nn.Module) -> Iterator[None]:
    """An extra pass of ``module`` inside: on copies of its buffers, and the random state and plain attributes put
    back after.

    Example:
        >>> bn = torch.nn.BatchNorm2d(3)
        >>> with leaving_no_trace(bn):
        ...     _ = bn(torch.randn(2, 3, 4, 4))
        >>> int(bn.num_batches_tracked)
        0
    """
    state = SavedState(module)
    try:
        with state.buffer_copies(module):
            yield
    finally:
        state.restore_random_state()
        put_back(state.attributes)
