"""The check of a fused copy on the example input: it must run, and compute what the model does.

The copy's output is compared with the model's, leaf by leaf, relative to each leaf's largest
magnitude. Where they differ in float32 by more than ``rtol``, or in shape (a detector's score
threshold, top-k and NMS turn a rounding difference into another box, or none), both are run again
in float64, where rounding is too small to move such a decision, and each leaf's values are compared
sorted (boxes of equal scores may come in either order): a fused copy that is right agrees there
within :data:`FLOAT64_RTOL`, and a wrong one (a trace that took another branch, a run fused where
other code reads its middle) does not.

Example:
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    >>> check = ExampleCheck(net, torch.randn(1, 3, 8, 8), 'eager', rtol=1e-4)
    >>> without_relu = check.mismatch(net[0], lambda model: model[0])  # a copy that lost the ReLU
    >>> without_relu > 0.1, check.mismatch(net, lambda model: model)
    (True, None)
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from channels_last_algo.core.argument_checks import example_input_error, why
from channels_last_algo.core.saved_state import AttributeState

__all__ = ['FLOAT64_RTOL', 'ExampleCheck', 'max_relative_error']

log = logging.getLogger(__name__)

FLOAT64_RTOL = 1e-8  # float64 rounding leaves about 1e-13 through a deep network; a wrong copy, far more


def max_relative_error(actual: Any, expected: Any, any_order: bool = False) -> float:
    """The largest difference of ``actual``'s floating leaves from ``expected``'s, each relative to the
    expected leaf's largest magnitude; infinite where their structure or a shape differs. ``any_order``:
    of each leaf's values sorted (boxes of equal scores come in either order)."""
    actual_leaves, expected_leaves = tree_flatten(actual)[0], tree_flatten(expected)[0]
    if len(actual_leaves) != len(expected_leaves):
        return math.inf
    errors = [0.0]
    for a, e in zip(actual_leaves, expected_leaves):
        if not (isinstance(e, torch.Tensor) and e.is_floating_point()):
            continue
        if not isinstance(a, torch.Tensor) or a.shape != e.shape:
            return math.inf
        if e.numel():
            a, e = a.detach().double(), e.detach().double()
            if any_order:
                a, e = a.flatten().sort().values, e.flatten().sort().values
            errors.append((a - e).abs().max().item() / (e.abs().max().item() or 1.0))
    return max(errors)


def _in_float64(value: Any) -> Any:
    return tree_map(
        lambda leaf: leaf.double() if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf, value
    )


def _nudged(value: Any) -> Any:
    """``value`` with 1e-12 of each floating tensor's largest magnitude added as noise, the same each call."""
    generator = torch.Generator().manual_seed(0)

    def nudge(leaf: Any) -> Any:
        if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel()):
            return leaf
        noise = torch.randn(leaf.shape, generator=generator, dtype=leaf.dtype).to(leaf.device)
        return leaf + noise * leaf.abs().max() * 1e-12

    return tree_map(nudge, value)


def _module_outputs(network: nn.Module, inputs: tuple) -> dict[str, tuple[type, Any]]:
    """The type and the output at its first call of ``network`` (path ``''``) and of each module in its top
    two levels, run on ``inputs``; each output copied as it is returned (a later in-place op changes it)."""
    outputs: dict[str, tuple[type, Any]] = {}

    def keep(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            copied = tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, output)
            outputs.setdefault(path, (type(module), copied))

        return hook

    modules = [(path, module) for path, module in network.named_modules() if path.count('.') < 2]
    handles = [module.register_forward_hook(keep(path)) for path, module in modules]
    try:
        network(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


class ExampleCheck:
    """The check of a fused copy on the example input, the model's output computed once, first: a model that
    raises on the example raises :class:`~channels_last_algo.core.argument_checks.ExampleInputError`."""

    def __init__(self, model: nn.Module, example_input: Any, backend: str, rtol: float) -> None:
        self.model = model
        self.inputs = example_input if isinstance(example_input, tuple) or example_input is None else (example_input,)
        self.backend = backend
        self.rtol = rtol
        self._expected: list[Any] = []
        if self.inputs is None:
            return
        attributes = AttributeState(model)  # an extra call: what the forward counts is put back
        try:
            with torch.no_grad():
                self._expected.append(model(*self.inputs))
        except Exception as error:  # whatever the model's forward raises on arguments it does not take
            raise example_input_error('fuse_for_inference', model, error, ', or None to check nothing') from error
        finally:
            attributes.put_back()

    def fails(self, network: nn.Module) -> Optional[str]:
        """Why ``network`` raises on the example input (a trace that took a branch the model does not
        take: ``isinstance(skip, Tensor)`` is False for a tracing proxy), or None."""
        if self.inputs is None:
            return None
        try:  # fx prints a failing graph's code to stderr: the module route is taken, and says why
            with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
                network(*self.inputs)
        except Exception as error:  # any op of the traced graph may refuse what the wrong branch gives it
            return why(error)
        return None

    def mismatch(
        self, fused: Callable[..., Any], remake: Callable[[nn.Module], nn.Module], by_module: bool = False
    ) -> Optional[float]:
        """The relative error of ``fused`` when over ``rtol``, and over :data:`FLOAT64_RTOL` for the network
        ``remake`` makes of a float64 copy of the model (``by_module``: see :meth:`_float64_error`); None when
        within, or with no example."""
        if self.inputs is None:
            return None
        with torch.no_grad():
            error = max_relative_error(self._run(fused), self._expected[0])
        if error <= self.rtol:
            return None
        in_float64 = self._float64_error(remake, by_module)
        if in_float64 is not None and in_float64 <= FLOAT64_RTOL:
            log.info(
                '%s: the fused copy differs from it by %.2e on the example input, and by %.2e in float64: a '
                'decision in the model (a threshold, top-k, NMS) amplifies the rounding of float32',
                type(self.model).__name__,
                error,
                in_float64,
            )
            return None
        return error

    def _float64_error(self, remake: Callable[[nn.Module], nn.Module], by_module: bool) -> Optional[float]:
        """The relative error, values in any order, of the network ``remake`` makes of a float64 copy of the
        model; None where they do not run in float64. ``by_module``, where the model's own output moves when
        its input is nudged by 1e-12 (near-equal scores decide it), that of the outputs of its top two levels
        of modules that do not move and that the network has unchanged (a module route's network)."""
        try:
            with torch.no_grad():
                inputs, model = _in_float64(self.inputs), copy.deepcopy(self.model).double()
                expected, actual = _module_outputs(model, inputs), _module_outputs(remake(copy.deepcopy(model)), inputs)
                error = max_relative_error(actual[''][1], expected[''][1], any_order=True)
                if error <= FLOAT64_RTOL or not by_module:
                    return error
                moved = _module_outputs(model, _nudged(inputs))
        except Exception as failure:  # a model may hold float32 constants, or ops without a float64 kernel
            log.debug('%s: no float64 check (%s)', type(self.model).__name__, why(failure))
            return None
        steady = [path for path in expected if max_relative_error(moved[path][1], expected[path][1]) <= FLOAT64_RTOL]
        shared = [path for path in steady if path in actual and actual[path][0] is expected[path][0]]
        if '' in steady or not shared:
            return error
        return max(max_relative_error(actual[path][1], expected[path][1]) for path in shared)

    def _run(self, fused: Callable[..., Any]) -> Any:
        """``fused`` on the example input; a ``torch.compile`` failure (inductor) as one RuntimeError."""
        try:
            return fused(*self.inputs)
        except Exception as error:  # what torch.compile raises is any of dynamo's and inductor's errors
            if self.backend == 'eager':
                raise
            raise RuntimeError(
                f'fuse_for_inference(backend={self.backend!r}): torch.compile failed on the fused '
                f'{type(self.model).__name__}: {why(error)}; '
                "use backend='eager' (the fused kernels without compiling)"
            ) from error
