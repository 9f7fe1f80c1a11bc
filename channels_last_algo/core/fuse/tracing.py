"""Symbolic tracing that calls whole the plain functions whose code fails on tracing proxies.

Computing a padding from the input's shape (transformers' ``apply_tf_padding``, timm's ``pad_same``
for TensorFlow's ``'SAME'``) turns a shape into Python numbers, which fx's proxies cannot be. Where
tracing fails inside such a module-level function, it is traced again with that function wrapped
(``torch.fx``'s ``autowrap_functions``): the graph calls it, and it runs on the real values at every
call, as the model's own code does; the ops around it are traced as usual. The innermost failing
function is wrapped first, then the next one out where that changed nothing (fx wraps a function
only where a traced forward's module calls it by name), up to :data:`MOST_WRAPPED` functions.

Example:
    >>> import torch
    >>> def halve_padding(x):
    ...     return torch.nn.functional.pad(x, [int(x.shape[-1]) % 2, 0])
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return halve_padding(x) * 2
    >>> tracer, graph = trace_wrapping_failures(lambda wrapped: torch.fx.Tracer(autowrap_functions=wrapped), Net())
    >>> [node.target.__name__ for node in graph.nodes if node.op == 'call_function']
    ['halve_padding', 'mul']
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any, Optional

from torch import fx, nn

__all__ = ['MOST_WRAPPED', 'failing_functions', 'shell_of', 'trace_wrapping_failures']

MOST_WRAPPED = 16


def shell_of(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with its own dicts of children, parameters and buffers, to trace: what its
    forward assigns to attributes under tracing (a proxy) stays off the module."""
    shell = copy.copy(module)
    for key in ('_modules', '_parameters', '_buffers'):
        shell.__dict__[key] = dict(module.__dict__[key])
    return shell


def failing_functions(error: BaseException) -> list[Callable[..., Any]]:
    """The module-level Python functions in ``error``'s traceback outside torch (whose functions take
    proxies through ``__torch_function__``, and are called as attributes, which fx cannot wrap), the
    innermost first; none where the failure is in a forward's own code."""
    found, frame = [], error.__traceback__
    while frame is not None:
        code = frame.tb_frame.f_code
        function = frame.tb_frame.f_globals.get(code.co_name)
        if inspect.isfunction(function) and function.__code__ is code:
            module = function.__module__ or ''
            if module != 'torch' and not module.startswith('torch.'):
                found.insert(0, function)
        frame = frame.tb_next
    return found


def trace_wrapping_failures(
    tracer_of: Callable[[tuple[Callable[..., Any], ...]], fx.Tracer], root: nn.Module
) -> tuple[fx.Tracer, fx.Graph]:
    """The tracer (``tracer_of(functions to wrap)``) and graph of ``root``, the functions failing under
    tracing wrapped. A tracer that keeps failing submodules whole records their errors in ``errors``;
    an error of ``root``'s own trace is raised where no function to wrap is found in it."""
    wrapped: list[Callable[..., Any]] = []

    def to_wrap(error: BaseException) -> Optional[Callable[..., Any]]:
        # the innermost not wrapped yet: wrapping one only its caller's module calls changes nothing
        return next((function for function in failing_functions(error) if function not in wrapped), None)

    while True:
        tracer = tracer_of(tuple(wrapped))
        try:
            graph = tracer.trace(root)
        except Exception as error:  # any model code can fail on proxies
            function = to_wrap(error)
            if function is None or len(wrapped) >= MOST_WRAPPED:
                raise
            wrapped.append(function)
            continue
        new = [function for function in dict.fromkeys(map(to_wrap, getattr(tracer, 'errors', ()))) if function]
        if not new or len(wrapped) >= MOST_WRAPPED:
            return tracer, graph
        wrapped += new
