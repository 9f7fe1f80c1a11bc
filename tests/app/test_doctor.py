"""The doctor, from Python and from the command line: known bug conditions, steps in child
processes, the comparison with NCHW, the JSON and the exit code."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from channels_last_algo.app.cli.entry import main
from channels_last_algo.core.runtime import Runtime
from channels_last_algo.core.safety import KNOWN_BUGS
from channels_last_algo.core.safety.diagnostics import doctor

ONEDNN = next(bug for bug in KNOWN_BUGS if bug.name == 'onednn_1x1_strided_weight_grad')


class RepVGGBlock(nn.Module):
    """RepVGG's training-time block: 3x3 conv + BN and 1x1 conv + BN, added, ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv3x3 = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False), nn.BatchNorm2d(out_channels)
        )
        self.conv1x1 = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv3x3(x) + self.conv1x1(x))


def repvgg_style_net() -> nn.Module:
    """A RepVGG-style net whose stem has the 3 -> 48 1x1 stride-2 convolution of repvgg_a0."""
    return nn.Sequential(
        RepVGGBlock(3, 48, 2), RepVGGBlock(48, 48, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(48, 10)
    )


class AssumesNCHW(nn.Module):
    """Reads its input's memory as if it were NCHW: what a kernel with a layout bug does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        return x.as_strided(x.shape, (c * h * w, h * w, w, 1))


def wrong_numbers_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), AssumesNCHW(), nn.Conv2d(8, 4, 3))


def test_doctor_command_on_a_repvgg_style_model(capsys):
    code = main(['doctor', 'test_doctor:repvgg_style_net', '--input', '2,3,64,64', '--device', 'cpu', '--json'])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report['ok'], report
    affected = ONEDNN.affects(Runtime.current('cpu'))
    expected = (
        [
            {
                'path': '0.conv1x1.0',
                'layer': 'Conv2d',
                'bug': ONEDNN.name,
                'failures': list(ONEDNN.failures),
                'safe_path': 'SubsampledConv2d',
                'made_safe': True,
            }
        ]
        if affected
        else []
    )
    assert report['known_bug_conditions'] == expected
    checks = {c['name']: c for c in report['checks']}
    assert checks['channels-last training step with the safe paths']['passed']  # the model trains here
    assert checks['one step matches NCHW in float64']['passed']
    assert checks['float32 kernels of every layer as close to float64 as NCHW']['passed']
    assert not checks['channels-last training step without the safe paths']['counts']
    assert report['layout_audit']['breaks'] == []


def test_doctor_finds_wrong_numbers_and_fails():
    report = doctor(wrong_numbers_net, (2, 3, 8, 8), device='cpu')
    assert report.exit_code == 1 and not report.ok
    failed = [c.name for c in report.checks if not c.passed]
    assert failed == ['one step matches NCHW in float64', 'float32 kernels of every layer as close to float64 as NCHW']
    assert '1: output' in report.checks[-1].detail  # the layer that reads NHWC memory as NCHW
    assert 'problems found (exit code 1)' in str(report)
    assert json.loads(json.dumps(report.to_dict()))['ok'] is False


def test_doctor_refuses_what_a_child_cannot_rebuild(capsys):
    main_class = type('Local', (nn.Module,), {'__module__': '__main__', 'forward': lambda self, x: x})
    with pytest.raises(ValueError, match='importable module'):
        doctor(main_class(), (1, 3, 4, 4))
    assert main(['doctor', 'collections:OrderedDict', '--input', '1,3,4,4']) == 2
    assert 'not a torch.nn.Module' in capsys.readouterr().err
