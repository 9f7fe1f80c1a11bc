"""Kernel safety: the table of known layout kernel bugs, its conditions, the safe paths, the probe.

Everything that may reach a crashing kernel runs in a child process (the probe); the safe
layers are compared in float64 in this process, where no oneDNN kernel runs.
"""

from __future__ import annotations

import copy
import io
import logging
import operator
import os
import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from channels_last_algo.core.audit_report import LayoutBreakError
from channels_last_algo.core.convert import apply_channels_last, restride
from channels_last_algo.core.layers import safe_paths
from channels_last_algo.core.layers.safe_paths import (
    NCHWAvgPool2d,
    NCHWMaskDropout,
    SubsampledConv2d,
    dropout_drawn_as_nchw,
)
from channels_last_algo.core.layout import to_channels_last
from channels_last_algo.core.model_audit import audit_model
from channels_last_algo.core.runtime import Runtime, parse_version
from channels_last_algo.core.safety import (
    FAILURES,
    KNOWN_BUGS,
    KernelBug,
    WrongNumbers,
    make_safe,
    matching_bugs,
    run_code,
    run_isolated,
)

BUGS = {bug.name: bug for bug in KNOWN_BUGS}
ONEDNN = BUGS['onednn_1x1_strided_weight_grad']
AVG_POOL = BUGS['cuda_avg_pool2d_nhwc_backward_padding']
XEON = Runtime(torch_version=(2, 7, 0), device='cpu', cpu_isa='AVX512')


def test_table_rows_are_well_formed():
    assert len(BUGS) == len(KNOWN_BUGS)
    for bug in KNOWN_BUGS:
        assert re.fullmatch(r'[a-z0-9_]+', bug.name)
        assert bug.failures and set(bug.failures) <= set(FAILURES)
        assert issubclass(bug.replacement, bug.original) and bug.replacement is not bug.original
        assert set(bug.devices) <= {'cpu', 'cuda'}
        assert bug.cpu_isa is None or ('cpu' in bug.devices and set(bug.cpu_isa) <= {'AVX512', 'AVX2'})
        first, fixed = bug.torch_versions
        assert first is None or fixed is None or first < fixed
        compile(bug.repro, bug.name, 'exec')  # the repro is a runnable script
        assert bug.references and all(ref.startswith('https://github.com/') for ref in bug.references)
        assert bug.op and bug.shape_condition and bug.observed


def test_a_row_whose_safe_path_cannot_keep_the_state_is_refused():
    fields = dict(
        name='x',
        op='op',
        original=nn.Conv2d,
        condition=lambda m, r: True,
        shape_condition='-',
        devices=('cpu',),
        torch_versions=(None, None),
        cpu_isa=None,
        failures=('crash',),
        passes=('backward',),
        repro='',
        replacement=NCHWAvgPool2d,
        references=(),
        observed='-',
    )
    with pytest.raises(TypeError, match='must subclass Conv2d'):
        KernelBug(**fields)
    with pytest.raises(ValueError, match='failures'):
        KernelBug(**{**fields, 'replacement': SubsampledConv2d, 'failures': ('segfault',)})
    with pytest.raises(ValueError, match='passes'):
        KernelBug(**{**fields, 'replacement': SubsampledConv2d, 'passes': ('step',)})


@pytest.mark.parametrize(
    'conv, runtime, expected',
    [
        (nn.Conv2d(3, 48, 1, stride=2, bias=False), XEON, True),  # the RepVGG stem
        (nn.Conv2d(3, 48, 1, stride=2), Runtime((2, 14, 1), 'cpu', 'AVX512'), True),  # not fixed in 2.14
        (nn.Conv2d(15, 48, 1, stride=(2, 1)), XEON, True),
        (nn.Conv2d(16, 48, 1, stride=2), XEON, False),  # a full channel block
        (nn.Conv2d(7, 48, 1, stride=2), Runtime((2, 7, 0), 'cpu', 'AVX2'), True),  # AVX2 blocks 8 channels
        (nn.Conv2d(8, 48, 1, stride=2), Runtime((2, 7, 0), 'cpu', 'AVX2'), False),
        (nn.Conv2d(3, 48, 1, stride=2), Runtime((2, 7, 0), 'cpu', None), False),  # other CPUs, other kernels
        (nn.Conv2d(3, 48, 1, stride=2), Runtime((2, 7, 0), 'cuda'), False),
        (nn.Conv2d(3, 48, 1, stride=1), XEON, False),
        (nn.Conv2d(3, 48, 3, stride=2), XEON, False),
        (nn.Conv2d(3, 48, 1, stride=2, padding=1), XEON, False),
        (nn.Conv2d(3, 48, 1, stride=2, groups=3), XEON, False),
    ],
)
def test_onednn_condition(conv, runtime, expected):
    assert ONEDNN.matches(conv, runtime) is expected


@pytest.mark.parametrize(
    'pool, runtime, expected',
    [
        (nn.AvgPool2d(3, 2, padding=1), Runtime((2, 13, 0), 'cuda'), True),
        (nn.AvgPool2d(3, 2, padding=(0, 1)), Runtime((2, 7, 0), 'cuda'), True),
        (nn.AvgPool2d(3, 2, padding=1), Runtime((2, 14, 0), 'cuda'), False),  # fixed in 2.14
        (nn.AvgPool2d(3, 2, padding=1), XEON, False),
        (nn.AvgPool2d(2, 2), Runtime((2, 13, 0), 'cuda'), False),
    ],
)
def test_avg_pool_condition(pool, runtime, expected):
    assert AVG_POOL.matches(pool, runtime) is expected


def test_subclasses_with_their_own_forward_reach_the_kernel_but_are_not_replaced():
    class OwnForward(nn.Conv2d):
        def forward(self, x):
            return super().forward(x)

    conv = OwnForward(3, 48, 1, stride=2)
    assert ONEDNN.reaches(conv, XEON) and not ONEDNN.matches(conv, XEON)
    model = nn.Sequential(conv)
    assert matching_bugs(model, [XEON]) == []
    assert [(path, bug.name) for path, _, bug in matching_bugs(model, [XEON], subclasses=True)] == [('0', ONEDNN.name)]


def test_runtime_reads_version_and_onednn_isa_cap(monkeypatch):
    assert parse_version('2.14.1+cu130') == (2, 14, 1) and parse_version('2.15.0a0+git1') == (2, 15, 0)
    with pytest.raises(ValueError, match='not a version'):
        parse_version('nightly')
    assert Runtime.current('cpu').torch_version == parse_version(torch.__version__)
    assert Runtime.current('cuda').cpu_isa is None
    capability = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX2')
    assert Runtime.current('cpu').cpu_isa == ('AVX2' if capability in ('AVX2', 'AVX512') else None)
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'SSE41')
    assert Runtime.current('cpu').cpu_isa is None


def repvgg_stem() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 48, 3, 2, 1, bias=False),
        nn.Conv2d(3, 48, 1, 2, bias=False),
        nn.BatchNorm2d(48),
        nn.AvgPool2d(3, 2, padding=1),
    )


def test_make_safe_keeps_parameters_state_dict_and_reports(caplog):
    model = repvgg_stem()
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    records = make_safe(model, runtimes=[XEON, Runtime((2, 13, 0), 'cuda')])
    assert [(r.path, r.reason, r.replacement) for r in records] == [
        ('1', ONEDNN.name, 'SubsampledConv2d'),
        ('3', AVG_POOL.name, 'NCHWAvgPool2d'),
    ]
    assert records[0].original == 'torch.nn.modules.conv.Conv2d'
    assert [id(p) for p in model.parameters()] == params and list(model.state_dict()) == keys
    assert type(model[0]) is nn.Conv2d  # a 3x3 kernel is not affected
    assert make_safe(model, runtimes=[XEON, Runtime((2, 13, 0), 'cuda')]) == []

    fresh = repvgg_stem()
    with caplog.at_level(logging.INFO, logger='channels_last_algo.core.safety.bugs'):
        summary = apply_channels_last(fresh)
    expected = [r.path for r in make_safe(repvgg_stem())]  # what this runtime matches
    assert [r.path for r in summary.made_safe] == expected
    assert f'{len(expected)} layers on a kernel safe path' in str(summary)
    assert all(f'layer {path} ' in caplog.text for path in expected)
    assert apply_channels_last(repvgg_stem(), kernel_safety=False).made_safe == []


@pytest.mark.parametrize('stride', [2, (2, 1), (1, 2), 3])
@pytest.mark.parametrize('bias', [False, True])
def test_subsampled_conv_equals_conv_in_float64(stride, bias, double_precision):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 1, stride=stride, bias=bias)
    safe = nn.Conv2d(3, 8, 1, stride=stride, bias=bias)
    safe.load_state_dict(conv.state_dict())
    safe.__class__ = SubsampledConv2d
    x = torch.randn(2, 3, 9, 7)
    for channels_last in (False, True):  # input and weights in one layout, as after apply_channels_last
        restride(conv, channels_last), restride(safe, channels_last)
        inp = (to_channels_last(x) if channels_last else x).requires_grad_()
        expected = conv(inp)
        actual = safe(inp)
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
        assert actual.is_contiguous(memory_format=torch.channels_last) is channels_last
        grad = torch.randn(expected.shape)
        want = torch.autograd.grad(expected, [inp, *conv.parameters()], grad)
        got = torch.autograd.grad(actual, [inp, *safe.parameters()], grad)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    'settings',
    [
        dict(kernel_size=3, stride=2, padding=1),
        dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        dict(kernel_size=(3, 2), stride=1, padding=(1, 0), divisor_override=5),
    ],
)
def test_nchw_avg_pool_equals_avg_pool_in_float64(settings, double_precision):
    pool, safe = nn.AvgPool2d(**settings), nn.AvgPool2d(**settings)
    safe.__class__ = NCHWAvgPool2d
    x = to_channels_last(torch.randn(2, 4, 9, 8)).requires_grad_()
    expected, actual = pool(x), safe(x)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert actual.is_contiguous(memory_format=torch.channels_last)
    grad = torch.randn(expected.shape)
    torch.testing.assert_close(torch.autograd.grad(actual, x, grad)[0], torch.autograd.grad(expected, x, grad)[0])


def test_nchw_avg_pool_takes_an_unbatched_input_as_avg_pool_does():
    """A 3D (C, H, W) input has no channels-last form: the safe path returns what AvgPool2d returns, not an error."""
    pool = nn.AvgPool2d(3, 2, padding=1)
    safe = copy.deepcopy(pool)
    safe.__class__ = NCHWAvgPool2d
    x = torch.randn(4, 9, 8)
    expected, actual = pool(x), safe(x)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert actual.stride() == expected.stride()


DROPOUT = BUGS['dropout_mask_memory_order']


@pytest.mark.parametrize('device', ['cpu', 'cpu-fused-path', pytest.param('cuda', marks=pytest.mark.cuda)])
@pytest.mark.parametrize('inplace', [False, True])
def test_the_dropout_safe_path_drops_what_nchw_drops_and_keeps_the_layout(inplace, device, monkeypatch):
    """Same seed, same mask as NCHW dropout, output and input gradient (float64), the random state after it
    as NCHW leaves it, NHWC kept; in evaluation, and with p = 0, nothing dropped. On CUDA the fused kernel
    draws the mask; 'cpu-fused-path' runs the path taken there (the kernel on an NCHW copy) through the CPU's."""
    assert DROPOUT.condition(nn.Dropout(0.5), XEON) and not DROPOUT.condition(nn.Dropout(0.0), XEON)
    if device == 'cpu-fused-path':
        monkeypatch.setattr(safe_paths, '_FUSED_DROPOUT_DEVICES', ('cpu',))
        device = 'cpu'
    layer = nn.Dropout(0.4, inplace=inplace)
    safe = copy.deepcopy(layer)
    safe.__class__ = NCHWMaskDropout
    x = torch.randn(2, 6, 5, 3, dtype=torch.float64, device=device)
    results = []
    for module, images in ((layer, x), (safe, to_channels_last(x))):
        leaf = images.clone().requires_grad_()
        torch.manual_seed(0)
        output = module(leaf * 1)  # a non-leaf, which an in-place dropout may write
        output.backward(torch.arange(output.numel(), dtype=torch.float64, device=device).view(output.shape))
        results.append((output.detach(), leaf.grad, torch.rand(1, device=device)))
    (expected, expected_grad, expected_next), (output, grad, after) = results
    assert torch.equal(output, expected) and torch.equal(grad, expected_grad) and torch.equal(after, expected_next)
    assert output.is_contiguous(memory_format=torch.channels_last) and (output == 0).any()
    safe.eval()
    assert torch.equal(safe(to_channels_last(x)), x)


class CopyCount(TorchDispatchMode):
    """Counts ``aten.copy_`` calls."""

    copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.copies += func is torch.ops.aten.copy_.default
        return func(*args, **(kwargs or {}))


def test_the_cuda_dropout_path_copies_only_an_input_laid_out_otherwise_than_nchws(monkeypatch):
    """The fused kernel's path (here through the CPU's) runs on the input itself where its memory order is
    NCHW's (a classifier's 2D features, an NCHW map) and on an NCHW-ordered copy of an NHWC map."""
    monkeypatch.setattr(safe_paths, '_FUSED_DROPOUT_DEVICES', ('cpu',))
    x = torch.randn(2, 6, 5, 3, dtype=torch.float64)
    for given, copies in ((torch.randn(4, 10), 0), (x, 0), (to_channels_last(x), 2)):
        torch.manual_seed(0)
        expected = nn.functional.dropout(given.contiguous(), 0.3)
        torch.manual_seed(0)
        with CopyCount() as counted:
            output = dropout_drawn_as_nchw(given, 0.3, False)
        assert torch.equal(output, expected) and output.stride() == given.stride()
        assert counted.copies == copies, (given.shape, given.stride(), counted.copies)


def test_the_audit_names_the_copies_of_the_cuda_dropout_path_as_the_safe_paths(monkeypatch):
    monkeypatch.setattr(safe_paths, '_FUSED_DROPOUT_DEVICES', ('cpu',))
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Dropout(0.3), nn.Conv2d(8, 4, 1))
    apply_channels_last(model)
    assert isinstance(model[1], NCHWMaskDropout)
    report = audit_model(model, to_channels_last(torch.randn(2, 3, 8, 8)))
    assert [(b.module_path, b.op) for b in report.breaks] == [('1', 'aten.copy_.default')] * 2, str(report)
    assert all(b.cause.startswith('a kernel safe path (dropout_mask_memory_order)') for b in report.breaks)
    assert 'dropout_mask_memory_order' in str(report)
    with pytest.raises(
        LayoutBreakError, match=r'Its cause: a kernel safe path \(dropout_mask_memory_order\).*no repair'
    ):
        audit_model(model, to_channels_last(torch.randn(2, 3, 8, 8)), strict=True)


@pytest.mark.filterwarnings('ignore:`torch.jit.script` is deprecated:FutureWarning')
def test_safe_layers_keep_fx_script_export_and_onnx(double_precision):
    model = repvgg_stem()[1:].eval()
    x = to_channels_last(torch.randn(2, 3, 16, 16))
    expected = model(x)
    make_safe(model, runtimes=[XEON, Runtime((2, 13, 0), 'cuda')])
    assert [type(m).__name__ for m in model] == ['SubsampledConv2d', 'BatchNorm2d', 'NCHWAvgPool2d']
    traced = torch.fx.symbolic_trace(model)
    scripted = torch.jit.script(model)
    exported = torch.export.export(model, (x,)).module()
    for run in (model, traced, scripted, exported):
        torch.testing.assert_close(run(x), expected, rtol=1e-12, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # the TorchScript-based exporter's deprecation notices
        torch.onnx.export(model, (x,), io.BytesIO(), dynamo=False)


def test_probe_records_a_crash_a_hang_and_wrong_numbers_as_results():
    crashed = run_code('import os; os.abort()')
    assert (crashed.status, crashed.signal, crashed.returncode) == ('crashed', 'SIGABRT', -6)
    assert 'crashed (SIGABRT)' in str(crashed)
    assert run_code('import time; time.sleep(30)', timeout=1).status == 'timeout'
    assert run_code('assert 2 + 2 == 5, "differs"').status == 'wrong numbers'
    assert run_code('raise SystemExit(3)').status == 'error'
    assert run_code('print(1)').ok
    assert run_isolated(operator.add, 2, 3).value == 5
    assert run_isolated(os.abort).signal == 'SIGABRT'


def _differs() -> None:
    raise WrongNumbers('NHWC gradient differs from NCHW')


def test_probe_tells_wrong_numbers_from_errors():
    wrong = run_isolated(_differs)
    assert wrong.status == 'wrong numbers' and 'NHWC gradient differs' in wrong.detail
    failed = run_isolated(int, 'x')
    assert failed.status == 'error' and 'ValueError: invalid literal' in failed.detail
    with pytest.raises(ValueError, match='module level'):
        run_isolated(lambda: None)


def safe_stem_steps(steps: int = 3) -> float:
    """The shape that crashes oneDNN here (3 -> 48, 1x1, stride 2, 2 x 3 x 128 x 128, NHWC) on
    the safe path: the largest weight-gradient difference from NCHW over ``steps`` steps."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 48, 1, stride=2, bias=False)
    x = torch.randn(2, 3, 128, 128)
    reference = torch.autograd.grad(conv(x).sum(), conv.weight)[0]
    make_safe(nn.Sequential(conv), runtimes=[XEON])
    conv.weight.data = to_channels_last(conv.weight.data)
    error = 0.0
    for _ in range(steps):
        grad = torch.autograd.grad(conv(to_channels_last(x)).sum(), conv.weight)[0]
        error = max(error, ((grad - reference).abs().max() / reference.abs().max()).item())
    return error


def test_the_safe_path_trains_the_crashing_shape():
    result = run_isolated(safe_stem_steps)
    assert result.ok, str(result)
    assert result.value < 1e-4


@pytest.mark.skipif(not ONEDNN.affects(Runtime.current('cpu')), reason='the oneDNN jit_1x1 kernels do not run here')
def test_the_table_repro_fails_where_the_table_says_it_does():
    """Where the table says the oneDNN bug applies, its repro must not run clean: if a torch release
    fixes the kernel, this fails and the row's torch_versions needs its first fixed version."""
    result = run_code(ONEDNN.repro)
    assert result.status in ('crashed', 'timeout', 'wrong numbers'), str(result)
