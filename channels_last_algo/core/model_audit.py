"""One audited pass of a model: :func:`audit_model` runs a forward and the backward of a scalar loss
under a :class:`~channels_last_algo.core.audit.LayoutAudit`, names an input or a model that is not
channels last, and leaves the model as it found it.

Example:
    >>> import torch
    >>> class Head(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.contiguous()          # drops NHWC
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), Head())
    >>> model = model.to(memory_format=torch.channels_last)
    >>> x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    >>> report = audit_model(model, x)
    >>> [(b.op, b.module_path, b.phase) for b in report.breaks]
    [('aten.clone.default', '1', 'forward')]
    >>> report.ok
    False
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Union

import torch

from channels_last_algo.core.argument_checks import example_input_error, require_flags, require_input, require_module
from channels_last_algo.core.audit import LayoutAudit, tensors_in
from channels_last_algo.core.audit_report import AuditReport, LayoutBreakError
from channels_last_algo.core.layout import Layout, layout_of
from channels_last_algo.core.safety.bugs import refuse_crashing_layers

__all__ = ['audit_model']


def _scalar_loss(output: Any, model: torch.nn.Module) -> torch.Tensor:
    """Sum of every tensor in ``output`` that requires grad (tuples, namedtuples, dicts too)."""
    tensors = [t for t in tensors_in(output) if t.requires_grad]
    if not tensors:
        raise ValueError(
            f'{type(model).__name__} returned no tensor that requires grad, so there is '
            'no backward pass to audit; call audit_model(..., backward=False)'
        )
    return sum(t.sum() for t in tensors)


def _nhwc(tensors: list[torch.Tensor], ambiguous: bool = True) -> bool:
    """Whether one of ``tensors`` is channels last; with ``ambiguous``, one whose strides are those of
    either layout (a 1x1 weight, a 1x1 map) counts too."""
    return any(layout_of(t).is_channels_last or ambiguous and layout_of(t) is Layout.AMBIGUOUS for t in tensors)


def _images_and_weights(model: torch.nn.Module, inputs: tuple) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The 4D/5D tensors among ``inputs``, and the 4D/5D parameters of ``model``."""
    return [t for t in tensors_in(inputs) if t.dim() in (4, 5)], [p for p in model.parameters() if p.dim() in (4, 5)]


def _not_channels_last(model: torch.nn.Module, inputs: tuple) -> list[str]:
    """Why an audit of ``model`` on ``inputs`` cannot find a break: no 4D/5D input, or no 4D/5D
    weight, that is channels last."""
    notes = []
    images, weights = _images_and_weights(model, inputs)
    if images and not _nhwc(images):
        notes.append(
            f'the input of shape {tuple(images[0].shape)} is {layout_of(images[0]).value}; pass '
            'input.to(memory_format=torch.channels_last) to audit the channels-last path'
        )
    if weights and not _nhwc(weights):
        notes.append(
            f'none of the {len(weights)} 4D/5D weights of {type(model).__name__} is channels last; '
            'convert the model with apply_channels_last(model) first'
        )
    return notes


def audit_model(
    model: torch.nn.Module,
    example_input: Union[torch.Tensor, tuple],
    backward: bool = True,
    strict: bool = False,
) -> AuditReport:
    """Audit one forward pass of ``model`` and, with ``backward``, the backward of a scalar loss.

    The loss is the sum of every output tensor that requires grad (so auxiliary outputs, as GoogLeNet's in
    train mode, are audited too). The model runs in the mode it is in; pass an NHWC input to audit the
    channels-last path. An NCHW input or a model with no channels-last weight is named in ``report.notes``
    (and ``report.ok`` is False): nothing could break there. The model is left as it was found: its
    parameters and buffers (BatchNorm running statistics) keep their values and each parameter's ``.grad``
    is the tensor it was before.

    Args:
        model: the model, usually after ``apply_channels_last``.
        example_input: one input tensor, or a tuple of positional inputs.
        backward: also run and audit the backward pass (otherwise the forward runs under ``torch.no_grad()``).
        strict: raise :class:`~channels_last_algo.core.audit_report.LayoutBreakError` at the first break.

    Raises:
        ExampleInputError: (a ``ValueError``) the model itself raises on ``example_input``.
        KernelBugError: (a ``ValueError``, before anything runs) a layer crashes or hangs channels last here.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
        >>> model = model.to(memory_format=torch.channels_last)
        >>> audit_model(model, torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).ok
        True
    """
    require_module(model, 'audit_model')
    require_input(example_input, 'audit_model')
    require_flags('audit_model', backward=backward, strict=strict)
    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    audit = LayoutAudit(model, strict=strict)
    _audited_run(model, inputs, audit, backward)
    report = audit.report
    report.notes = _not_channels_last(model, inputs)
    return report


def _audited_run(model: torch.nn.Module, inputs: tuple, audit: LayoutAudit, backward: bool) -> None:
    """The forward (and backward) under ``audit``; :class:`ExampleInputError` where the model raises on ``inputs``
    without the audit too, and :class:`KernelBugError` before anything runs where a layer crashes channels last."""
    if _nhwc([t for group in _images_and_weights(model, inputs) for t in group], ambiguous=False):
        refuse_crashing_layers(model, 'audit_model', backward)
    try:
        with _left_as_found(model), torch.set_grad_enabled(backward), audit:
            output = model(*inputs)
            if backward:
                _scalar_loss(output, model).backward()
    except LayoutBreakError:
        raise
    except Exception as error:  # the model's own error on inputs it does not take, or one under the audit only
        if _raises_without_the_audit(model, inputs):
            raise example_input_error('audit_model', model, error) from error
        raise


def _raises_without_the_audit(model: torch.nn.Module, inputs: tuple) -> bool:
    """Whether ``model``'s forward raises on ``inputs`` by itself (no audit, no gradients), leaving it as found."""
    try:
        with _left_as_found(model), torch.no_grad():
            model(*inputs)
    except Exception:  # whatever the forward raises on inputs it does not take
        return True
    return False


@contextlib.contextmanager
def _left_as_found(model: torch.nn.Module) -> Iterator[None]:
    """Inside, every parameter's ``.grad`` is None (backward accumulates in place into an existing
    one); after, each ``.grad`` is the tensor it was and every buffer has its value back."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = list(model.buffers())
    buffer_values = [b.detach().clone() for b in buffers]
    try:
        for p in params:
            p.grad = None
        yield
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
        with torch.no_grad():
            for b, value in zip(buffers, buffer_values):
                b.copy_(value)
