"""The fused inference copy: :func:`fuse_for_inference` and the :class:`InferenceModel` it returns.

The fx route (:mod:`.graph`) is tried first; where the model does not trace, or its traced
copy does not match the model on the example input, the module route (:mod:`.modules`)
is taken. Either way the copy is restrided to channels last, holds no parameter requiring
grad, and runs the fused kernels from Python (``backend='eager'``), or is compiled by
``torch.compile`` with inductor's freezing (``backend='inductor'``). A warning names the
BatchNorms left unfused (``summary.unfused``).

Example:
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    >>> x = torch.randn(2, 3, 16, 16)
    >>> fused = fuse_for_inference(net, x)
    >>> str(fused.summary)
    'fx: 1 convolutions fused, 1 of 1 BatchNorms folded, 1 with an activation, 0 with a residual add'
    >>> torch.testing.assert_close(fused(x), net(x), rtol=1e-4, atol=1e-5)
"""

from __future__ import annotations

import copy
import functools
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from channels_last_algo.core.argument_checks import require_flags, require_module, require_positive, why
from channels_last_algo.core.convert import convert_quietly
from channels_last_algo.core.fuse.conv import FusedConv2d
from channels_last_algo.core.fuse.example_check import ExampleCheck
from channels_last_algo.core.fuse.graph import called_whole, fuse_graph, optional_inputs_used, trace
from channels_last_algo.core.fuse.modules import fuse_modules
from channels_last_algo.core.fuse.subgraphs import fuse_subgraphs
from channels_last_algo.core.fuse.summary import FusionSummary
from channels_last_algo.core.layout import batch_to_channels_last
from channels_last_algo.core.module_calls import is_torchscript
from channels_last_algo.core.viewed_outputs import ViewedOutputs

__all__ = ['BACKENDS', 'InferenceModel', 'fuse_for_inference']

log = logging.getLogger(__name__)

BACKENDS = ('eager', 'inductor')


class InferenceModel(nn.Module):
    """The eval-only fused copy :func:`fuse_for_inference` returns.

    ``forward`` takes what the original model took; 4D and 5D input tensors are put in NHWC
    first (no copy when they already are). It refuses to run in train mode or on an input
    that requires grad while grad mode is on.

    Attributes:
        module: the fused network (a ``torch.fx.GraphModule`` on the fx route), compiled
            (``torch.compile``'s wrapper around it) with ``backend='inductor'``.
        summary: the :class:`~channels_last_algo.core.fuse.summary.FusionSummary`.
    """

    def __init__(self, module: nn.Module, summary: FusionSummary) -> None:
        super().__init__()
        self.module = module
        self.summary = summary

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training:
            raise RuntimeError(
                'this fused inference copy is in train mode; it is eval-only (BatchNorm is folded, it has no '
                'backward). Call .eval() on it, or train the original model and fuse it again afterwards.'
            )
        if torch.is_grad_enabled() and any(
            isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in tree_flatten((args, kwargs))[0]
        ):
            raise RuntimeError(
                'an input to the fused inference copy requires grad; it has no backward (the fused kernels have '
                'no gradient and its weights are detached copies). Run it under torch.no_grad() or '
                'torch.inference_mode(), or differentiate the original model.'
            )
        args, kwargs = batch_to_channels_last((args, kwargs))
        watch = _watches.get(self, ...)
        if watch is None:  # watched once, nothing left to watch
            return self._call(args, kwargs)
        if watch is ...:  # the first call
            watch = _watches[self] = ViewedOutputs(self.module)
        return self._watched_call(watch, args, kwargs)

    def _watched_call(self, watch: ViewedOutputs, args: tuple, kwargs: dict) -> Any:
        """A call under the view watch: modules whose outputs code views make them channels first from then on;
        where a view reads what no module made, or an extension op takes 4D tensors, every call stays watched."""
        watch.start()
        try:
            output = self._call(args, kwargs)
        finally:
            found = watch.stop()
        self.summary.viewed = list(watch.placed)
        if watch.unplaced or watch.extensions:  # each call is watched, as each training step then is
            if found:
                warnings.warn(
                    f'fuse_for_inference: {"; ".join(found)} (each call of the copy is watched)', stacklevel=2
                )
        else:
            _watches[self] = None
            for line in found:
                log.info('fuse_for_inference: %s', line)
        return output

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if self.summary.backend == 'inductor':
            import torch._inductor.config as inductor_config

            # freezing (weights as constants: folded, prepacked) applies to graphs compiled without grad
            with torch.no_grad(), inductor_config.patch(freezing=True):
                return self.module(*args, **kwargs)
        return self.module(*args, **kwargs)


# each copy's view watch: absent before its first call, None once nothing is left to watch (a copy or a pickle of
# the copy, which holds the hooks placed, is watched once again)
_watches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_arguments(model: nn.Module, traceable: bool, backend: str, rtol: float) -> None:
    require_positive('fuse_for_inference', rtol=rtol)
    if backend not in BACKENDS:
        raise ValueError(f'fuse_for_inference: backend must be one of {BACKENDS}, got {backend!r}')
    if traceable and backend != 'eager':
        raise ValueError(
            f"fuse_for_inference: traceable=True (a copy for torch.export) needs backend='eager', got "
            f'{backend!r}; export the eager copy, or compile without traceable'
        )
    if is_torchscript(model):
        raise ValueError(
            f'fuse_for_inference: the model is TorchScript ({type(model).__name__}, from torch.jit.script or '
            'trace), whose code cannot be traced nor its layers replaced; pass the nn.Module it was made from'
        )
    training = next(((name, m) for name, m in model.named_modules() if m.training), None)
    if training is not None:
        name, module = training
        where = f'its submodule {name!r} ({type(module).__name__})' if name else 'it'
        raise ValueError(
            f'fuse_for_inference needs {type(model).__name__} in eval mode, but {where} is in train mode, where '
            'BatchNorm uses batch statistics (nothing to fold) and Dropout is active; call model.eval() first. '
            'The fused copy is for inference only; keep training the original model.'
        )


def _refused_at_example(network: nn.Module) -> dict[str, str]:
    """Module path -> input shape (C x H x W) of each fused convolution that refused the example."""
    return {
        path: ', '.join('x'.join(map(str, shape)) for _, _, shape in sorted(module.refused, key=str))
        for path, module in network.named_modules()
        if isinstance(module, FusedConv2d) and module.refused
    }


def _report(model: nn.Module, summary: FusionSummary) -> None:
    """Log the summary; warn naming the BatchNorms left unfused."""
    log.info('%s: %s', type(model).__name__, summary)
    if summary.unfused:
        warnings.warn(
            f'fuse_for_inference: {len(summary.unfused)} BatchNorm{"s" if len(summary.unfused) > 1 else ""} left '
            f'unfused: {", ".join(summary.unfused)}; they run as separate ops (a BatchNorm folds only into an '
            f"nn.Conv2d whose output it alone reads, in code fx traces: the model's forward on the fx route, each "
            f"module's own on the modules route; {summary.route} route)",
            stacklevel=3,
        )


def _finish(network: nn.Module, summary: FusionSummary, backend: str) -> InferenceModel:
    """``network`` restrided to NHWC and wrapped (compiled for inductor): eval mode, nothing requiring grad."""
    with torch.no_grad():
        convert_quietly(network)
    summary.backend = backend
    fused = InferenceModel(network if backend == 'eager' else torch.compile(network), summary).eval()
    fused.requires_grad_(False)
    return fused


def _checked(
    network: nn.Module, summary: FusionSummary, check: ExampleCheck, remake: Callable[[nn.Module], nn.Module]
) -> tuple[InferenceModel, Optional[float]]:
    """The finished copy of ``network`` and its mismatch on the example (``remake(model)``: the same fused
    network made from another copy of the model, for the float64 check); the refused shapes noted."""
    fused = _finish(network, summary, check.backend)
    error = check.mismatch(fused, remake, by_module=summary.route == 'modules')
    summary.refused = _refused_at_example(network)
    return fused, error


def _fx_network(model: nn.Module, prepack: bool, inside_whole: bool) -> fx.GraphModule:
    graph_module = trace(model)
    fuse_graph(graph_module, prepack, inside_whole)
    return graph_module


def _fx_route(model: nn.Module, prepack: bool, check: ExampleCheck) -> tuple[Optional[InferenceModel], Optional[str]]:
    """The fx route's copy, or None and why not: the model does not trace, or its copy does not match,
    with the modules the graph calls whole fused inside (the module route's runs), and without."""
    reason = None
    for inside_whole in (True, False):
        try:
            graph_module = trace(copy.deepcopy(model))
        except Exception as error:  # any model code can fail under symbolic tracing
            return None, why(error)
        optional = optional_inputs_used(graph_module) if check.inputs is None else []
        if optional:  # an example input shows whether the graph runs without them: `fails` below
            defaults = 'which defaults' if len(optional) == 1 else 'which default'
            return None, f'the traced graph computes with {", ".join(optional)}, {defaults} to None'
        failure = check.fails(graph_module)
        if failure is not None:
            return None, f'the traced graph fails on the example input ({failure})'
        retry = inside_whole and bool(called_whole(graph_module))
        remake = functools.partial(_fx_network, prepack=False, inside_whole=inside_whole)
        try:
            summary = fuse_graph(graph_module, prepack, inside_whole)
            fused, error = _checked(graph_module, summary, check, remake)
        except Exception:  # a run fused inside a module whose forward takes another branch than its trace did
            if not retry:
                raise
            continue
        if error is None:
            return fused, None
        reason = f'the traced graph output differs from the model by {error:.2e} (relative)'
        if not retry:
            break
    return None, reason


def _module_network(model: nn.Module, prepack: bool, traced: bool, graphs: bool) -> FusionSummary:
    """Fuse ``model`` in place on the module route: ``graphs``, its traceable submodules on their graphs first."""
    inner = fuse_subgraphs(model, prepack) if graphs else FusionSummary(route='modules')
    summary = fuse_modules(model, prepack, traced=traced, done=tuple(inner.graphs))
    summary.fused.update(inner.fused)
    summary.split, summary.graphs = inner.split, inner.graphs
    return summary


def _module_route(model: nn.Module, prepack: bool, check: ExampleCheck, trace_error: Optional[str]) -> InferenceModel:
    """The module route's copy, which must match the model on the example input: with its traceable submodules
    fused on their graphs and the runs of children found by tracing each module's forward (graphs only
    where an example checks them), else without the graphs, else without the runs either (a run whose
    middle child some other code calls too)."""
    variants = [(True, True)] if check.inputs is not None else []
    variants += [(True, False), (False, False)]
    for traced, graphs in variants:
        network = copy.deepcopy(model)
        summary = _module_network(network, prepack, traced, graphs)
        summary.trace_error = trace_error
        remake = functools.partial(_remade, prepack=False, traced=traced, graphs=graphs)
        try:
            fused, error = _checked(network, summary, check, remake)
        except Exception as failure:  # a run fused where the forward takes another branch than its trace did
            if traced:
                continue
            if check.backend != 'eager':  # torch.compile's failure, said in one line already
                raise
            raise RuntimeError(
                f'the fused copy of {type(model).__name__} fails on the example input ({why(failure)}); code in '
                'its forward may read a convolution as an object (isinstance, an attribute nn.Conv2d has and the '
                'fused convolution has not); please report this model'
            ) from failure
        if error is None:
            return fused
    raise RuntimeError(
        f'the fused copy of {type(model).__name__} differs from it by {error:.2e} relative to its '
        f'largest output (> rtol={check.rtol}) on the example input, and in float64 too; please report this model'
    )


def _remade(model: nn.Module, prepack: bool, traced: bool, graphs: bool) -> nn.Module:
    _module_network(model, prepack, traced, graphs)
    return model


def fuse_for_inference(
    model: nn.Module, example_input: Any = None, *, traceable: bool = False, rtol: float = 1e-4, backend: str = 'eager'
) -> InferenceModel:
    """An eval-only, NHWC, fused copy of ``model`` (see :mod:`channels_last_algo.core.fuse`).

    Args:
        model: a conv net in eval mode. Not modified. Its parameters may require grad: the copy's do not.
        example_input: an input (a tensor, or a tuple of positional arguments) the copy is checked on: the
            fx route's graph must run on it and match ``model``'s output (:mod:`.example_check`), else
            the module route is taken, which must match, else ``RuntimeError``. It also
            prepacks the weights for its shape, finds the convolutions whose fused kernel refuses that
            shape (``summary.refused``), and compiles the copy (``backend='inductor'``). None: nothing runs.
        traceable: keep plain weights (no oneDNN prepacking) and out-of-place residual adds, as
            ``torch.export`` needs them; slower in eager mode.
        rtol: the tolerance of the ``example_input`` check, relative to each output's largest magnitude.
        backend: ``'eager'``: the fused oneDNN / cuDNN kernels, called from Python. ``'inductor'``: the
            fused network (BatchNorm folded) compiled by ``torch.compile`` with inductor's freezing, which
            fuses, prepacks and generates the rest itself; compiling takes minutes for a ResNet-50 on a
            small CPU, at the first call.

    Returns:
        An :class:`InferenceModel` (eval mode, no parameter requiring grad) with the
        :class:`~channels_last_algo.core.fuse.summary.FusionSummary` in ``.summary``. A warning names
        the BatchNorms left unfused, if any.

    Raises:
        ValueError: ``model`` or a submodule of it is in train mode, a bad ``backend``, or ``model`` itself
            raises on ``example_input`` (:class:`~channels_last_algo.core.argument_checks.ExampleInputError`).
        RuntimeError: the copy does not match ``model`` on ``example_input``, or ``torch.compile`` fails on it.
    """
    require_module(model, 'fuse_for_inference')
    require_flags('fuse_for_inference', traceable=traceable)
    _check_arguments(model, traceable, backend, rtol)
    prepack = not traceable and backend == 'eager'
    check = ExampleCheck(model, example_input, backend, rtol)
    fused, trace_error = _fx_route(model, prepack, check)
    if fused is None:
        fused = _module_route(model, prepack, check, trace_error)
    _report(model, fused.summary)
    return fused
