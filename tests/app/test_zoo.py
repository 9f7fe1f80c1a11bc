"""The guarantee on conv nets this project was not built against: timm's zoo after apply_channels_last.

Each model of ``TIMM_ZOO`` in ``benchmarks/zoo_models.py`` (timm definitions, random weights,
its zoo input) is converted with ``apply_channels_last`` (rules and kernel safe paths) and
audited over a float32 training step. The test asserts: the process does not crash; no layout
break is left except those listed in :data:`REMAINING` with their reason, and none is added
(no more breaks than plain ``model.to(memory_format=torch.channels_last)``); outputs, input gradients and
weight gradients of a float64 step equal the NCHW model's; the ``Parameter`` objects and
``state_dict`` keys are unchanged; and ``torch.fx.symbolic_trace`` (and in the newest torch
``torch.export``, of the models whose conversion swapped more than the global pool) work on the converted
model with the same outputs wherever they work on the original. The models run in two subprocesses, one
per core (a layout kernel bug may kill one: then the model it was checking fails, named, the models after it
run in a new process, and the runner lives).

Run one model by hand, from the repository root: ``PYTHONPATH=. python tests/app/test_zoo.py resnet10t``.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from benchmarks import zoo_models as zoo
from channels_last_algo.core.runtime import version_in

pytestmark = pytest.mark.slow  # a sweep of timm's zoo (deselect with -m 'not slow')

MODELS = [entry.name for entry in zoo.TIMM_ZOO]
PROCESSES = 2  # each checks every PROCESSES-th model, on its share of the cores
# Relative to the largest value of its kind, in float64. Most models differ from NCHW by 1e-16 to
# 1e-11 (summation order); EfficientViT-B0's linear attention divides by sums near zero (eps 1e-15)
# and its gradients differ by 1.8e-7, as much as with plain model.to(channels_last).
TOLERANCE = 1e-6

# The breaks left after the rules (float32 audit of one training step at the zoo input): per model,
# {torch versions: {(op, phase): count}} and why they stay. Most are inside attention blocks, on the 4D
# tensors those blocks make of tokens (batch x heads x tokens x tokens, batch x channels x patch x tokens),
# which no layer swap can keep NHWC without rewriting the block's own ops. Plain channels last leaves as
# many or more in every model (asserted).
_ALL = '>=2.7'
_TOKENS = 'the attention reshapes q, k, v to batch x heads x dim x tokens'
_ENTRY = (
    'the attention output is reshaped from tokens to N x C x H x W, channels first, and meets the NHWC '
    'gradient in the norm and activation after it'
)
_SPLIT = 'the backward of splitting q, k, v from one token tensor is a cat of their gradients'
_LINEAR = 'linear attention over batch x channels x patch x tokens tensors (sums over tokens, group norm of 1 group)'
REMAINING: dict[str, tuple[dict[str, dict[tuple[str, str], int]], str]] = {
    'mobilevit_xxs': (
        {_ALL: {('aten.clone.default', 'forward'): 4, ('aten.clone.default', 'backward'): 5}},
        'unfolding into patches and folding back: reshape-transpose copies that NCHW makes too',
    ),
    'mobilevitv2_050': (
        {
            '<2.14': {
                ('aten.add.Tensor', 'forward'): 12,
                ('aten.cat.default', 'backward'): 9,
                ('aten.clone.default', 'forward'): 1,
                ('aten.clone.default', 'backward'): 13,
                ('aten.sum.dim_IntList', 'forward'): 9,
                ('aten.sum.dim_IntList', 'backward'): 6,
            },
            '>=2.14': {
                ('aten.add.Tensor', 'forward'): 12,
                ('aten.cat.default', 'backward'): 9,
                ('aten.native_group_norm.default', 'forward'): 1,
                ('aten.native_group_norm_backward.default', 'backward'): 13,
                ('aten.sum.dim_IntList', 'forward'): 9,
                ('aten.sum.dim_IntList', 'backward'): 6,
            },
        },
        _LINEAR + ', and the residual adds where their output meets the NHWC trunk',
    ),
    'efficientformerv2_s0': (
        {
            _ALL: {
                ('aten._softmax.default', 'forward'): 4,
                ('aten.add.Tensor', 'forward'): 5,
                ('aten._softmax_backward_data.default', 'backward'): 4,
                ('aten.add.Tensor', 'backward'): 5,
                ('aten.clone.default', 'backward'): 4,
                ('aten.sum.dim_IntList', 'backward'): 4,
            }
        },
        'softmax over batch x heads x tokens x tokens maps, the adds where the attention output meets the '
        'NHWC local branch, and the gradients of q, k, v from them',
    ),
    'coatnet_pico_rw_224': ({_ALL: {('aten.clone.default', 'forward'): 7}}, _TOKENS),
    'efficientvit_b0': (
        {_ALL: {('aten.add.Tensor', 'backward'): 4}},
        'linear attention reshapes q, k, v to tokens; their gradients meet the NHWC '
        'multi-scale branch in the add of the aggregation convolution',
    ),
    'efficientvit_m0': (
        {
            _ALL: {
                ('aten.add.Tensor', 'backward'): 9,
                ('aten.cat.default', 'backward'): 12,
                ('aten.threshold_backward.default', 'backward'): 3,
            }
        },
        'cascaded group attention splits the heads from one tensor and concatenates their outputs: the '
        'gradients of the splits are cats, and they meet the NHWC trunk in adds and the activation after it',
    ),
    'halonet26t': (
        {
            _ALL: {
                ('aten.clone.default', 'forward'): 6,
                ('aten.clone.default', 'backward'): 4,
                ('aten.threshold_backward.default', 'backward'): 3,
            }
        },
        'halo attention unfolds blocks of the NHWC map into batch x heads x block x tokens copies; its output, '
        'reshaped from tokens, enters the trunk channels first (' + _ENTRY + ')',
    ),
    'botnet26t_256': ({_ALL: {('aten.threshold_backward.default', 'backward'): 3}}, _ENTRY),
    'lambda_resnet26t': (
        {_ALL: {('aten.cat.default', 'backward'): 3, ('aten.threshold_backward.default', 'backward'): 3}},
        _SPLIT + '; ' + _ENTRY,
    ),
    'tiny_vit_5m_224': (
        {_ALL: {('aten.cat.default', 'backward'): 3}},
        _SPLIT + ', batch x heads x tokens x dim tensors',
    ),
    'repvit_m0_9': (
        {_ALL: {('aten.add.Tensor', 'backward'): 1, ('aten.mul.Tensor', 'backward'): 1}},
        "the add that sums the residual input's gradients, and the layer scale's mul, in the backward of "
        "the channel mixer on the last stage's 2 x 2 map",
    ),
    'maxvit_pico_rw_256': (
        {_ALL: {('aten.clone.default', 'forward'): 6}},
        'window and grid partitions permute the map into batch x windows x tokens x channels copies',
    ),
    'mobilenetv4_hybrid_medium_075': (
        {_ALL: {('aten.clone.default', 'forward'): 8}},
        'multi-query attention reshapes the map to batch x heads x tokens x dim and back',
    ),
}

ROOT = Path(__file__).resolve().parents[2]


def _max_error(actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None) -> float:
    """Largest difference relative to ``scale`` (by default the largest magnitude in ``expected``)."""
    scale = expected.abs().max().item() if scale is None else scale
    return ((actual - expected).abs().max() / max(scale, 1e-300)).item()


def _without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Dropout and stochastic depth in eval mode: their masks depend on the random stream."""
    for module in model.modules():
        stochastic_depth = type(module).__name__ in ('DropPath', 'DropBlock2d')
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) or stochastic_depth:
            module.eval()
    return model


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Output, input gradient and weight gradients of one training step with a fixed random loss."""
    x = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # functional dropout in a head: the same mask for both models
    out = model(x)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    (out * weights).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


# torch.export of whole models runs in the newest torch only, and TorchScript (deprecated since torch 2.11)
# in neither: they were most of this test's time. tests/core/test_export_matrix.py takes every swapped layer
# through every exporter, TorchScript included, in both environments; here torch.export takes the models whose
# conversion swapped more than the global pool (the one swap every model has), whole.
TOOLS = {
    'fx': lambda m, x: torch.fx.symbolic_trace(m)(x),
    **(
        {'export': lambda m, x: torch.export.export(m, (x,), strict=False).module()(x)}
        if version_in(torch.__version__, '>=2.14')
        else {}
    ),
}


def _outcome(tool: str, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | str:
    """The output of a copy of ``model`` run through ``tool`` (tracing can leave state behind,
    such as a cached proxy), or the error it raised."""
    try:
        with torch.no_grad():
            return TOOLS[tool](copy.deepcopy(model), x)
    except Exception as error:  # noqa: BLE001  (recorded: the original may not support it either)
        return f'{type(error).__name__}: {(str(error).splitlines() or [""])[0][:200]}'


def _usability(
    reference: torch.nn.Module, model: torch.nn.Module, x: torch.Tensor, tools: list[str]
) -> dict[str, float | str]:
    """Per tool: the converted model's relative output error against the original's eager output,
    or why not: the tool fails on the original too, or only after conversion. The original is
    tried only where the converted model fails (its success on the original is then moot)."""
    with torch.no_grad():
        expected = reference(x)
    usability = {}
    for tool in tools:
        after = _outcome(tool, model, x.to(memory_format=torch.channels_last))
        if not isinstance(after, str):
            usability[tool] = _max_error(after, expected)
            continue
        before = _outcome(tool, reference, x)
        failed = f'original fails ({before})' if isinstance(before, str) else f'FAILS after conversion: {after}'
        usability[tool] = failed
    return usability


def _plain_breaks(reference: torch.nn.Module, x: torch.Tensor) -> int | None:
    """The breaks of a float32 step after plain ``model.to(memory_format=torch.channels_last)``, its layers
    that crash channels last here on their safe paths (plain, the step kills the process); None where torch
    refuses that (a 5D weight)."""
    from channels_last_algo.core.model_audit import audit_model
    from channels_last_algo.core.safety import make_safe

    try:
        plain = copy.deepcopy(reference).float().to(memory_format=torch.channels_last)
    except RuntimeError:
        return None
    make_safe(plain)
    return len(audit_model(plain, x.float()).breaks)


def check_model(name: str) -> dict:
    """Everything the test asserts on one zoo model, as a JSON-ready dict."""
    from channels_last_algo.core.convert import apply_channels_last
    from channels_last_algo.core.model_audit import audit_model

    start = time.perf_counter()
    entry = next(e for e in zoo.TIMM_ZOO if e.name == name)
    reference = _without_dropout(zoo.build(entry).double())
    model = copy.deepcopy(reference)
    params = [id(p) for p in model.parameters()]
    summary = apply_channels_last(model)
    x = torch.randn(*entry.input_shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x_nhwc = x.to(memory_format=torch.channels_last)
    # the audit in float32, the dtype of training (and of the fast kernels)
    report = audit_model(copy.deepcopy(model).float(), x_nhwc.float())
    plain = _plain_breaks(reference, x_nhwc)
    expected, actual = _step(reference, x), _step(model, x_nhwc)
    grad_scale = max(g.abs().max().item() for g in expected[2].values())
    swapped_more = {r.reason for r in summary.repaired} - {'global_avg_pool'} or getattr(summary, 'made_safe', [])
    tools = [tool for tool in TOOLS if tool != 'export' or swapped_more]
    return {
        'name': name,
        'rules': sorted({r.reason for r in summary.repaired}),
        'safe paths': len(getattr(summary, 'made_safe', [])),
        'breaks': [[b.op, b.phase, b.module_path] for b in report.breaks],
        'plain breaks': plain,
        'errors': {
            'output': _max_error(actual[0], expected[0]),
            'input grad': _max_error(actual[1], expected[1]),
            'weight grads': max(_max_error(actual[2][k], g, grad_scale) for k, g in expected[2].items()),
        },
        'same grads': sorted(actual[2]) == sorted(expected[2]),
        'same parameters': [id(p) for p in model.parameters()] == params,
        'same keys': list(model.state_dict()) == list(reference.state_dict()),
        'usability': _usability(reference.eval(), model.eval(), x[:1], tools),  # eval mode: one image is enough
        'seconds': round(time.perf_counter() - start, 1),
    }


def _run(names: list[str]) -> dict[str, dict]:
    """Check ``names`` in one subprocess; a model whose process died gets an 'error' entry."""
    # Each process on its share of the cores: OpenMP pools of all the cores in parallel processes wait on
    # each other and make the sweep several times slower.
    env = {**os.environ, 'OMP_NUM_THREADS': str(max(1, (os.cpu_count() or PROCESSES) // PROCESSES))}
    command = [sys.executable, __file__, *names]
    process = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900, env=env)
    results = {}
    for line in process.stdout.splitlines():
        if line.startswith('{'):
            result = json.loads(line)
            results[result['name']] = result
    for name in names:
        if name not in results:
            results[name] = {
                'name': name,
                'error': f'process ended with code {process.returncode} while checking '
                f'{name} (or before): {process.stderr.strip().splitlines()[-3:]}',
            }
            break  # the models after it in this process were not reached; they run in the next one
    missing = [n for n in names if n not in results]
    return results | (_run(missing) if missing else {})


@pytest.fixture(scope='module')
def zoo_results() -> dict[str, dict]:
    pytest.importorskip('timm')
    chunks = [MODELS[start::PROCESSES] for start in range(PROCESSES)]
    results = {}
    with concurrent.futures.ThreadPoolExecutor(PROCESSES) as pool:
        for chunk_results in pool.map(_run, chunks):
            results |= chunk_results
    return results


@pytest.mark.parametrize('name', MODELS)
def test_timm_model_keeps_nhwc_numbers_state_and_usability(zoo_results, name):
    result = zoo_results[name]
    assert 'error' not in result, result['error']
    remaining: dict[tuple[str, str], int] = {}
    for op, phase, _ in result['breaks']:
        remaining[(op, phase)] = remaining.get((op, phase), 0) + 1
    expected = next(
        (
            counts
            for versions, counts in REMAINING.get(name, ({_ALL: {}}, ''))[0].items()
            if version_in(torch.__version__, versions)
        ),
        {},
    )
    assert remaining == expected, f'{name}: breaks after repair {result["breaks"]}'
    plain = result['plain breaks']
    assert plain is None or len(result['breaks']) <= plain, f'{name}: more breaks than plain channels last ({plain})'
    for what, error in result['errors'].items():
        assert error <= TOLERANCE, f'{name}: {what} differs from NCHW by {error:.2e} (relative)'
    assert result['same grads'] and result['same parameters'] and result['same keys'], result
    for tool, outcome in result['usability'].items():
        assert not (isinstance(outcome, str) and outcome.startswith('FAILS')), f'{name}: {tool}: {outcome}'
        assert isinstance(outcome, str) or outcome <= TOLERANCE, f'{name}: {tool} output differs: {outcome}'


def test_every_remaining_break_is_in_the_zoo():
    assert set(REMAINING) <= set(MODELS)


if __name__ == '__main__':
    warnings.simplefilter('ignore')
    torch.manual_seed(0)
    for model_name in sys.argv[1:]:
        print(json.dumps(check_model(model_name)), flush=True)
