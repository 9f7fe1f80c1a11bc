"""The ``channels-last audit`` command: the report of a torchvision model or of a model named by
``module:function``, its exit codes, and repair by default (the audit itself: core/test_audit.py)."""

import json

import pytest

from channels_last_algo.app.cli import entry as cli
from channels_last_algo.core.audit import AuditReport

# the command


def test_cli_audit_prints_the_report_and_exits_0_on_a_resnet(capsys):
    assert cli.main(['audit', 'resnet18', '--input', '2,3,32,32', '--strict']) == 0
    out = capsys.readouterr().out
    assert 'ResNet, NHWC input (2, 3, 32, 32)' in out and 'no layout breaks' in out


def test_cli_audit_strict_exits_1_on_a_breaking_model(capsys):
    spec = 'conftest:forward_break_net'
    assert cli.main(['audit', spec, '--input', '2,3,8,8', '--strict']) == 1
    captured = capsys.readouterr()
    assert 'body.1' in captured.out and 'aten.clone.default' in captured.out
    assert '2 layout breaks' in captured.err
    assert cli.main(['audit', spec, '--input', '2,3,8,8', '--json']) == 0
    report = AuditReport.from_dict(json.loads(capsys.readouterr().out))
    assert [r.module_path for r in report.breaks] == ['body.1', 'body.2']


@pytest.mark.parametrize(
    'argv, message',
    [
        (['audit', 'resnet_51'], "'resnet_51' is no torchvision model name"),
        (['audit', 'no_such_module:build'], "cannot load 'no_such_module:build'"),
        (['audit', 'resnet18', '--input', '2,3,x'], "'2,3,x' is not an input shape"),
        (['audit', 'resnet18', '--input', '2,3,32'], "'2,3,32' is not an input shape"),
    ],
)
def test_cli_audit_exits_2_on_a_bad_model_or_input(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_audit_repairs_by_default_and_no_repair_shows_the_plain_breaks(capsys):
    args = ['audit', 'shufflenet_v2_x1_0', '--input', '1,3,64,64', '--json']
    assert cli.main(args) == 0
    assert AuditReport.from_dict(json.loads(capsys.readouterr().out)).ok
    assert cli.main(args + ['--no-repair']) == 0
    plain = AuditReport.from_dict(json.loads(capsys.readouterr().out))
    assert {r.op for r in plain.breaks} == {'aten.cat.default'}
