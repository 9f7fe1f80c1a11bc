"""The doctor: is channels last safe and right for *this* model, torch and hardware?

:func:`doctor` lists the layers of the model that match a known layout kernel bug on this
runtime (and the safe path :func:`~channels_last_algo.core.convert.apply_channels_last` gives
them), then runs, each in a child process (:func:`~channels_last_algo.core.safety.probe.run_isolated`)
so that a crash is a result:

1. one channels-last training step (forward, loss, backward, SGD step) *without* the safe paths,
   which shows whether a matched bug crashes here;
2. the same step *with* the safe paths (the default conversion); then one step's outputs and
   gradients compared with NCHW's in float64, where they must agree to rounding; then each
   layer's float32 kernels against float64 on the same inputs
   (:func:`~channels_last_algo.core.safety.layer_check.check_layers`: a whole float32 step
   cannot tell a kernel bug from a ReLU flipped by rounding); then a layout audit of forward
   and backward: the breaks left and the bytes they move;
3. only when step 2 crashed: an NCHW step alone, which tells a layout bug from a model that
   crashes anyway.

The report passes (:attr:`DoctorReport.ok`) when step 2 runs and matches NCHW; layout breaks
cost speed, not correctness, and fail it only with ``strict=True``. Dropout layers are put in
eval mode for the comparison (their masks follow memory order). The model is given as an
``nn.Module`` or a callable that builds one; either must be picklable by reference (its class
or the callable defined at module level), as the child processes rebuild it.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    >>> report = doctor(model, (2, 3, 8, 8), device='cpu')   # doctest: +SKIP
    >>> report.ok, report.exit_code                          # doctest: +SKIP
    (True, 0)
    >>> print(report)                                        # doctest: +SKIP
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

import torch
from torch import nn

from channels_last_algo.core.audit import AuditReport
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.layout import to_channels_last
from channels_last_algo.core.machine_description import describe_machine, machine_label
from channels_last_algo.core.model_audit import audit_model
from channels_last_algo.core.runtime import Runtime
from channels_last_algo.core.safety.bugs import matching_bugs
from channels_last_algo.core.safety.layer_check import check_layers, relative_error
from channels_last_algo.core.safety.probe import ProbeResult, run_isolated

__all__ = ['Check', 'DoctorReport', 'doctor']

ModelSpec = Union[nn.Module, Callable[[], nn.Module]]
FLOAT64_TOLERANCE = 1e-8
# float32, per layer: channels last may be this many times further from float64 than NCHW is, plus a floor.
FLOAT32_FACTOR = 10.0
FLOAT32_FLOOR = 1e-4


@dataclasses.dataclass(frozen=True)
class Check:
    """One check of the doctor: its name, whether it passed, and what it found.

    ``counts`` is False for checks that only inform (the step without safe paths).
    """

    name: str
    passed: bool
    detail: str
    counts: bool = True


@dataclasses.dataclass
class DoctorReport:
    """What :func:`doctor` found. :meth:`to_dict` is the JSON the command prints."""

    model: str
    input_shape: tuple[int, ...]
    runtime: Runtime
    machine: str
    conditions: list[dict[str, Any]]
    checks: list[Check]
    audit: Optional[AuditReport]
    strict: bool = False

    @property
    def ok(self) -> bool:
        """True when every counting check passed (and, with ``strict``, no layout break is left)."""
        passed = all(c.passed for c in self.checks if c.counts)
        return passed and not (self.strict and (self.audit is None or not self.audit.ok))

    @property
    def exit_code(self) -> int:
        """0 when :attr:`ok`, 1 when there is a problem: the command's exit status."""
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            'ok': self.ok,
            'model': self.model,
            'input_shape': list(self.input_shape),
            'runtime': str(self.runtime),
            'machine': self.machine,
            'known_bug_conditions': self.conditions,
            'checks': [dataclasses.asdict(c) for c in self.checks],
            'layout_audit': None if self.audit is None else self.audit.to_dict(),
        }

    def __str__(self) -> str:
        lines = [
            f'channels-last doctor: {self.model}, input {tuple(self.input_shape)}, {self.runtime}',
            f'machine: {self.machine}',
            'known layout kernel bugs matched by this model here:',
        ]
        for c in self.conditions:
            safe = (
                f'safe path {c["safe_path"]} applied'
                if c['made_safe']
                else 'NO safe path (the class has its own forward)'
            )
            lines.append(f'  {c["path"] or "(root)"} ({c["layer"]}): {c["bug"]} [{", ".join(c["failures"])}]; {safe}')
        if not self.conditions:
            lines.append('  none')
        lines.append('checks:')
        for c in self.checks:
            mark = 'ok  ' if c.passed else ('FAIL' if c.counts else 'note')
            lines.append(f'  [{mark}] {c.name}: {c.detail}')
        if self.audit is not None:
            lines.append('layout breaks left (with the safe paths):')
            lines += ['  ' + line for line in str(self.audit).splitlines()]
        lines.append('result: ' + ('ok' if self.ok else 'problems found') + f' (exit code {self.exit_code})')
        return '\n'.join(lines)


def _check_arguments(input_shape: Any, device: Any, timeout: Any) -> None:
    """ValueError naming the argument of :func:`doctor` that cannot be used, before any child process starts."""
    shape_ok = isinstance(input_shape, (tuple, list)) and len(input_shape) in (4, 5)
    if not (shape_ok and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in input_shape)):
        raise ValueError(f'doctor: input_shape must be 4 or 5 positive integers (N, C, H, W), got {input_shape!r}')
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < math.inf:
        raise ValueError(f'doctor: timeout must be a positive number of seconds, got {timeout!r}')
    if device is None:
        return
    if not isinstance(device, str) or not re.fullmatch(r'cpu|cuda(:\d+)?', device):
        raise ValueError(f"doctor: device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    index = int(device.partition(':')[2] or 0)
    if device.startswith('cuda') and not (torch.cuda.is_available() and index < torch.cuda.device_count()):
        raise ValueError(f'doctor: device {device!r}: no such CUDA device is visible here; use cpu')


def _build(spec: ModelSpec) -> nn.Module:
    if not isinstance(spec, nn.Module) and not callable(spec):
        raise TypeError(
            f'doctor: model is a {type(spec).__name__}; pass a torch.nn.Module or a callable that builds one'
        )
    model = copy.deepcopy(spec) if isinstance(spec, nn.Module) else spec()
    if not isinstance(model, nn.Module):
        raise TypeError(f'doctor: the model builder returned a {type(model).__name__}, not a torch.nn.Module')
    return model


def _check_importable(spec: ModelSpec, model: nn.Module) -> None:
    """ValueError when a child process could not rebuild the model: a class or builder of ``__main__``."""
    in_main = sorted({type(m).__qualname__ for m in model.modules() if type(m).__module__ == '__main__'})
    if not isinstance(spec, nn.Module) and getattr(spec, '__module__', None) == '__main__':
        in_main.append(getattr(spec, '__qualname__', repr(spec)))
    if in_main:
        raise ValueError(
            f'{", ".join(in_main)} defined in __main__ cannot be rebuilt in the child processes the '
            'doctor runs; define the model (or its builder) in an importable module'
        )


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model's output (a tensor, a sequence or a dict of them)."""
    if isinstance(output, torch.Tensor):
        output = [output]
    items = list(output.values() if isinstance(output, dict) else output)
    tensors = [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError(f'the model returned {type(output).__name__} with no floating-point tensor to take a loss of')
    return tensors


def _projection_loss(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum(t * r) over the output tensors, r fixed random: a loss whose gradient is not uniform
    (the gradient of a plain sum through BatchNorm is near zero)."""
    generator = torch.Generator().manual_seed(1)
    return sum(
        (t * torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t.device, t.dtype)).sum()
        for t in tensors
    )


def _prepare(spec: ModelSpec, device: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = _build(spec).to(device=device, dtype=dtype).train()
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.eval()
    return model


def _gradients(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Outputs, input gradient and parameter gradients of one forward + backward, by name."""
    x = x.detach().requires_grad_()
    outputs = _output_tensors(model(x))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(_projection_loss(outputs), [x] + [p for _, p in named], allow_unused=True)
    found = {f'output {i}': t.detach() for i, t in enumerate(outputs)}
    found['input gradient'] = grads[0]
    found.update({f'{n}.grad': g for (n, _), g in zip(named, grads[1:]) if g is not None})
    return found


def _float64_values(spec: ModelSpec, shape: Sequence[int], device: str, channels_last: bool) -> dict[str, torch.Tensor]:
    """Outputs, input gradient and parameter gradients of one float64 step, by name."""
    model = _prepare(spec, device, torch.float64)
    x = _input(shape, device, torch.float64)
    if channels_last:
        apply_channels_last(model)
        x = to_channels_last(x)
    return _gradients(model, x)


def _input(shape: Sequence[int], device: str, dtype: torch.dtype) -> torch.Tensor:
    """The doctor's random input batch: the same numbers in every dtype."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device, dtype)


def _compare(spec: ModelSpec, shape: Sequence[int], device: str) -> dict[str, Any]:
    """The channels-last step (safe paths, repair) against NCHW: the whole step in float64, where
    the two must agree to rounding, and each layer's float32 kernels (:func:`check_layers`)."""
    truth = _float64_values(spec, shape, device, channels_last=False)
    converted = _float64_values(spec, shape, device, channels_last=True)
    errors = {name: relative_error(converted[name], value) for name, value in truth.items()}
    worst = max(errors, key=errors.get)
    reference = _prepare(spec, device, torch.float32)
    converted_model = copy.deepcopy(reference)
    apply_channels_last(converted_model)
    layers = check_layers(
        reference,
        converted_model,
        _input(shape, device, torch.float32),
        lambda output: _projection_loss(_output_tensors(output)),
        FLOAT32_FACTOR,
        FLOAT32_FLOOR,
    )
    return {'float64': {'worst': worst, 'error': errors[worst]}, 'float32': layers}


def _train_step(spec: ModelSpec, shape: Sequence[int], device: str, layout: str) -> dict[str, Any]:
    """One SGD training step of the model in ``layout``: 'nchw', 'unsafe' (channels last without
    the safe paths) or 'safe' (the default conversion; then also the comparisons and the audit)."""
    model = _prepare(spec, device, torch.float32)
    x = _input(shape, device, torch.float32)
    if layout != 'nchw':
        apply_channels_last(model, kernel_safety=layout == 'safe')
        x = to_channels_last(x)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    _projection_loss(_output_tensors(model(x))).backward()
    optimizer.step()
    if layout != 'safe':
        return {}
    return {**_compare(spec, shape, device), 'audit': audit_model(model, x).to_dict()}


def _step_check(name: str, result: ProbeResult, counts: bool = True) -> Check:
    return Check(name, result.ok, f'ran ({result.seconds:.1f} s)' if result.ok else str(result), counts)


def _float64_check(found: dict[str, Any]) -> Check:
    return Check(
        'one step matches NCHW in float64',
        found['error'] <= FLOAT64_TOLERANCE,
        f'largest difference {found["error"]:.1e} of the magnitude (in {found["worst"]}), '
        f'tolerance {FLOAT64_TOLERANCE:g}',
    )


def _float32_check(found: dict[str, Any]) -> Check:
    failed = f'; channels last off in {", ".join(found["failed"])}' if found['failed'] else ''
    return Check(
        'float32 kernels of every layer as close to float64 as NCHW',
        not found['failed'],
        f'{found["layers"]} layers; closest to the limit: {found["worst"]}, channels last '
        f'{found["error"]:.1e}, NCHW {found["nchw_error"]:.1e} of the magnitude (allowed '
        f'{FLOAT32_FACTOR:g} x NCHW + {FLOAT32_FLOOR:g}){failed}',
    )


def doctor(
    model: ModelSpec,
    input_shape: Sequence[int],
    device: Optional[str] = None,
    strict: bool = False,
    timeout: float = 600.0,
) -> DoctorReport:
    """Check channels last on ``model`` with this torch and hardware (see the module docstring).

    Args:
        model: an ``nn.Module``, or a callable that builds one (``functools.partial(timm.create_model,
            'repvgg_a0')``); either picklable by reference.
        input_shape: N, C, H, W (or N, C, D, H, W) of a random input batch.
        device: where to train; by default CUDA when available, else the CPU.
        strict: count layout breaks left after the safe paths and repair as problems.
        timeout: seconds each child process may run.
    """
    _check_arguments(input_shape, device, timeout)
    device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
    runtime = Runtime.current(device)
    built = _build(model)
    _check_importable(model, built)
    conditions = _conditions(built, runtime)
    checks, audit = _step_checks(model, tuple(input_shape), device, timeout)
    checks += _safe_path_checks(conditions)
    return DoctorReport(
        model=type(built).__name__,
        input_shape=tuple(input_shape),
        runtime=runtime,
        machine=machine_label(describe_machine()),
        conditions=conditions,
        checks=checks,
        audit=audit,
        strict=strict,
    )


def _conditions(built: nn.Module, runtime: Runtime) -> list[dict[str, Any]]:
    """The layers of ``built`` that match a known bug on ``runtime`` (subclasses too), and whether
    the conversion puts each on its safe path."""
    return [
        {
            'path': path,
            'layer': type(module).__name__,
            'bug': bug.name,
            'failures': list(bug.failures),
            'safe_path': bug.replacement.__name__,
            'made_safe': bug.matches(module, runtime),
        }
        for path, module, bug in matching_bugs(built, [runtime], subclasses=True)
    ]


def _step_checks(
    model: ModelSpec, input_shape: tuple[int, ...], device: str, timeout: float
) -> tuple[list[Check], Optional[AuditReport]]:
    """The training steps in child processes, without and with the safe paths, then the safe step's
    comparisons and audit, or, when it crashed, an NCHW step alone."""
    # Two child processes at once (most of each is importing torch), each on its share of the cores:
    # two OpenMP pools of all the cores wait on each other, several times slower than one after the other.
    threads = {'OMP_NUM_THREADS': str(max(1, (os.cpu_count() or 2) // 2))}
    with ThreadPoolExecutor(2) as pool:
        unsafe, safe = pool.map(
            lambda layout: run_isolated(_train_step, model, input_shape, device, layout, timeout=timeout, env=threads),
            ('unsafe', 'safe'),
        )
    checks = [
        _step_check('channels-last training step without the safe paths', unsafe, counts=False),
        _step_check('channels-last training step with the safe paths', safe),
    ]
    if safe.ok:
        checks += [_float64_check(safe.value['float64']), _float32_check(safe.value['float32'])]
        return checks, AuditReport.from_dict(safe.value['audit'])
    nchw = run_isolated(_train_step, model, input_shape, device, 'nchw', timeout=timeout)
    checks.append(_step_check('NCHW training step (to tell a layout bug from the model)', nchw, counts=False))
    return checks, None


def _safe_path_checks(conditions: list[dict[str, Any]]) -> list[Check]:
    """A failed check naming the matched layers that no safe path covers (their class has its own forward)."""
    missing = [c for c in conditions if not c['made_safe']]
    if not missing:
        return []
    return [
        Check(
            'every matched layer on a safe path',
            False,
            'no safe path for ' + ', '.join(c['path'] or '(root)' for c in missing),
        )
    ]
