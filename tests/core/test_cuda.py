"""What only a CUDA device shows: cuDNN's NHWC kernels under the guard, step after step, the CUDA rows of
the kernel-bug table and their safe paths, and cuDNN's fused inference. Every test here is marked
``cuda``: skipped without a device (root ``conftest.py``); the GPU suite (``./run gpu``) runs them all,
with the other tests marked so, as ``pytest -m cuda``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from channels_last_algo.core.fuse import fuse_for_inference
from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.layers.safe_paths import NCHWAvgPool2d
from channels_last_algo.core.layout import has_channels_last_strides, to_channels_last
from channels_last_algo.core.runtime import Runtime
from channels_last_algo.core.safety import KNOWN_BUGS, make_safe, run_code
from conftest import small_net

pytestmark = pytest.mark.cuda

CUDA_BUGS = [bug for bug in KNOWN_BUGS if 'cuda' in bug.devices]


def _net() -> nn.Module:
    """The shared small net (convolution, BatchNorm, depthwise and 1x1 convolutions) with a GroupNorm, a
    dropout and a padded average pool (the CUDA rows' layers) before its head."""
    body = list(small_net())
    return nn.Sequential(*body[:-3], nn.GroupNorm(4, 16), nn.Dropout(0.2), nn.AvgPool2d(3, 2, padding=1), *body[-3:])


def test_a_guarded_training_on_cuda_matches_nchw_at_every_step_and_stays_nhwc():
    torch.manual_seed(0)
    reference = _net().to('cuda', torch.float64)
    net = copy.deepcopy(reference)
    guard = LayoutGuard(audit_steps=1)
    guard.on_init(net)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (reference, net)]
    for step in range(3):
        images = torch.randn(4, 3, 16, 16, device='cuda', dtype=torch.float64)
        labels = torch.randint(0, 4, (4,), device='cuda')
        torch.manual_seed(step)  # the same dropout draws in both
        expected = nn.functional.cross_entropy(reference(images), labels)
        expected.backward()
        batch = guard.on_batch((images, labels))
        assert has_channels_last_strides(batch[0])
        torch.manual_seed(step)
        with guard.step():
            loss = nn.functional.cross_entropy(net(batch[0]), batch[1])
            loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-9, atol=0, msg=f'loss at step {step}')
        for (name, p), q in zip(net.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=f'{name} gradient at step {step}')
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for name, p in net.named_parameters():
        if p.dim() == 4:
            assert p.is_cuda and has_channels_last_strides(p), name
    assert guard.report is not None and guard.report.steps == 1
    guard.close()


@pytest.mark.parametrize('bug', CUDA_BUGS, ids=lambda bug: bug.name)
def test_a_cuda_rows_repro_fails_exactly_where_the_table_says(bug):
    """Where the row applies to this torch, its repro must not run clean; where it does not (a torch
    with the fix), it must. Either way the row's torch_versions is checked on a real device."""
    result = run_code(bug.repro, timeout=300.0)
    if bug.affects(Runtime.current('cuda')):
        assert result.status in ('crashed', 'wrong numbers', 'timeout'), str(result)
    else:
        assert result.status == 'ok', str(result)


def test_the_avg_pool_safe_path_gives_the_nchw_gradient_on_cuda_and_is_swapped_in_where_the_row_applies():
    pool = nn.AvgPool2d(3, 2, padding=1)
    x = torch.randn(2, 8, 9, 9, dtype=torch.float64)
    grad = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    reference = x.clone().requires_grad_()
    pool(reference).backward(grad)

    model = nn.Sequential(copy.deepcopy(pool)).cuda()
    records = make_safe(model)
    row = next(bug for bug in CUDA_BUGS if bug.replacement is NCHWAvgPool2d)
    assert bool(records) == row.affects(Runtime.current('cuda'))
    nhwc = to_channels_last(x.cuda()).requires_grad_()
    output = model(nhwc)
    output.backward(to_channels_last(grad.cuda()))
    torch.testing.assert_close(output.cpu(), pool(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(nhwc.grad.cpu(), reference.grad, rtol=1e-12, atol=1e-12)


def test_fused_inference_on_cuda_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 1)
    ).cuda()
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    model.eval()
    x = torch.randn(2, 3, 16, 16, device='cuda')
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        fused = fuse_for_inference(model, to_channels_last(x))
        with torch.no_grad():
            expected, actual = model(x), fused(to_channels_last(x))
    assert fused.summary.count('bn') == 1
    assert actual.is_cuda and has_channels_last_strides(actual)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
