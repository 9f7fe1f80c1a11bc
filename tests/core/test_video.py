"""Video nets with factorised (2+1)D and separable 3D convolutions: the guarded step keeps NDHWC in
float32 (the training dtype), leaves no more breaks than plain channels last in any dtype, and in float64,
where torch's CPU kernel for some Conv3d shapes has no channels-last path, every break left is named with
that cause."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from channels_last_algo.core.audit_report import AuditReport
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.model_audit import audit_model


class R2Plus1D(nn.Module):
    """A (1, 3, 3) spatial and a (t, 1, 1) temporal convolution with a residual add."""

    def __init__(self, channels: int, mid: int, t: int) -> None:
        super().__init__()
        self.spatial = nn.Conv3d(channels, mid, (1, 3, 3), padding=(0, 1, 1), bias=False)
        self.bn1 = nn.BatchNorm3d(mid)
        self.temporal = nn.Conv3d(mid, channels, (t, 1, 1), padding=(t // 2, 0, 0), bias=False)
        self.bn2 = nn.BatchNorm3d(channels)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.temporal(torch.relu(self.bn1(self.spatial(x))))))


class Separable3d(nn.Module):
    """Depthwise 3 x 3 x 3 then pointwise 1 x 1 x 1, as in S3D and X3D."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.depthwise = nn.Conv3d(channels, channels, 3, padding=1, groups=channels)
        self.pointwise = nn.Conv3d(channels, channels, 1)

    def forward(self, x):
        return x + self.pointwise(torch.relu(self.depthwise(x)))


def video_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(3, 8, (3, 5, 5), stride=(1, 2, 2), padding=(1, 2, 2)),
        R2Plus1D(8, 12, 3),
        Separable3d(8),
        R2Plus1D(8, 12, 5),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )


def _audits(dtype: torch.dtype) -> tuple[AuditReport, AuditReport]:
    """(guarded, plain channels last) audits of one training step."""
    x = torch.randn(2, 3, 4, 16, 16, dtype=dtype).to(memory_format=torch.channels_last_3d)
    guarded = video_net().to(dtype)
    apply_channels_last(guarded)
    plain = video_net().to(dtype).to(memory_format=torch.channels_last_3d)
    return audit_model(guarded, x), audit_model(plain, x)


def test_float32_keeps_ndhwc_forward_and_backward():
    guarded, plain = _audits(torch.float32)
    assert guarded.breaks == [], guarded
    assert len(guarded.breaks) <= len(plain.breaks)


def test_float64_breaks_left_are_torch_kernels_and_named_so():
    guarded, plain = _audits(torch.float64)
    assert guarded.breaks, 'no float64 Conv3d break here: the test no longer shows a named cause'
    assert len(guarded.breaks) <= len(plain.breaks)
    assert all(b.cause for b in guarded.breaks), guarded
    assert "torch's cpu float64 Conv3d kernel returns channels first" in str(guarded)


def test_a_report_written_before_causes_reads_back():
    guarded, _ = _audits(torch.float64)
    data = guarded.to_dict()
    for record in data['breaks']:
        del record['cause']
    assert [b.op for b in AuditReport.from_dict(data).breaks] == [b.op for b in guarded.breaks]


@pytest.mark.parametrize('audit_steps', [1, 2])
def test_guarded_training_matches_nchw_in_float64(audit_steps):
    from channels_last_algo.core.guard import LayoutGuard

    reference, model = video_net().double(), video_net().double()
    guard = LayoutGuard(audit_steps=audit_steps)
    guard.on_init(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (reference, model)]
    for step in range(3):
        x = torch.randn(2, 3, 4, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        expected = reference(x).square().mean()
        expected.backward()
        with guard.step():
            actual = model(guard.on_batch(x)).square().mean()
            actual.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        assert actual.item() == pytest.approx(expected.item(), rel=1e-10)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    assert model[1].spatial.weight.is_contiguous(memory_format=torch.channels_last_3d)
