"""Bad values stop early with one line: every recipe key (no Composer needed), the Python API's
constructors, the honest audit and the DDP refusal."""

from __future__ import annotations

import importlib
import importlib.util
import socket

import pytest
import torch
from recipe_runs import RECIPE, TINY, sets

from channels_last_algo import LayoutGuard, apply_channels_last, audit_model
from channels_last_algo.app.cli.entry import main
from channels_last_algo.app.recipes.loading import load_recipe
from channels_last_algo.app.recipes.schema import RecipeError

BAD_VALUES = [
    (
        'algorithms.channels_last.mode=sideways',
        "algorithms.channels_last.mode: expected one of 'on', 'off', 'auto', got str 'sideways'",
    ),
    (
        'algorithms.channels_last.audit_steps="1"',
        "algorithms.channels_last.audit_steps: expected an int >= 0 (0 turns the audit off), got str '1'",
    ),
    ('algorithms.channels_last.audit_steps=-2', 'algorithms.channels_last.audit_steps: expected an int >= 0'),
    ("algorithms.channels_last.strict='no'", "algorithms.channels_last.strict: expected True or False, got str 'no'"),
    ('algorithms.channels_last.repair=1', 'algorithms.channels_last.repair: expected True or False, got int 1'),
    (
        'algorithms.channels_last.strcit=true',
        "algorithms.channels_last.strcit: unknown option of ChannelsLast; did you mean 'strict'?",
    ),
    (
        'train.max_duration=lots',
        "train.max_duration: 'lots' is not a time string; expected a positive time in "
        "epochs, batches, samples, such as '36ep' or '100ba' or '50000sp'",
    ),
    ('train.max_duration=0ba', "train.max_duration: '0ba' is out of range; expected a positive time"),
    ('train.max_duration=1.5ba', "train.max_duration: '1.5ba' needs a whole number of ba"),
    ('train.max_duration=0.5dur', "train.max_duration: '0.5dur' is in a unit this key does not take"),
    ('train.max_duration=36', 'train.max_duration: expected str, got int 36'),
    ('train.eval_interval=often', "train.eval_interval: 'often' is not a time string"),
    ('train.save_interval=2 ep', "train.save_interval: '2 ep' is not a time string"),
    ('train.save_interval=1.5dur', "train.save_interval: '1.5dur' is out of range"),
    ('scheduler.t_warmup=warm', "scheduler.t_warmup: 'warm' is not a time string"),
    ('scheduler.t_warmup=36ep', "scheduler.t_warmup: '36ep' is not shorter than train.max_duration '36ep'"),
    ('scheduler.t_warmup=100sp', "scheduler.t_warmup: '100sp' cannot be compared with train.max_duration '36ep'"),
    ('optimizer.lr=-1', 'optimizer.lr: -1.0 is out of range; expected a finite number > 0'),
    ('optimizer.lr=.nan', 'optimizer.lr: nan is out of range; expected a finite number > 0'),
    ('optimizer.lr=.inf', 'optimizer.lr: inf is out of range'),
    ('optimizer.lr=fast', "optimizer.lr: expected float, got str 'fast'"),
    ('optimizer.momentum=1.0', 'optimizer.momentum: 1.0 is out of range; expected a finite number >= 0 and < 1'),
    ('optimizer.weight_decay=-0.1', 'optimizer.weight_decay: -0.1 is out of range'),
    ('optimizer.reference_batch_size=0', 'optimizer.reference_batch_size: 0 is out of range; expected an integer >= 1'),
    ('scheduler.alpha_f=2', 'scheduler.alpha_f: 2.0 is out of range; expected a finite number >= 0 and <= 1'),
    ('model.num_classes=0', 'model.num_classes: 0 is out of range; expected an integer >= 1'),
    ('model.name=resnet5O', "model.name: 'resnet5O' is no torchvision model name"),
    (
        'train.save_folder=runs/{nme}',
        "train.save_folder: 'runs/{nme}' has the unknown placeholder {nme}; the only placeholder is {name}",
    ),
    ('train.save_folder=runs/{name', "train.save_folder: 'runs/{name' is not a valid format string"),
    ('name=a/b', "name: 'a/b' cannot name a run folder"),
    ('data.workers=-1', 'data.workers: -1 is out of range; expected an integer >= 0 and <= 256'),
    ('data.workers=1000', 'data.workers: 1000 is out of range'),
    ('data.workers=true', 'data.workers: expected int, got bool True'),
    ('data.train_crop=0', 'data.train_crop: 0 is out of range; expected an integer >= 8 and <= 4096'),
    ('data.train_crop=100000', 'data.train_crop: 100000 is out of range'),
    ('data.eval_crop=4', 'data.eval_crop: 4 is out of range'),
    ('data.eval_resize=200', 'data.eval_resize: 200 is smaller than data.eval_crop 224'),
    (
        'algorithms.composer_channels_last=true',
        'algorithms.composer_channels_last: on beside algorithms.channels_last, whose weight layout',
    ),
    ('data.eval_resize=-1', 'data.eval_resize: -1 is out of range'),
    ('data.synthetic_train_samples=0', 'data.synthetic_train_samples: 0 is out of range'),
    (
        'data.synthetic_train_samples=100',
        'train.global_batch_size: 2048 is more than the 100 samples of data.synthetic_train_samples',
    ),
    ('data.on_corrupt=ignore', "data.on_corrupt: 'ignore' is not one of raise, skip"),
    ('train.seed=-1', 'train.seed: -1 is out of range; expected an integer >= 0 and <= 4294967295'),
    ('train.seed=99999999999', 'train.seed: 99999999999 is out of range'),
    ('train.global_batch_size=0', 'train.global_batch_size: 0 is out of range; expected an integer >= 1'),
    ('train.global_batch_size=-4', 'train.global_batch_size: -4 is out of range'),
    ('train.eval_batch_size=0', 'train.eval_batch_size: 0 is out of range'),
    ('train.save_num_checkpoints_to_keep=0', 'train.save_num_checkpoints_to_keep: 0 is out of range; expected -1'),
    ('train.device=tpu', "train.device: 'tpu' is not one of auto, cpu, gpu"),
    (
        'train.device_train_microbatch_size=0',
        "train.device_train_microbatch_size: 0 is out of range; expected 'auto' (fit the device) or an integer >= 1",
    ),
    (
        'train.device_train_microbatch_size=max',
        "train.device_train_microbatch_size: 'max' is not valid; expected 'auto'",
    ),
    (
        'train.device_train_microbatch_size=2.5',
        'train.device_train_microbatch_size: expected int or str, got float 2.5',
    ),
    (
        'train.device_train_microbatch_size=null',
        'train.device_train_microbatch_size: expected int or str, got NoneType',
    ),
    (
        'train.eval_subset_num_batches=0',
        'train.eval_subset_num_batches: 0 is out of range; expected -1 (the whole set)',
    ),
    ('train.gpu_precision=fp8', "train.gpu_precision: 'fp8' is not one of amp_fp16, amp_bf16, fp32"),
    ('train.global_batch_size=big', "train.global_batch_size: expected int, got str 'big'"),
    ('optimizer.lrr=0.1', "optimizer.lrr: unknown key; did you mean 'lr'?"),
    ('trian.seed=1', "trian: unknown key; did you mean 'train'?"),
    ('optimizer=3', 'optimizer: expected a mapping of OptimizerConfig keys, got int 3'),
    ('algorithms.channels_last=[1]', 'algorithms.channels_last: expected a mapping of options, true or false'),
]


@pytest.mark.parametrize('override,message', BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_each_bad_value_exits_2_naming_the_file_and_key_before_anything_is_built(tmp_path, capsys, override, message):
    folder = tmp_path / 'run'
    assert main(['train', RECIPE, *sets([f'train.save_folder={folder}', override])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'channels-last train: error: {RECIPE}: ') and message in err, err
    assert err.count('\n') == 1
    assert not folder.exists()


def test_yaml_on_off_booleans_are_modes_and_the_tiny_recipe_is_valid():
    assert load_recipe(RECIPE).algorithms['channels_last']['mode'] == 'on'  # the file says `mode: on`, a YAML bool
    assert load_recipe(RECIPE, ['algorithms.channels_last.mode=off']).algorithms['channels_last']['mode'] == 'off'
    recipe = load_recipe(RECIPE, TINY)
    assert recipe.train.max_duration == '6ba' and recipe.model.num_classes == 10


def test_overrides_that_do_not_fit_the_recipe_are_named():
    with pytest.raises(RecipeError, match=r"--set 'optimizer': expected KEY.PATH=VALUE"):
        load_recipe(RECIPE, ['optimizer'])
    with pytest.raises(RecipeError, match=r"--set 'train.seed.x=1': train.seed is 17, not a mapping"):
        load_recipe(RECIPE, ['train.seed.x=1'])


@pytest.mark.parametrize(
    'options,message',
    [
        ({'strict': 'no'}, "strict must be True or False, got 'no'"),
        ({'repair': 'yes'}, "repair must be True or False, got 'yes'"),
        ({'mode': True}, "mode must be one of 'on', 'off', 'auto', got True"),
        ({'mode': 'sideways'}, "mode must be one of 'on', 'off', 'auto', got 'sideways'"),
        ({'audit_steps': '1'}, "audit_steps must be an int >= 0 (0 turns the audit off), got '1'"),
        ({'audit_steps': -1}, 'audit_steps must be an int >= 0'),
    ],
)
def test_the_python_api_refuses_what_the_recipe_refuses(options, message):
    with pytest.raises(ValueError, match=message.replace('(', r'\(').replace(')', r'\)')):
        LayoutGuard(**options)


def test_composer_algorithm_validates_its_options_in_the_same_place():
    pytest.importorskip('composer')
    from channels_last_algo import ChannelsLast

    with pytest.raises(ValueError, match="strict must be True or False, got 'no'"):
        ChannelsLast(strict='no')
    with pytest.raises(ValueError, match="fuse_eval must be True or False, got 'yes'"):
        ChannelsLast(fuse_eval='yes')


@pytest.mark.parametrize(
    'override,message',
    [
        (
            'algorithms.ema.half_life=soon',
            "algorithms.ema.half_life: 'soon' is not a time string; expected a time string such as '1000ba'",
        ),
        ("algorithms.blurpool.replace_convs='yes'", "algorithms.blurpool.replace_convs: expected bool, got str 'yes'"),
        (
            'algorithms.ema.update_interval=sometimes',
            "algorithms.ema.update_interval: 'sometimes' is not a time string; expected a positive time in epochs",
        ),
        ('algorithms.blurpol=true', "algorithms.blurpol: unknown algorithm; did you mean 'blurpool'?"),
        ('algorithms.ema.halflife=10ba', "algorithms.ema.halflife: unknown option of EMA; did you mean 'half_life'?"),
    ],
)
def test_composer_algorithm_options_are_checked_by_key(capsys, override, message):
    pytest.importorskip('composer')
    assert main(['train', RECIPE, *sets([override])]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count('\n') == 1, err


def test_audit_says_when_nothing_was_channels_last():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    report = audit_model(model, torch.randn(2, 3, 8, 8))
    assert not report.ok and len(report.notes) == 2
    text = str(report)
    assert 'not a channels-last run: the input of shape (2, 3, 8, 8) is NCHW' in text
    assert (
        'none of the 1 4D/5D weights of Sequential is channels last; convert the model with apply_channels_last'
    ) in text
    apply_channels_last(model)
    nhwc = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    assert audit_model(model, nhwc).ok and audit_model(model, nhwc).notes == []
    assert [n[:20] for n in audit_model(model, torch.randn(2, 3, 8, 8)).notes] == ['the input of shape (']


def test_apply_channels_last_refuses_a_ddp_wrapped_model_as_the_guard_does():
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        port = probe.getsockname()[1]
    torch.distributed.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3)))
        with pytest.raises(ValueError) as from_guard:
            LayoutGuard().on_init(wrapped)
        with pytest.raises(ValueError) as from_function:
            apply_channels_last(wrapped)
        assert str(from_function.value) == str(from_guard.value)
        assert 'already wrapped in DistributedDataParallel' in str(from_function.value)
        assert wrapped.module[0].weight.is_contiguous()  # untouched
    finally:
        torch.distributed.destroy_process_group()


def test_every_integration_takes_the_options_keyword_only_in_one_order():
    """LayoutGuard, ChannelsLast and ChannelsLastCallback: OPTIONS' names, order and defaults, keyword-only;
    the guard takes all but the integrations' own (INTEGRATION_ONLY)."""
    import inspect

    from channels_last_algo.core.guard import LayoutGuard
    from channels_last_algo.core.options import INTEGRATION_ONLY, OPTIONS

    classes = [LayoutGuard]
    for module, name in (('composer', 'ChannelsLast'), ('lightning', 'ChannelsLastCallback')):
        if importlib.util.find_spec(module) is not None:
            classes.append(getattr(importlib.import_module(f'channels_last_algo.integrations.{module}'), name))
    for cls in classes:
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
        shared = [(p.name, p.default, p.kind) for p in parameters if p.name in OPTIONS]
        names = [name for name in OPTIONS if cls is not LayoutGuard or name not in INTEGRATION_ONLY]
        expected = [(name, OPTIONS[name].default, inspect.Parameter.KEYWORD_ONLY) for name in names]
        assert shared == expected, cls.__name__
        with pytest.raises(TypeError):
            cls('on')
