"""YAML recipes: validation, overrides, the algorithm registry, train/--resume and compare."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from channels_last_algo import ChannelsLast
from channels_last_algo.app.cli import main
from channels_last_algo.app.recipes import RecipeError, algorithm_registry, build_algorithms, load_recipe

RECIPE = str(Path(__file__).resolve().parent.parent / 'recipes' / 'resnet50_imagenet.yaml')
TINY = [
    'model.name=resnet18', 'model.num_classes=10', 'data.train_crop=32', 'data.eval_crop=32', 'data.eval_resize=36',
    'data.synthetic_train_samples=16', 'data.synthetic_eval_samples=4', 'data.workers=0', 'train.global_batch_size=4',
    'train.eval_interval=2ba', 'train.save_interval=2ba', 'train.max_duration=4ba',
]


def _sets(overrides):
    return [arg for override in overrides for arg in ('--set', override)]


def test_recipe_loads_and_every_algorithm_resolves():
    recipe = load_recipe(RECIPE)
    assert recipe.model.name == 'resnet50' and recipe.optimizer.lr == 2.048
    assert recipe.data.train_crop == 176 and recipe.data.eval_resize == 232
    names = list(recipe.enabled_algorithms())
    assert names == ['blurpool', 'ema', 'label_smoothing', 'progressive_resizing', 'channels_last']
    algorithms = build_algorithms(recipe)
    assert [type(a) for a in algorithms] == [algorithm_registry()[n] for n in names]
    assert isinstance(algorithms[-1], ChannelsLast) and algorithms[-1].guard.audit_steps == 1
    assert algorithms[-1].guard.mode == 'on'   # `mode: on` is a YAML bool; the guard reads it as 'on'
    auto = build_algorithms(load_recipe(RECIPE, ['algorithms.channels_last.mode=auto']))[-1]
    assert repr(auto) == "ChannelsLast(mode='auto', audit_steps=1, strict=False)"


def test_overrides_set_values_and_turn_channels_last_off():
    recipe = load_recipe(RECIPE, ['optimizer.lr=0.1', 'algorithms.channels_last=false', 'data.path=null',
                                  'algorithms.cutout={num_holes: 2}'])
    assert recipe.optimizer.lr == 0.1
    assert 'channels_last' not in recipe.enabled_algorithms()
    assert recipe.enabled_algorithms()['cutout'] == {'num_holes': 2}
    assert 'composer_channels_last' in algorithm_registry()


@pytest.mark.parametrize('overrides,message', [
    (['optimizer.lrr=0.1'], "optimizer.lrr: unknown key; did you mean 'lr'?"),
    (['trian.seed=1'], "trian: unknown key; did you mean 'train'?"),
    (['train.global_batch_size=big'], "train.global_batch_size: expected int, got str 'big'"),
    (['algorithms.blurpol=true'], "algorithms.blurpol: unknown algorithm; did you mean 'blurpool'?"),
    (['algorithms.ema.halflife=10ba'], "algorithms.ema.halflife: unknown option of EMA; did you mean 'half_life'?"),
    (['train.gpu_precision=fp8'], 'train.gpu_precision: \'fp8\' is not one of amp_fp16, amp_bf16, fp32'),
    (['optimizer=3'], 'optimizer: expected a mapping of OptimizerConfig keys, got int 3'),
])
def test_bad_recipes_fail_before_training_with_the_key_path(tmp_path, capsys, overrides, message):
    overrides = overrides + [f'train.save_folder={tmp_path}/run']
    assert main(['train', RECIPE, *_sets(overrides)]) == 2
    err = capsys.readouterr().err
    assert err.startswith('channels-last train: error: ') and message in err
    assert err.count('\n') == 1
    assert not (tmp_path / 'run').exists()


def test_missing_recipe_file_and_missing_data_path_exit_2(tmp_path, capsys):
    assert main(['train', str(tmp_path / 'nope.yaml')]) == 2
    assert 'nope.yaml: no such recipe file' in capsys.readouterr().err
    assert main(['compare', RECIPE, '--data', str(tmp_path / 'imagenet')]) == 2
    assert f'--data: ImageNet data path {tmp_path}/imagenet does not exist' in capsys.readouterr().err
    bad = tmp_path / 'bad.yaml'
    bad.write_text('name: x\nmodel: [unclosed\n')
    with pytest.raises(RecipeError, match=r'bad.yaml: not valid YAML at line 3'):
        load_recipe(bad)


def test_tiny_run_checkpoints_and_resume_reaches_the_uninterrupted_state(tmp_path):
    full, resumed = tmp_path / 'full', tmp_path / 'resumed'
    assert main(['train', RECIPE, *_sets(TINY + [f'train.save_folder={full}'])]) == 0
    assert (full / 'ep0-ba2-rank0.pt').exists() and (full / 'latest-rank0.pt').exists()
    # An interrupted run: only the checkpoint after batch 2 survived.
    resumed.mkdir()
    shutil.copy(full / 'ep0-ba2-rank0.pt', resumed / 'latest-rank0.pt')
    assert main(['train', RECIPE, '--resume', *_sets(TINY + [f'train.save_folder={resumed}'])]) == 0

    def final_state(folder):
        return torch.load(folder / 'ep0-ba4-rank0.pt', map_location='cpu', weights_only=False)['state']

    want, got = final_state(full), final_state(resumed)
    progress = ('iteration', 'epoch', 'batch', 'sample', 'batch_in_epoch')
    assert [got['timestamp']['Timestamp'][k] for k in progress] == [want['timestamp']['Timestamp'][k] for k in progress]
    for key, value in want['model'].items():
        torch.testing.assert_close(got['model'][key], value, rtol=0, atol=0, msg=key)


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(['train', RECIPE, '--resume', *_sets(TINY + [f'train.save_folder={tmp_path}'])]) == 2
    assert f'--resume: no checkpoint {tmp_path}/latest-rank0.pt to resume from' in capsys.readouterr().err


def test_compare_prints_three_variants_and_writes_json(tmp_path, capsys):
    out = tmp_path / 'compare.json'
    overrides = TINY + ['train.global_batch_size=2']
    assert main(['compare', RECIPE, '--batches', '1', '--warmup', '0', '--json', str(out), *_sets(overrides)]) == 0
    printed = capsys.readouterr().out
    for variant in ('NCHW', 'composer ChannelsLast', 'channels_last_algo'):
        assert variant in printed
    result = json.loads(out.read_text())
    assert [row['variant'] for row in result['rows']] == ['NCHW', 'composer ChannelsLast', 'channels_last_algo']
    ours = result['rows'][2]
    assert ours['layout_breaks'] == 0 and ours['images_per_s'] > 0
    assert result['rows'][0]['speedup_vs_nchw'] == 1.0
