"""The valid values of Composer's algorithm options, from one table
(``channels_last_algo.app.recipes.algorithm_ranges``): the table covers every algorithm of the registry and
every option of its signature, the defaults pass, out-of-range values and options that do not fit together
are worded in one line, and a recipe that holds one is refused before anything trains."""

from __future__ import annotations

import inspect
import typing

import pytest

pytest.importorskip('composer')

from recipe_runs import RECIPE, train_args  # noqa: E402

from channels_last_algo.app.cli.entry import main  # noqa: E402
from channels_last_algo.app.recipes.algorithm_ranges import (  # noqa: E402
    ALGORITHM_CROSS_RULES,
    ALGORITHM_RANGES,
    algorithm_cross_problem,
    algorithm_option_problem,
)
from channels_last_algo.app.recipes.algorithms import algorithm_registry  # noqa: E402

# Options of Composer's algorithms that take any value, and why.
ANY_VALUE = {
    'input_key': 'a position or name in the batch: which exist depends on the data loader, and a key that is '
    "not there fails at the first batch with Composer's own error",
    'target_key': 'the same, for the targets',
}


def composer_algorithms() -> dict[str, type]:
    """The registry less this project's ``channels_last`` (checked by the core's own options)."""
    return {name: cls for name, cls in algorithm_registry().items() if name != 'channels_last'}


def parameters(cls: type) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(cls).parameters)


def takes_a_scalar(cls: type, option: str) -> bool:
    """Whether ``option`` of ``cls`` takes a number, a string or a time string (by annotation or default)."""
    annotation = typing.get_type_hints(cls.__init__).get(option)
    kinds = set(typing.get_args(annotation) or (annotation,))
    default = parameters(cls)[option].default
    return bool(kinds & {int, float, str}) or (type(default) in (int, float, str))


# --- the table cannot rot ------------------------------------------------------------------------------------


def test_every_composer_algorithm_has_a_row_and_every_named_option_exists():
    algorithms = composer_algorithms()
    assert sorted(ALGORITHM_RANGES) == sorted(algorithms)
    for name, row in ALGORITHM_RANGES.items():
        assert set(row) <= set(parameters(algorithms[name])), name
    for name, rules in ALGORITHM_CROSS_RULES.items():
        for rule in rules:
            assert set(rule.options) <= set(ALGORITHM_RANGES[name]), (name, rule.options)


def test_every_number_string_or_time_option_has_a_rule_or_takes_any_value():
    uncovered = [
        f'{name}.{option}'
        for name, cls in composer_algorithms().items()
        for option in parameters(cls)
        if takes_a_scalar(cls, option) and option not in ALGORITHM_RANGES[name] and option not in ANY_VALUE
    ]
    assert uncovered == []


def test_every_default_passes_its_rule_and_the_defaults_fit_together():
    algorithms = composer_algorithms()
    for name, row in ALGORITHM_RANGES.items():
        signature = parameters(algorithms[name])
        for option in row:
            default = signature[option].default
            if default is not inspect.Parameter.empty:
                assert algorithm_option_problem(name, option, default) is None, (name, option, default)
        assert algorithm_cross_problem(name, algorithms[name], {}) is None, name


@pytest.mark.parametrize(
    'name,option,constant',
    [
        ('augmix', 'augmentation_set', 'composer.algorithms.utils.augmentation_primitives:augmentation_sets'),
        ('randaugment', 'augmentation_set', 'composer.algorithms.utils.augmentation_primitives:augmentation_sets'),
        ('progressive_resizing', 'mode', 'composer.algorithms.progressive_resizing.progressive_resizing:_VALID_MODES'),
        (
            'stochastic_depth',
            'stochastic_method',
            'composer.algorithms.stochastic_depth.stochastic_depth:_VALID_STOCHASTIC_METHODS',
        ),
        (
            'stochastic_depth',
            'drop_distribution',
            'composer.algorithms.stochastic_depth.stochastic_depth:_VALID_LAYER_DISTRIBUTIONS',
        ),
        (
            'stochastic_depth',
            'target_layer_name',
            'composer.algorithms.stochastic_depth.stochastic_depth:_STOCHASTIC_LAYER_MAPPING',
        ),
    ],
)
def test_choices_are_composers_own(name, option, constant):
    import importlib

    module, attr = constant.split(':')
    composer_choices = sorted(getattr(importlib.import_module(module), attr))
    expected = ALGORITHM_RANGES[name][option].expected  # 'one of a, b, c'
    assert sorted(expected.removeprefix('one of ').split(', ')) == composer_choices
    assert all(algorithm_option_problem(name, option, choice) is None for choice in composer_choices)


# --- one value at a time ---------------------------------------------------------------------------------------

UNIT_TIME = "a positive time in epochs, batches, such as '36ep' or '100ba'"
RUN_TIME = "a positive time in epochs, a fraction of the whole run, such as '36ep' or '0.1dur'"
OUT_OF_RANGE = [
    ('label_smoothing', 'smoothing', 1.5, '1.5 is out of range; expected a finite number >= 0 and <= 1'),
    ('label_smoothing', 'smoothing', -0.1, '-0.1 is out of range; expected a finite number >= 0 and <= 1'),
    ('label_smoothing', 'smoothing', 2, '2.0 is out of range; expected a finite number >= 0 and <= 1'),
    ('label_smoothing', 'smoothing', float('nan'), 'nan is out of range; expected a finite number >= 0 and <= 1'),
    ('label_smoothing', 'smoothing', None, 'None is not a number; expected a finite number >= 0 and <= 1'),
    ('label_smoothing', 'smoothing', '0.1', "'0.1' is not a number; expected a finite number >= 0 and <= 1"),
    ('label_smoothing', 'smoothing', True, 'True is not a number; expected a finite number >= 0 and <= 1'),
    ('blurpool', 'min_channels', -1, '-1 is out of range; expected an integer >= 0'),
    ('blurpool', 'min_channels', 2.5, '2.5 is not an integer; expected an integer >= 0'),
    ('ema', 'half_life', '0ba', f"'0ba' is out of range; expected {UNIT_TIME}"),
    ('ema', 'half_life', '0.5dur', f"'0.5dur' is in a unit this key does not take; expected {UNIT_TIME}"),
    ('ema', 'half_life', '1.5ba', f"'1.5ba' needs a whole number of ba; expected {UNIT_TIME}"),
    ('ema', 'smoothing', 1.0, '1.0 is out of range; expected a finite number > 0 and < 1'),
    ('ema', 'smoothing', 0, '0.0 is out of range; expected a finite number > 0 and < 1'),
    (
        'ema',
        'ema_start',
        '1.5dur',
        "'1.5dur' is out of range; expected a non-negative time in epochs, batches, a fraction of the whole run, "
        "such as '36ep' or '100ba' or '0.1dur'",
    ),
    ('ema', 'update_interval', '0ep', f"'0ep' is out of range; expected {UNIT_TIME}"),
    ('ema', 'update_interval', '1sp', f"'1sp' is in a unit this key does not take; expected {UNIT_TIME}"),
    ('progressive_resizing', 'initial_scale', 0, '0.0 is out of range; expected a finite number > 0 and <= 1'),
    ('progressive_resizing', 'initial_scale', 1.5, '1.5 is out of range; expected a finite number > 0 and <= 1'),
    ('progressive_resizing', 'delay_fraction', -0.1, '-0.1 is out of range; expected a finite number >= 0 and <= 1'),
    ('progressive_resizing', 'finetune_fraction', 1.2, '1.2 is out of range; expected a finite number >= 0 and <= 1'),
    ('progressive_resizing', 'mode', 'bilinear', "'bilinear' is not one of crop, resize"),
    ('progressive_resizing', 'size_increment', 0, '0 is out of range; expected an integer >= 1'),
    ('mixup', 'alpha', -0.2, '-0.2 is out of range; expected a finite number >= 0'),
    ('mixup', 'alpha', float('inf'), 'inf is out of range; expected a finite number >= 0'),
    ('cutmix', 'alpha', -1, '-1.0 is out of range; expected a finite number >= 0'),
    ('cutout', 'num_holes', 0, '0 is out of range; expected an integer >= 1'),
    ('cutout', 'length', 1.0, '1.0 is out of range; expected a finite number > 0 and < 1'),
    ('cutout', 'length', 0, '0.0 is out of range; expected a finite number > 0 and < 1'),
    ('colout', 'p_row', 1, '1.0 is out of range; expected a finite number >= 0 and < 1'),
    ('colout', 'p_col', -0.5, '-0.5 is out of range; expected a finite number >= 0 and < 1'),
    ('colout', 'resize_target', 'yes', "'yes' is not true, false or 'auto'"),
    ('colout', 'resize_target', 1, "1 is not true, false or 'auto'"),
    ('randaugment', 'severity', 11, '11 is out of range; expected an integer >= 0 and <= 10'),
    ('randaugment', 'depth', -1, '-1 is out of range; expected an integer >= 0'),
    ('randaugment', 'augmentation_set', 'most', "'most' is not one of all, safe, original"),
    ('augmix', 'severity', -1, '-1 is out of range; expected an integer >= 0 and <= 10'),
    (
        'augmix',
        'depth',
        0,
        '0 is out of range; expected -1 (a random depth of 1 to 3 per chain) or an integer >= 1',
    ),
    ('augmix', 'width', 0, '0 is out of range; expected an integer >= 1'),
    ('augmix', 'alpha', 0, '0.0 is out of range; expected a finite number > 0'),
    ('augmix', 'augmentation_set', 'ALL', "'ALL' is not one of all, safe, original"),
    ('layer_freezing', 'freeze_start', 1, '1.0 is out of range; expected a finite number >= 0 and < 1'),
    ('layer_freezing', 'freeze_level', 1.01, '1.01 is out of range; expected a finite number >= 0 and <= 1'),
    ('stochastic_depth', 'target_layer_name', 'BasicBlock', "'BasicBlock' is not one of ResNetBottleneck"),
    ('stochastic_depth', 'stochastic_method', 'layer', "'layer' is not one of block, sample"),
    ('stochastic_depth', 'drop_rate', 2, '2.0 is out of range; expected a finite number >= 0 and <= 1'),
    ('stochastic_depth', 'drop_distribution', 'exponential', "'exponential' is not one of uniform, linear"),
    (
        'stochastic_depth',
        'drop_warmup',
        '10ba',
        "'10ba' is in a unit this key does not take; expected a non-negative time in a fraction of the whole run, "
        "such as '0.1dur'",
    ),
    ('stochastic_depth', 'drop_warmup', 1.5, '1.5 is out of range; expected a finite number >= 0 and <= 1'),
    ('sam', 'rho', 0, '0.0 is out of range; expected a finite number > 0'),
    ('sam', 'epsilon', -1e-12, '-1e-12 is out of range; expected a finite number > 0'),
    ('sam', 'interval', 0, '0 is out of range; expected an integer >= 1'),
    (
        'swa',
        'swa_start',
        '10ba',
        "'10ba' is in a unit this key does not take; expected a non-negative time in "
        "epochs, a fraction of the whole run, such as '36ep' or '0.1dur'",
    ),
    ('swa', 'swa_end', '0dur', f"'0dur' is out of range; expected {RUN_TIME}"),
    ('swa', 'update_interval', '0.5dur', f"'0.5dur' is in a unit this key does not take; expected {UNIT_TIME}"),
    ('swa', 'anneal_strategy', 'exp', "'exp' is not one of linear, lin, cos, cosine"),
    ('swa', 'anneal_steps', 0, '0 is out of range; expected an integer >= 1'),
    ('swa', 'swa_lr', -0.1, '-0.1 is out of range; expected a finite number >= 0'),
    ('selective_backprop', 'keep', 0, '0.0 is out of range; expected a finite number > 0 and <= 1'),
    ('selective_backprop', 'scale_factor', 2, '2.0 is out of range; expected a finite number > 0 and <= 1'),
    ('selective_backprop', 'interrupt', -1, '-1 is out of range; expected an integer >= 0'),
    ('selective_backprop', 'start', 1.5, '1.5 is out of range; expected a finite number >= 0 and <= 1'),
    ('seq_length_warmup', 'duration', 0, '0.0 is out of range; expected a finite number > 0 and <= 1'),
    ('seq_length_warmup', 'step_size', 0, '0 is out of range; expected an integer >= 1'),
    ('squeeze_excite', 'latent_channels', 0, '0.0 is out of range; expected a finite number > 0'),
    ('squeeze_excite', 'min_channels', -8, '-8 is out of range; expected an integer >= 0'),
    (
        'factorize',
        'latent_channels',
        1.5,
        "1.5 is out of range; expected an integer >= 1 or a fraction >= 0 and < 1 of the layer's width",
    ),
    (
        'factorize',
        'latent_channels',
        0,
        "0 is out of range; expected an integer >= 1 or a fraction >= 0 and < 1 of the layer's width",
    ),
    (
        'factorize',
        'latent_features',
        0.5,
        "0.5 is out of range; expected an integer >= 1 or a fraction >= 0 and < 0.5 of the layer's width",
    ),
    (
        'factorize',
        'latent_features',
        'half',
        "'half' is not a number; expected an integer >= 1 or a fraction >= 0 and < 0.5 of the layer's width",
    ),
    ('factorize', 'min_features', -1, '-1 is out of range; expected an integer >= 0'),
    ('ghost_batchnorm', 'ghost_batch_size', 0, '0 is out of range; expected an integer >= 1'),
    ('gradient_clipping', 'clipping_type', 'l2', "'l2' is not one of adaptive, norm, value"),
    ('gradient_clipping', 'clipping_threshold', 0, '0.0 is out of range; expected a finite number > 0'),
    ('gyro_dropout', 'p', 1, '1.0 is out of range; expected a finite number >= 0 and < 1'),
    ('gyro_dropout', 'sigma', 0, '0 is out of range; expected an integer >= 1'),
    ('gyro_dropout', 'tau', -1, '-1 is out of range; expected an integer >= 1'),
    ('weight_standardization', 'n_last_layers_ignore', -1, '-1 is out of range; expected an integer >= 0'),
    ('alibi', 'max_sequence_length', 0, '0 is out of range; expected an integer >= 1'),
    ('alibi', 'train_sequence_length_scaling', 2, '2.0 is out of range; expected a finite number > 0 and <= 1'),
    (
        'gated_linear_units',
        'act_fn',
        'gelu',
        "'gelu' cannot be given in a recipe: act_fn takes a Python function; leave it out to keep the model's own "
        'activation',
    ),
]


@pytest.mark.parametrize(
    'name,option,value,problem', OUT_OF_RANGE, ids=[f'{n}.{o}={v!r}' for n, o, v, _ in OUT_OF_RANGE]
)
def test_an_out_of_range_value_is_worded(name, option, value, problem):
    assert algorithm_option_problem(name, option, value) == problem


IN_RANGE = [
    ('label_smoothing', 'smoothing', 0),
    ('label_smoothing', 'smoothing', 1.0),
    ('colout', 'p_row', 0.0),
    ('colout', 'resize_target', False),
    ('augmix', 'depth', -1),
    ('augmix', 'depth', 2),
    ('factorize', 'latent_channels', 1),
    ('factorize', 'latent_channels', 0.0),
    ('factorize', 'latent_features', 512),
    ('ema', 'half_life', None),
    ('ema', 'smoothing', 0.999),
    ('ema', 'ema_start', '1dur'),
    ('ema', 'ema_start', '0ep'),
    ('stochastic_depth', 'drop_warmup', 0),
    ('stochastic_depth', 'drop_warmup', '0.5dur'),
    ('swa', 'swa_lr', None),
    ('swa', 'swa_lr', 0),
    ('layer_freezing', 'freeze_level', 1),
    ('mixup', 'alpha', 0),
    ('progressive_resizing', 'initial_scale', 1),
    ('gated_linear_units', 'act_fn', None),
    ('blurpool', 'replace_convs', 'not checked here'),  # a bool: the signature's type check refuses it
    ('cutmix', 'input_key', 'image'),  # takes any value
]


@pytest.mark.parametrize('name,option,value', IN_RANGE, ids=[f'{n}.{o}={v!r}' for n, o, v in IN_RANGE])
def test_a_value_in_range_passes(name, option, value):
    assert algorithm_option_problem(name, option, value) is None


def test_an_integer_beyond_float_range_is_out_of_range_not_a_crash():
    huge = -(10**400)
    assert algorithm_option_problem('ghost_batchnorm', 'ghost_batch_size', huge) == (
        'a negative integer of 401 digits is out of range; expected an integer >= 1'
    )


# --- options together ------------------------------------------------------------------------------------------

RAMP = (
    'leaves no time to grow from initial_scale to full size (Composer divides by 1 - delay_fraction - '
    'finetune_fraction); lower either so that they add up to less than 1'
)
CROSSED = [
    ('progressive_resizing', {'delay_fraction': 0.8}, 'delay_fraction', f'0.8 plus finetune_fraction 0.2 {RAMP}'),
    (
        'progressive_resizing',
        {'delay_fraction': 0.5, 'finetune_fraction': 0.6},
        'delay_fraction',
        f'0.5 plus finetune_fraction 0.6 {RAMP}',
    ),
    (
        'selective_backprop',
        {'start': 0.9},
        'start',
        '0.9 is not before end 0.9, so selective backprop would never run; use start < end',
    ),
    (
        'selective_backprop',
        {'start': 0.5, 'end': 0.2},
        'start',
        '0.5 is not before end 0.2, so selective backprop would never run; use start < end',
    ),
    (
        'seq_length_warmup',
        {'max_seq_length': 12},
        'max_seq_length',
        '12 is not at least step_size 8 above min_seq_length 8 (Composer divides by (max_seq_length - '
        'min_seq_length) // step_size); use max_seq_length >= 16',
    ),
    (
        'seq_length_warmup',
        {'min_seq_length': 1024},
        'max_seq_length',
        '1024 is not at least step_size 8 above min_seq_length 1024 (Composer divides by (max_seq_length - '
        'min_seq_length) // step_size); use max_seq_length >= 1032',
    ),
    (
        'ema',
        {'smoothing': 0.99},
        'smoothing',
        "0.99 is given with half_life '1000ba' and EMA takes one of them; set half_life to null",
    ),
    (
        'ema',
        {'half_life': None},
        'half_life',
        "None, and so is smoothing; EMA needs one of them: a half_life such as '1000ba' or a smoothing such as 0.999",
    ),
]


@pytest.mark.parametrize('name,options,option,problem', CROSSED, ids=[f'{n}-{o}' for n, o, _, _ in CROSSED])
def test_options_that_do_not_fit_together_are_named(name, options, option, problem):
    assert algorithm_cross_problem(name, composer_algorithms()[name], options) == (option, problem)


@pytest.mark.parametrize(
    'name,options',
    [
        ('ema', {'half_life': None, 'smoothing': 0.99}),
        ('progressive_resizing', {'delay_fraction': 0.4, 'finetune_fraction': 0.2}),
        ('progressive_resizing', {'delay_fraction': 'soon'}),  # its own range reports it, not the pair
        ('seq_length_warmup', {'max_seq_length': 16}),
        ('label_smoothing', {'smoothing': 0.5}),  # no rule ties its options
    ],
)
def test_options_that_fit_together_pass(name, options):
    assert algorithm_cross_problem(name, composer_algorithms()[name], options) is None


# --- the recipe path -----------------------------------------------------------------------------------------------

REFUSED = [
    ('label_smoothing.smoothing=1.5', 'label_smoothing.smoothing: 1.5 is out of range'),
    ('blurpool.min_channels=-1', 'blurpool.min_channels: -1 is out of range; expected an integer >= 0'),
    ('ema.half_life=0ba', "ema.half_life: '0ba' is out of range; expected a positive time in epochs, batches"),
    ('ema.smoothing=0.99', "ema.smoothing: 0.99 is given with half_life '100ba' and EMA takes one of them"),
    ('progressive_resizing.initial_scale=0', 'progressive_resizing.initial_scale: 0.0 is out of range'),
    ('progressive_resizing.delay_fraction=0.8', 'progressive_resizing.delay_fraction: 0.8 plus finetune_fraction 0.2'),
    ('mixup.alpha=-1', 'mixup.alpha: -1.0 is out of range; expected a finite number >= 0'),
    ('cutout.num_holes=0', 'cutout.num_holes: 0 is out of range; expected an integer >= 1'),
    ('colout.p_row=1', 'colout.p_row: 1.0 is out of range; expected a finite number >= 0 and < 1'),
    ('cutout.num_holes=0', 'cutout.num_holes: 0 is out of range'),
    ('sam.interval=0', 'sam.interval: 0 is out of range; expected an integer >= 1'),
]


@pytest.mark.parametrize('override,message', REFUSED, ids=[o for o, _ in REFUSED])
def test_the_cli_refuses_an_out_of_range_option_before_training(tmp_path, monkeypatch, capsys, override, message):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / 'run'
    assert main(train_args(folder, overrides=(f'algorithms.{override}',))) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'channels-last train: error: {RECIPE}: algorithms.{message}'), err
    assert err.count('\n') == 1
    assert not folder.exists()
