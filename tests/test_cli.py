"""The channels-last command's --help, --version and demo."""

import pytest

from channels_last_algo import __version__
from channels_last_algo.app.cli import main


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(['--version'])
    assert exit_info.value.code == 0
    assert __version__ in capsys.readouterr().out
    assert main([]) == 0
    assert 'demo' in capsys.readouterr().out


def test_demo_prints_layouts_and_times(capsys):
    assert main(['demo', '--steps', '1', '--batch-size', '2', '--image-size', '16']) == 0
    out = capsys.readouterr().out
    assert 'channels last   NHWC     NHWC     NHWC        NHWC' in out
    assert 'NCHW            NCHW     NCHW     NCHW        NCHW' in out
