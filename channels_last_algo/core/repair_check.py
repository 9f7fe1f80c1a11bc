"""The repair check: a swapped layer stays only where it computes what its original computes, on the user's batch.

A repair rule replaces a layer by a subclass that keeps NHWC (:mod:`channels_last_algo.core.layers`).
The zoos show that each replacement gives the original's numbers, but a user's model can call a layer
in a way no zoo did. So :class:`RepairCheck` checks every swapped layer on its first call in the run:

- it runs the layer's forward twice more, from detached copies of the same inputs, with the same
  random state and buffer values: once as the replacement, once as the original class;
- it compares the outputs (dtype included: equal values in another dtype change every op after the
  layer) and, where the call records gradients, the gradients that a fixed random cotangent gives the
  inputs and the layer's parameters;
- each difference is relative to the largest magnitude among the original's outputs (or among its
  gradients), and must be within :data:`TOLERANCES` for its dtype.

A layer that passes keeps its replacement. A layer that fails gets its original class back, that
call's output is computed again by the original, and :attr:`RepairCheck.refused` names the layer
and the difference. Inside the extra passes, dispatch modes (the layout audit, a FLOP counter) and
module-call listeners are paused, so nothing records them. Afterwards the buffers and the random
state are as the real call left them. The cost is two forward and backward passes of each swapped
layer, once. A call under graph capture (``torch.compile``, ``torch.export``, ``jit.trace``) or
on tensor subclasses is not checked; the next plain call is. Layers inside a ``torch.compile``
wrapper are never called eagerly: the wrapper's first call ends their check, unchecked, and so does
a training step that shows no module call (``model.compile()``, a trainer's compile option). A first
call without gradients checks the outputs; in training mode the first call with gradients then
checks the gradients too, and in evaluation mode (inference only, or an evaluation before
training) the check ends there.

Example:
    >>> import torch
    >>> from channels_last_algo.core.convert import apply_channels_last
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.InstanceNorm2d(8))
    >>> check = RepairCheck(model, apply_channels_last(model).repaired)
    >>> check.start()
    >>> _ = model(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    >>> check.done, check.refused, type(model[1]).__name__
    (True, [], 'ChannelsLastInstanceNorm2d')
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only

from channels_last_algo.core import module_calls
from channels_last_algo.core.saved_state import AttributeState, SavedState
from channels_last_algo.core.swap import qualified_name, swap_back
from channels_last_algo.core.swap_records import SwapRecord

__all__ = ['TOLERANCES', 'RefusedRepair', 'RepairCheck']

log = logging.getLogger(__name__)

TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
"""Largest difference allowed, relative to the largest magnitude of the original's outputs (or gradients), by dtype."""


@dataclasses.dataclass(frozen=True)
class RefusedRepair:
    """A swap the check took back: the record of the swap, and how the replacement differed."""

    record: SwapRecord
    reason: str

    def __str__(self) -> str:
        original = self.record.original.rpartition('.')[2]
        return f'{self.record.path or "(root)"} ({self.record.reason}): {self.reason}; it runs as {original} again'


@dataclasses.dataclass
class _Pending:
    module: weakref.ref
    record: SwapRecord
    original: type
    outputs_checked: bool = False  # a call without gradients checked the outputs; the gradients wait


def _plain_tensors(tree: Any) -> bool:
    """Whether every tensor of ``tree`` is a real tensor (no subclass, fake or meta tensor)."""
    tensors = [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != 'meta' for t in tensors)


def _floats(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _side_run(
    forward: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict, gradients: bool
) -> tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]:
    """``forward(module, ...)`` on detached copies of the inputs: its float outputs, and with
    ``gradients`` the gradients of a fixed cotangent for the inputs and the parameters."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        copy = t.detach().clone(memory_format=torch.preserve_format)
        return copy.requires_grad_(gradients and t.is_floating_point())

    args, kwargs = tree_map_only(torch.Tensor, leaf, (args, kwargs))
    with torch.set_grad_enabled(gradients):
        outputs = _floats(forward(module, *args, **kwargs))
    if not gradients:
        return outputs, []
    targets = [t for t in outputs if t.requires_grad]
    wrt = [t for t in _floats((args, kwargs)) if t.requires_grad] + [p for p in module.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    cotangents = [torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device) for t in targets]
    grads = torch.autograd.grad(targets, wrt, cotangents, allow_unused=True) if targets and wrt else ()
    return [t.detach() for t in outputs], list(grads)


def _largest(tensors: list[Optional[torch.Tensor]]) -> float:
    """The largest finite magnitude in ``tensors`` (a tiny number where there is none)."""
    found = [
        torch.nan_to_num(t.double(), posinf=0, neginf=0).abs().max().item()
        for t in tensors
        if t is not None and t.numel()
    ]
    return max(found + [1e-30])


def _difference(what: str, expected: list, actual: list) -> Optional[str]:
    """How ``actual`` differs from ``expected`` beyond :data:`TOLERANCES`, relative to the largest
    magnitude of all of ``expected`` (a gradient that is zero in exact arithmetic, such as a bias before
    a norm, holds rounding noise only); None where it does not."""
    if len(expected) != len(actual):
        return f'its {what} has another structure ({len(actual)} tensors, the original {len(expected)})'
    scale = _largest(expected)
    for e, a in zip(expected, actual):
        if e is None or a is None:
            if (e is None) != (a is None):
                return f'its {what} is missing where the original has one, or the other way round'
            continue
        if e.shape != a.shape:
            return f'its {what} has shape {tuple(a.shape)}, the original {tuple(e.shape)}'
        if e.dtype != a.dtype:  # equal values in another dtype still change every op after the layer
            return f'its {what} is {a.dtype}, the original {e.dtype}'
        same_nan = torch.isnan(e) == torch.isnan(a)
        error = (torch.nan_to_num(a.double()) - torch.nan_to_num(e.double())).abs().max().item() if e.numel() else 0
        tolerance = TOLERANCES.get(e.dtype, TOLERANCES[torch.float32])
        if not bool(same_nan.all()) or error / scale > tolerance:
            return f'{what} differs by {error / scale:.1e} (tolerance {tolerance:.0e})'
    return None


class RepairCheck:
    """Checks each layer of ``model`` that ``records`` (kind ``'repair'``) name on its first call; see
    the module docstring.

    Attributes:
        refused: the swaps taken back, in the order they failed.
    """

    def __init__(self, model: torch.nn.Module, records: Sequence[SwapRecord]) -> None:
        self.refused: list[RefusedRepair] = []
        self._pending: dict[int, _Pending] = {}
        self._entered: dict[int, SavedState] = {}
        self._calls_seen = False  # a module call was seen since the last end_step
        for record in records:
            if record.kind != 'repair':
                continue
            module = model.get_submodule(record.path)
            original = next(c for c in type(module).__mro__ if qualified_name(c) == record.original)
            self._pending[id(module)] = _Pending(weakref.ref(module), record, original)

    def start(self) -> None:
        """Follow module calls (from the batch before the model's first call) until every layer is checked."""
        if self._pending:
            module_calls.subscribe(self)

    @property
    def done(self) -> bool:
        """True once every layer was checked (or collected)."""
        return not self._pending

    def entered(self, module: torch.nn.Module, args: tuple) -> None:
        self._calls_seen = True
        if module_calls.compiled_wrapper(module):  # its insides run as a graph
            self._skip_compiled(module_calls.compiled_network(module))
        pending = self._pending.get(id(module))
        if pending is None or pending.module() is not module or module_calls.in_graph_capture():
            return
        if pending.outputs_checked and not torch.is_grad_enabled():
            return
        if _plain_tensors((args, list(module.parameters()))):
            self._entered[id(module)] = SavedState(module)

    def left(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any, failed: bool) -> Any:
        before = self._entered.pop(id(module), None)
        if before is None or failed:
            return None
        pending = self._pending[id(module)]
        gradients = torch.is_grad_enabled()
        after, attributes = SavedState(), AttributeState(module)  # the random state and attributes the real call left
        with module_calls.paused(), _disable_current_modes():
            reason = self._compare(pending, module, args, kwargs, before, gradients)
        after.restore_random_state()
        attributes.put_back()
        if reason is None:
            pending.outputs_checked = True
            if gradients or not module.training:
                self._finish(module)
            return None
        self._finish(module)
        self.refused.append(RefusedRepair(pending.record, reason))
        swap_back(module, pending.original)
        before.restore()
        return pending.original.forward(module, *args, **kwargs)

    @staticmethod
    def _compare(
        pending: _Pending, module: torch.nn.Module, args: tuple, kwargs: dict, before: SavedState, gradients: bool
    ) -> Optional[str]:
        runs = []
        for forward in (type(module).forward, pending.original.forward):
            before.restore_random_state()
            with before.buffer_copies():
                runs.append(_side_run(forward, module, args, kwargs, gradients))
        (swapped_out, swapped_grads), (original_out, original_grads) = runs
        return _difference('output', original_out, swapped_out) or _difference(
            'gradient', original_grads, swapped_grads
        )

    def _skip_compiled(self, model: torch.nn.Module) -> None:
        """The layers of a compiled ``model`` are never called eagerly: no check for them."""
        inside = {id(m) for m in model.modules()} & set(self._pending)
        for key in inside:
            log.info('repair check: %s runs compiled, not checked', self._pending[key].record.path)
            self._finish_key(key)

    def _finish(self, module: torch.nn.Module) -> None:
        self._finish_key(id(module))

    def _finish_key(self, key: int) -> None:
        del self._pending[key]
        if not self._pending:
            module_calls.unsubscribe(self)

    def end_step(self) -> None:
        """A training step ended. Where it showed no module call, the model runs as a compiled graph
        (``model.compile()``, a trainer's compile option): nothing will be checked, so stop."""
        if self._pending and not self._calls_seen:
            log.info('repair check: the model runs compiled; %d swapped layers not checked', len(self._pending))
            self.close()
        self._calls_seen = False

    def close(self) -> None:
        """Check nothing more (the layers not checked yet keep their replacement)."""
        self._pending.clear()
        module_calls.unsubscribe(self)
