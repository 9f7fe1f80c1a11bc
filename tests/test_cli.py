"""The channels-last command's --help, --version, demo, and export from a recipe's checkpoint."""

import pytest
import torch
from recipe_runs import RECIPE, TINY, sets, train_args

from channels_last_algo import __version__
from channels_last_algo.app.cli import main
from channels_last_algo.app.demo import run_demo


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
    from channels_last_algo.app.checkpoints import model_from_checkpoint
    from channels_last_algo.app.recipes import load_recipe
    from channels_last_algo.app.run_folder import read_state
    from channels_last_algo.core.checkpoints import is_canonical

    overrides = ['model.name=resnet18', 'train.max_duration=2ba', 'algorithms.ema.update_interval=1ba']
    folder, out = tmp_path / 'run', tmp_path / 'resnet18.pt2'
    assert main(train_args(folder, overrides=tuple(overrides))) == 0
    checkpoint = folder / 'latest-rank0.pt'
    saved = read_state(checkpoint)
    assert 'module.layer2.0.conv1.conv.weight' in saved['model']  # BlurPool renamed the strided convolutions
    assert is_canonical(saved)  # the run folder holds NCHW-contiguous tensors: model, optimizer, EMA
    recipe_arguments = ['--recipe', RECIPE, '--checkpoint', str(checkpoint), *sets(TINY + overrides)]
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
