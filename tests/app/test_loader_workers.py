"""data.workers is a cap: each loader starts at most one worker per core this process may use, says how many it
started, and PyTorch has no more workers than cores to warn of."""

import json
import os

import pytest
from recipe_runs import RECIPE, TINY, sets

from channels_last_algo.app.cli.entry import main
from channels_last_algo.app.recipes.loading import load_recipe

PYTORCH_WARNING = 'suggested max number of worker'


@pytest.fixture
def one_core(monkeypatch):
    """This process may run on one core (PyTorch's loader reads the same affinity)."""
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {0}, raising=False)


def test_the_workers_are_data_workers_at_most_one_per_usable_core(one_core, monkeypatch):
    from channels_last_algo.app.recipes.placement import loader_workers, usable_cores, workers_words

    assert usable_cores() == 1
    assert [loader_workers(load_recipe(RECIPE, [f'data.workers={n}'])) for n in (0, 1, 8)] == [0, 1, 1]
    monkeypatch.delattr(os, 'sched_getaffinity')  # no affinity on this system: every core counts
    monkeypatch.setattr(os, 'cpu_count', lambda: 3)
    assert usable_cores() == 3 and loader_workers(load_recipe(RECIPE, ['data.workers=8'])) == 3
    assert workers_words(8, 3) == '3 loader workers (data.workers 8, capped at the 3 cores this process may use)'


def test_the_trainer_starts_the_capped_workers_says_so_and_pytorch_does_not_warn(one_core, tmp_path, capfd, recwarn):
    pytest.importorskip('composer')
    from channels_last_algo.app.runs.trainer import build_trainer

    trainer = build_trainer(load_recipe(RECIPE, [*TINY, 'data.workers=3', f'train.save_folder={tmp_path / "run"}']))
    try:
        (evaluator,) = trainer.state.evaluators
        assert (trainer.state.train_dataloader.num_workers, evaluator.dataloader.dataloader.num_workers) == (1, 1)
    finally:
        trainer.close()
    assert (
        'channels-last train: data: 16 training images (data.synthetic_train_samples); '
        '1 loader worker (data.workers 3, capped at the 1 core this process may use)'
    ) in capfd.readouterr().err.splitlines()
    assert not [warning for warning in recwarn if PYTORCH_WARNING in str(warning.message)]


def test_compare_loads_with_the_capped_workers_and_says_so(one_core, tmp_path, capsys, recwarn):
    pytest.importorskip('composer')
    out = tmp_path / 'compare.json'
    overrides = [*TINY, 'train.global_batch_size=2', 'data.workers=3']
    assert main(['compare', RECIPE, '--batches', '1', '--warmup', '0', '--json', str(out), *sets(overrides)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert (
        'data: 1 loader worker (data.workers 3, capped at the 1 core this process may use), all batches loaded first'
        in printed
    )
    result = json.loads(out.read_text())
    assert (result['data_workers'], result['loader_workers']) == (3, 1)
    assert not [warning for warning in recwarn if PYTORCH_WARNING in str(warning.message)]
