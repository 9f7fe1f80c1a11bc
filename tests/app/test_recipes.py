"""YAML recipes with Composer: the algorithm registry, overrides, the shared optimizer builder, compare, the
microbatch the Trainer gets, and --smoke.

Validation without Composer is in test_validation.py; training, checkpoints and resuming in test_checkpoints.py."""

import json

import pytest

pytest.importorskip('composer')

from recipe_runs import RECIPE, TINY, sets  # noqa: E402

from channels_last_algo import ChannelsLast  # noqa: E402
from channels_last_algo.app.cli.entry import main  # noqa: E402
from channels_last_algo.app.recipes.algorithms import algorithm_registry, build_algorithms  # noqa: E402
from channels_last_algo.app.recipes.loading import SMOKE_OVERRIDES, load_recipe  # noqa: E402
from channels_last_algo.app.recipes.optimizers import build_optimizer, scaled_lr  # noqa: E402
from channels_last_algo.app.recipes.placement import microbatch_size  # noqa: E402


def test_recipe_loads_and_every_algorithm_resolves():
    recipe = load_recipe(RECIPE)
    assert recipe.model.name == 'resnet50' and recipe.optimizer.lr == 2.048
    assert recipe.data.train_crop == 176 and recipe.data.eval_resize == 232
    names = list(recipe.enabled_algorithms())
    assert names == ['blurpool', 'ema', 'label_smoothing', 'progressive_resizing', 'channels_last']
    algorithms = build_algorithms(recipe)
    assert [type(a) for a in algorithms] == [algorithm_registry()[n] for n in names]
    assert isinstance(algorithms[-1], ChannelsLast) and algorithms[-1].guard.audit_steps == 1
    assert algorithms[-1].guard.mode == 'on'  # `mode: on` is a YAML bool; the recipe layer reads it as 'on'
    auto = build_algorithms(load_recipe(RECIPE, ['algorithms.channels_last.mode=auto']))[-1]
    assert repr(auto) == "ChannelsLast(mode='auto', audit_steps=1, strict=False)"


def test_overrides_set_values_and_turn_channels_last_off():
    recipe = load_recipe(
        RECIPE,
        ['optimizer.lr=0.1', 'algorithms.channels_last=false', 'data.path=null', 'algorithms.cutout={num_holes: 2}'],
    )
    assert recipe.optimizer.lr == 0.1
    assert 'channels_last' not in recipe.enabled_algorithms()
    assert recipe.enabled_algorithms()['cutout'] == {'num_holes': 2}
    assert 'composer_channels_last' in algorithm_registry()


def test_one_optimizer_builder_scales_the_learning_rate_to_the_global_batch():
    import torch

    recipe = load_recipe(RECIPE, ['train.global_batch_size=512'])
    assert scaled_lr(recipe.optimizer, 512) == pytest.approx(2.048 * 512 / 2048)
    optimizer = build_optimizer(recipe, [torch.nn.Parameter(torch.zeros(2))])
    group = optimizer.param_groups[0]
    assert (type(optimizer).__name__, group['lr'], group['momentum']) == ('DecoupledSGDW', pytest.approx(0.512), 0.875)


def test_missing_recipe_file_and_missing_data_path_exit_2(tmp_path, capsys):
    assert main(['train', str(tmp_path / 'nope.yaml')]) == 2
    assert 'nope.yaml: no such recipe file' in capsys.readouterr().err
    assert main(['compare', RECIPE, '--data', str(tmp_path / 'imagenet')]) == 2
    assert f'--data: ImageNet data path {tmp_path}/imagenet does not exist' in capsys.readouterr().err
    bad = tmp_path / 'bad.yaml'
    bad.write_text('name: x\nmodel: [unclosed\n')
    assert main(['train', str(bad)]) == 2
    assert 'bad.yaml: not valid YAML at line 3' in capsys.readouterr().err


def test_compare_prints_three_variants_and_writes_json(tmp_path, capsys):
    out = tmp_path / 'compare.json'
    overrides = TINY + ['train.global_batch_size=2']
    assert main(['compare', RECIPE, '--batches', '1', '--warmup', '0', '--json', str(out), *sets(overrides)]) == 0
    printed = capsys.readouterr().out
    for variant in ('NCHW', 'composer ChannelsLast', 'channels_last_algo'):
        assert variant in printed
    result = json.loads(out.read_text())
    assert [row['variant'] for row in result['rows']] == ['NCHW', 'composer ChannelsLast', 'channels_last_algo']
    ours = result['rows'][2]
    assert ours['layout_breaks'] == 0 and ours['images_per_s'] > 0
    assert result['rows'][0]['speedup_vs_nchw'] == 1.0


def _trainer(tmp_path, overrides):
    from channels_last_algo.app.runs.trainer import build_trainer

    recipe = load_recipe(RECIPE, TINY + [f'train.save_folder={tmp_path / "run"}', *overrides])
    return recipe, build_trainer(recipe)


@pytest.mark.parametrize(
    'overrides,train_micro,eval_micro',
    [
        ([], 4, 4),  # 'auto' on the CPU: the rank's whole batch when it is under 32
        (['train.global_batch_size=64', 'data.synthetic_train_samples=64', 'train.eval_batch_size=8'], 32, 8),
        (['train.global_batch_size=8', 'train.device_train_microbatch_size=2'], 2, 2),
    ],
)
def test_the_trainer_gets_the_microbatch_and_keeps_the_global_batch_learning_rate(
    tmp_path, overrides, train_micro, eval_micro
):
    recipe, trainer = _trainer(tmp_path, overrides)
    try:
        (evaluator,) = trainer.state.evaluators
        micro = (trainer.state.device_train_microbatch_size, evaluator.device_eval_microbatch_size)
        assert micro == (train_micro, eval_micro)
        assert not trainer.state.auto_microbatching
        lr = trainer.state.optimizers[0].param_groups[0]['initial_lr']
        assert lr == pytest.approx(scaled_lr(recipe.optimizer, recipe.train.global_batch_size))
    finally:
        trainer.close()


def test_the_shipped_recipe_trains_in_microbatches_of_32_on_the_cpu():
    recipe = load_recipe(RECIPE)
    assert recipe.train.global_batch_size == 2048 and recipe.train.device_train_microbatch_size == 'auto'
    assert microbatch_size(recipe, 'cpu', 2048) == 32 and microbatch_size(recipe, 'gpu', 2048) == 'auto'


# The tiny recipe's model, image sizes and workers; --smoke sizes the data, evaluation, checkpoints and duration.
TINY_MODEL = [override for override in TINY if override.startswith(('model.', 'data.')) and 'synthetic' not in override]


def test_smoke_shrinks_data_evaluation_checkpoints_and_duration(tmp_path, capfd):
    recipe = load_recipe(RECIPE, SMOKE_OVERRIDES)
    sizes = {key: getattr(recipe.train, key) for key in ('max_duration', 'global_batch_size', 'eval_batch_size')}
    assert sizes == {'max_duration': '4ba', 'global_batch_size': 16, 'eval_batch_size': 16}
    assert (recipe.train.eval_subset_num_batches, recipe.train.save_num_checkpoints_to_keep) == (1, 1)
    assert (recipe.data.synthetic_train_samples, recipe.data.synthetic_eval_samples) == (64, 16)
    assert str(recipe.save_folder()) == 'runs/resnet50_imagenet-smoke'  # the real run's folder is left alone

    folder = tmp_path / 'smoke'  # --set wins over --smoke
    assert main(['train', RECIPE, '--smoke', *sets(TINY_MODEL + [f'train.save_folder={folder}'])]) == 0
    assert [path.name for path in folder.glob('ep*.pt')] == ['ep0-ba4-rank0.pt']  # one checkpoint, at the end
    assert 'channels-last train: evaluation at the end (epoch 1, batch 4):' in capfd.readouterr().out
    assert main(['compare', RECIPE, '--smoke', *sets(TINY_MODEL)]) == 0
    assert '3 timed training steps per variant after 1 warm-up' in capfd.readouterr().out
