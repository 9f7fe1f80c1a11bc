"""The channels-last command's --help, --version, demo, export from a recipe's checkpoint, input shapes checked
before any work, the one-line install hint without Composer, and py.typed."""

import importlib.resources
import importlib.util
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from recipe_runs import RECIPE, TINY, sets, train_args

from channels_last_algo import __version__
from channels_last_algo.app.cli.entry import main
from channels_last_algo.app.recipes.models import input_shape_problem
from channels_last_algo.app.runs.demo import run_demo

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize('flag,value', [('--batch-size', '0'), ('--steps', '-1'), ('--image-size', 'big')])
def test_demo_refuses_sizes_that_would_time_nothing(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        main(['demo', flag, value])
    assert exit_info.value.code == 2
    assert f"error: argument {flag}: '{value}' is not a positive integer" in capsys.readouterr().err
    assert main(['demo', '--image-size', '1']) == 2
    assert 'channels-last demo: error: image_size must be an int >= 2, got 1' in capsys.readouterr().err
    with pytest.raises(ValueError, match='batch_size must be an int >= 1, got 0'):
        run_demo(batch_size=0)


@pytest.mark.parametrize(
    'arguments',
    [['out.pt2'], ['out.pt2', '--recipe', RECIPE], ['resnet18', 'out.pt2', '--recipe', RECIPE, '--checkpoint', 'c.pt']],
)
def test_export_needs_a_model_or_a_recipe_with_its_checkpoint(tmp_path, capsys, arguments):
    assert main(['export', *arguments]) == 2
    assert (
        'error: give MODEL (with --weights FILE to load a state_dict), or --recipe RECIPE with --checkpoint FILE'
    ) in capsys.readouterr().err


def test_export_from_a_recipe_checkpoint_with_blurpool_and_ema(tmp_path, capfd):
    pytest.importorskip('composer')
    from channels_last_algo.app.recipes.loading import load_recipe
    from channels_last_algo.app.runs.checkpoint_files import read_state
    from channels_last_algo.app.runs.run_checkpoints import model_from_checkpoint
    from channels_last_algo.core.canonical_checkpoints import is_canonical

    overrides = ['model.name=resnet18', 'train.max_duration=2ba', 'algorithms.ema.update_interval=1ba']
    folder, out = tmp_path / 'run', tmp_path / 'resnet18.pt2'
    assert main(train_args(folder, overrides=tuple(overrides))) == 0
    out_lines = capfd.readouterr().out.splitlines()
    end = out_lines.index('channels-last train: evaluation at the end (epoch 0, batch 2):')  # on their own lines
    metrics = [line.split()[0] for line in out_lines[end + 1 : end + 3]]
    assert metrics == ['eval/CrossEntropy', 'eval/MulticlassAccuracy']
    assert out_lines[end + 3] == f'channels-last train: done; checkpoints in {folder}'
    checkpoint = folder / 'latest-rank0.pt'
    saved = read_state(checkpoint)
    assert 'module.layer2.0.conv1.conv.weight' in saved['model']  # BlurPool renamed the strided convolutions
    assert is_canonical(saved)  # the run folder holds NCHW-contiguous tensors: model, optimizer, EMA
    recipe_arguments = ['--recipe', RECIPE, '--checkpoint', str(checkpoint), *sets(TINY + overrides)]
    assert main(['export', str(out), *recipe_arguments, '--input', '2,1,64,64']) == 2
    assert capfd.readouterr().err == (
        "channels-last export: error: --input 2,1,64,64: resnet18's first convolution conv1 takes 3 channels; "
        'give N,3,H,W\n'
    )
    assert main(['export', str(out), *recipe_arguments, '--input', '2,3,64,64']) == 0
    printed = capfd.readouterr()
    assert f'wrote {out}' in printed.out
    assert 'ResNet: fx: 20 convolutions fused, 20 of 20 BatchNorms folded' in printed.out  # BlurConv2d's too
    assert 'left unfused' not in printed.err

    recipe = load_recipe(RECIPE, TINY + overrides)
    network, trained = model_from_checkpoint(recipe, checkpoint), model_from_checkpoint(recipe, checkpoint, ema=False)
    ema = dict(saved['algorithms'])['EMA']['ema_model']['named_parameters_dict']
    assert torch.equal(network.fc.weight, ema['module.fc.weight'])
    assert torch.equal(trained.fc.weight, saved['model']['module.fc.weight'])
    assert not torch.equal(network.fc.weight, trained.fc.weight)
    images = torch.randn(3, 3, 64, 64)
    exported = torch.export.load(str(out)).module()
    torch.testing.assert_close(exported(images), network.eval()(images), rtol=1e-4, atol=1e-4)

    checkpoint.resolve().write_bytes(checkpoint.resolve().read_bytes()[:5000])
    assert main(['export', str(out), *recipe_arguments]) == 2
    assert f'{checkpoint} is truncated or corrupt' in capfd.readouterr().err


def _subcommand_help(name):
    """The options of a subcommand's parser, each with its help text."""
    from channels_last_algo.app.cli.entry import build_parser

    (subparsers,) = [action for action in build_parser()._actions if action.dest == 'command']
    return {action.dest: action.help for action in subparsers.choices[name]._actions}


def test_every_demo_option_has_help_and_the_speedup_names_its_steps_and_noise(capsys):
    assert all(_subcommand_help('demo').values())
    assert main(['demo', '--steps', '2', '--batch-size', '2', '--image-size', '8']) == 0
    speedup = capsys.readouterr().out.splitlines()[-1]
    assert speedup.startswith('channels last vs NCHW: ') and 'the median of 2 paired steps' in speedup
    assert 'too few steps for an interval (--steps 6 or more give one)' in speedup and 'noisy' in speedup


@pytest.mark.parametrize('command', ['audit', 'doctor', 'export'])
def test_an_input_the_first_convolution_cannot_take_exits_2_before_any_work(tmp_path, capsys, command):
    out = tmp_path / 'out.pt2'
    arguments = [command, 'resnet18', *([str(out)] if command == 'export' else []), '--input', '2,1,64,64']
    started = time.monotonic()
    assert main(arguments) == 2
    assert time.monotonic() - started < 30  # the doctor's child processes took about 50 s to fail
    assert capsys.readouterr().err == (
        f"channels-last {command}: error: --input 2,1,64,64: resnet18's first convolution conv1 takes 3 channels; "
        'give N,3,H,W\n'
    )
    assert not out.exists()


def test_an_input_of_the_wrong_rank_names_the_convolution_that_needs_another(capsys):
    assert main(['audit', 'r3d_18', '--input', '2,3,64,64']) == 2
    assert capsys.readouterr().err == (
        "channels-last audit: error: --input 2,3,64,64: r3d_18's first convolution stem.0 is a Conv3d, which takes "
        '5D input; give N,3,D,H,W\n'
    )
    assert main(['export', 'resnet18', 'out.pt2', '--input', '2,3,4,64,64']) == 2
    assert 'error: --input 2,3,4,64,64: export takes N,C,H,W (it fuses 2D convolutions)' in capsys.readouterr().err
    assert input_shape_problem(torch.nn.Linear(2, 2), (2, 1, 8, 8), 'linear') is None  # nothing to ask


def test_export_says_and_keeps_its_fixed_height_and_width(tmp_path, capsys):
    assert 'only these channels, height and width' in _subcommand_help('export')['input']
    out = tmp_path / 'tiny.pt2'
    assert main(['export', 'channels_last_algo.app.runs.demo:TinyResNet', str(out), '--input', '2,3,16,16']) == 0
    assert 'on NHWC images of N x 3 x 16 x 16 only' in capsys.readouterr().out
    program = torch.export.load(str(out)).module()
    assert program(torch.randn(3, 3, 16, 16).to(memory_format=torch.channels_last)).shape == (3, 10)
    with pytest.raises(Exception, match='24|16'):  # torch.export's guard on the traced height and width
        program(torch.randn(2, 3, 24, 24).to(memory_format=torch.channels_last))


COMPOSER_COMMANDS = [
    ['train', RECIPE],
    ['train', RECIPE, '--smoke'],
    ['compare', RECIPE],
    ['export', 'out.pt2', '--recipe', RECIPE, '--checkpoint', 'c.pt'],
]
INSTALL = "this needs the composer package, which is not installed: pip install 'channels-last-algo[composer]'"


@pytest.mark.parametrize('arguments', COMPOSER_COMMANDS, ids=lambda a: ' '.join(a[:1] + a[2:3]))
def test_commands_on_composer_name_the_install_without_it(monkeypatch, capsys, arguments):
    monkeypatch.setitem(sys.modules, 'composer', None)  # as if not installed: find_spec and import fail
    assert main(arguments) == 2
    assert capsys.readouterr().err == f'channels-last {arguments[0]}: error: {INSTALL}\n'


def test_the_console_command_without_composer_prints_one_line(tmp_path):
    script = (
        "import sys; sys.modules['composer'] = None; from channels_last_algo.app.cli.entry import main; "
        f"sys.exit(main(['train', {RECIPE!r}, '--set', 'train.save_folder={tmp_path / 'run'}']))"
    )
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr, done.stdout) == (2, f'channels-last train: error: {INSTALL}\n', '')
    assert not (tmp_path / 'run').exists()


def test_without_composer_installed_compare_names_the_install(capsys):
    if importlib.util.find_spec('composer') is not None:
        pytest.skip('Composer is installed here (the test above simulates its absence)')
    assert main(['compare', RECIPE, '--smoke']) == 2
    assert capsys.readouterr().err == f'channels-last compare: error: {INSTALL}\n'


def test_py_typed_is_package_data_of_the_installed_package():
    assert importlib.resources.files('channels_last_algo').joinpath('py.typed').is_file()
    package_data = (ROOT / 'pyproject.toml').read_text().split('[tool.setuptools.package-data]')[1].split('\n[')[0]
    assert 'channels_last_algo = ["py.typed"]' in package_data


def test_a_built_wheel_holds_py_typed(tmp_path):
    import setuptools

    if int(setuptools.__version__.split('.')[0]) < 77:
        pytest.skip(f'setuptools {setuptools.__version__} here; pyproject.toml needs >= 77 to build')
    source = tmp_path / 'source'
    shutil.copytree(ROOT / 'channels_last_algo', source / 'channels_last_algo', ignore=shutil.ignore_patterns('*.pyc'))
    for name in ('pyproject.toml', 'README.md'):
        shutil.copy(ROOT / name, source / name)
    build = "from setuptools import build_meta; print(build_meta.build_wheel('dist'))"
    done = subprocess.run([sys.executable, '-c', build], cwd=source, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with zipfile.ZipFile(source / 'dist' / done.stdout.split()[-1]) as wheel:
        assert 'channels_last_algo/py.typed' in wheel.namelist()
