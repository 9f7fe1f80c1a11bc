"""The shipped ResNet-50 recipe shrunk to a run of seconds, for the recipe, checkpoint, data and CLI tests.

Its model is the demo's TinyResNet (BlurPool swaps its max pooling; EMA, label smoothing,
progressive resizing and channels_last stay on), on 16 synthetic 32-px training images in
batches of 4: 4 batches an epoch, 6 in all, a checkpoint and an evaluation every 2.
"""

from __future__ import annotations

from pathlib import Path

RECIPE = str(Path(__file__).resolve().parents[2] / 'recipes' / 'resnet50_imagenet.yaml')
TINY = [
    'model.name=channels_last_algo.app.runs.demo:TinyResNet',
    'model.num_classes=10',
    'data.train_crop=32',
    'data.eval_crop=32',
    'data.eval_resize=36',
    'data.synthetic_train_samples=16',
    'data.synthetic_eval_samples=4',
    'data.workers=0',
    'train.global_batch_size=4',
    'train.eval_interval=2ba',
    'train.save_interval=2ba',
    'train.max_duration=6ba',
    'scheduler.t_warmup=1ba',
]


def sets(overrides: list[str]) -> list[str]:
    """``['--set', o1, '--set', o2, ...]``."""
    return [arg for override in overrides for arg in ('--set', override)]


def train_args(folder, *extra: str, overrides: tuple[str, ...] = ()) -> list[str]:
    """The ``channels-last train`` arguments of the tiny run saving to ``folder``."""
    return ['train', RECIPE, *sets([*TINY, f'train.save_folder={folder}', *overrides]), *extra]


def final_state(folder: Path, batch: int = 6) -> dict:
    """The ``state`` of the checkpoint written after ``batch`` batches in ``folder``."""
    import torch

    (path,) = folder.glob(f'ep*-ba{batch}-rank0.pt')
    return torch.load(path, map_location='cpu', weights_only=False)['state']


def assert_same_run(got: dict, want: dict) -> None:
    """Two checkpoint states at the same training time with bit-identical model and EMA weights."""
    import torch

    progress = ('epoch', 'batch', 'sample', 'batch_in_epoch')
    assert [got['timestamp']['Timestamp'][k] for k in progress] == [want['timestamp']['Timestamp'][k] for k in progress]
    for key, value in want['model'].items():
        assert torch.equal(got['model'][key], value), key
    ema = {name: state for name, state in want['algorithms']}['EMA']['ema_model']['named_parameters_dict']
    got_ema = {name: state for name, state in got['algorithms']}['EMA']['ema_model']['named_parameters_dict']
    for key, value in ema.items():
        assert torch.equal(got_ema[key], value), f'EMA {key}'
