"""A run shorter than the recipe's intervals: evaluation and checkpoints longer than the run happen at its end,
with one note naming every such key; only what changes the training (a warmup as long as the run) is refused,
in one line naming the keys that fix it."""

import pytest
from recipe_runs import RECIPE, TINY
from test_hostile_recipes import _refused, _train

from channels_last_algo.app.cli.entry import main
from channels_last_algo.app.recipes.loading import load_recipe
from channels_last_algo.app.recipes.schema import RecipeError, check_durations

# The shipped recipe's intervals and warmup in the tiny run (16 images in batches of 4: an epoch is 4 batches).
SHIPPED_TIMES = ['train.eval_interval=1ep', 'train.save_interval=1ep', 'scheduler.t_warmup=8ep']
SCALE = '(12 samples; 4 images a batch, 4 batches an epoch of the 16 samples of data.synthetic_train_samples)'


def test_intervals_longer_than_the_run_are_set_to_its_end_with_one_note_naming_them():
    recipe = load_recipe(
        RECIPE, [*TINY, 'train.max_duration=3ba', 'train.eval_interval=1ep', 'train.save_interval=5ba']
    )
    as_run, note = check_durations(recipe, 16, 'data.synthetic_train_samples', RecipeError)
    assert (as_run.train.eval_interval, as_run.train.save_interval) == ('1dur', '1dur')
    assert (recipe.train.eval_interval, recipe.train.save_interval) == ('1ep', '5ba')  # the recipe is left as it was
    assert note == (
        "train.eval_interval '1ep' (16 samples) and train.save_interval '5ba' (20 samples) are longer than "
        f"train.max_duration '3ba' {SCALE}, so each happens once, at the end of the run"
    )
    within = load_recipe(RECIPE, [*TINY, 'train.max_duration=3ba'])  # every 2ba: within the run
    assert check_durations(within, 16, 'data.synthetic_train_samples', RecipeError) == (within, None)


def test_a_warmup_as_long_as_the_run_is_refused_naming_both_keys_and_not_the_intervals(tmp_path, capsys):
    line = _refused(
        capsys,
        _train(RECIPE, tmp_path / 'run', *SHIPPED_TIMES, 'train.max_duration=3ba'),
        'scheduler.t_warmup',
        tmp_path / 'run',
    )
    assert f"scheduler.t_warmup: '8ep' (128 samples) is not shorter than train.max_duration '3ba' {SCALE}" in line
    assert line.endswith(
        'the cosine decay would never start: give a scheduler.t_warmup shorter than train.max_duration (a tenth of '
        'it, say) or a longer train.max_duration'
    )
    assert 'interval' not in line


def test_a_shortened_run_evaluates_and_saves_at_its_end_once_the_warmup_fits(tmp_path, capfd):
    pytest.importorskip('composer')
    folder = tmp_path / 'run'
    overrides = [*SHIPPED_TIMES, 'train.max_duration=3ba', 'scheduler.t_warmup=1ba']
    assert main(_train(RECIPE, folder, *overrides)) == 0
    printed = capfd.readouterr()
    notes = [line for line in printed.err.splitlines() if 'note:' in line]
    assert notes == [
        "channels-last train: note: train.eval_interval '1ep' (16 samples) and train.save_interval '1ep' (16 samples) "
        f"are longer than train.max_duration '3ba' {SCALE}, so each happens once, at the end of the run"
    ]
    assert 'channels-last train: evaluation at the end (epoch 0, batch 3):' in printed.out.splitlines()
    assert sorted(path.name for path in folder.glob('ep*.pt')) == ['ep0-ba3-rank0.pt']
