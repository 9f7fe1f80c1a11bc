"""The valid values of every Composer algorithm option a recipe accepts, from one table.

A recipe's ``algorithms.<name>.<option>`` is checked against the algorithm's signature (its type)
by :mod:`~channels_last_algo.app.recipes.algorithms`; :data:`ALGORITHM_RANGES` adds what the value must
satisfy (a range, a set of choices, a time string's units), read from each constructor's code and
docstring, since Composer's constructors check few of them and a smoothing factor of 1.5 would
otherwise train. :data:`ALGORITHM_CROSS_RULES` holds the rules that tie two options of one
algorithm together. Nothing here needs Composer; ``channels_last``, this project's algorithm, is
checked by :data:`channels_last_algo.core.options.OPTIONS` instead.

Example:
    >>> algorithm_option_problem('label_smoothing', 'smoothing', 1.5)
    '1.5 is out of range; expected a finite number >= 0 and <= 1'
    >>> algorithm_option_problem('ema', 'half_life', '0ba')
    "'0ba' is out of range; expected a positive time in epochs, batches, such as '36ep' or '100ba'"
    >>> algorithm_option_problem('label_smoothing', 'smoothing', 0.1) is None
    True
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Optional

from channels_last_algo.app.recipes.value_rules import Rule, between, choices, count_or, described, time_string

__all__ = [
    'ALGORITHM_CROSS_RULES',
    'ALGORITHM_RANGES',
    'NOT_ON_THIS_DATA_PATH',
    'CrossRule',
    'algorithm_cross_problem',
    'algorithm_option_problem',
]


# --- rules for algorithm options ---------------------------------------------------------------------


def _not_a_number(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float))


def _real(low: float, high: float = math.inf, *, open_low: bool = False, open_high: bool = False) -> Rule:
    """A float option's range; an integer is read as a float (as the recipe schema reads one)."""
    inner = between(low, high, open_low=open_low, open_high=open_high)

    def rule(value: Any) -> Optional[str]:
        if _not_a_number(value):
            return f'{value!r} is not a number; expected a finite number {inner.expected}'
        return inner(float(value))

    return described(f'a number {inner.expected}', rule)


def _whole(low: int, high: float = math.inf) -> Rule:
    """An integer option's range."""
    inner = between(low, high)

    def rule(value: Any) -> Optional[str]:
        if isinstance(value, bool) or not isinstance(value, int):
            return f'{value!r} is not an integer; expected an integer {inner.expected}'
        return inner(value)

    return described(f'an integer {inner.expected}', rule)


def _or_none(rule: Rule, meaning: str) -> Rule:
    """``rule``, or null (meaning ``meaning``)."""
    return described(f'null ({meaning}) or {rule.expected}', lambda value: None if value is None else rule(value))


def _width_or_fraction(fraction_below: float) -> Rule:
    """An integer width >= 1, or a float fraction of a layer's width in ``[0, fraction_below)``."""
    expected = f"an integer >= 1 or a fraction >= 0 and < {fraction_below:g} of the layer's width"

    def rule(value: Any) -> Optional[str]:
        if _not_a_number(value):
            return f'{value!r} is not a number; expected {expected}'
        if (value >= 1) if isinstance(value, int) else (0 <= value < fraction_below):
            return None
        return f'{value!r} is out of range; expected {expected}'

    return described(expected, rule)


def _flag_or(choice: str) -> Rule:
    """``true``, ``false`` or the string ``choice``."""
    expected = f'true, false or {choice!r}'
    return described(
        expected, lambda value: None if isinstance(value, bool) or value == choice else f'{value!r} is not {expected}'
    )


def _fraction_or_time() -> Rule:
    """A fraction of the run, as a number in [0, 1] or a time string in ``dur``."""
    as_number, as_time = _real(0, 1), time_string('dur', allow_zero=True)
    return described(
        f'{as_number.expected} or {as_time.expected}',
        lambda value: as_time(value) if isinstance(value, str) else as_number(value),
    )


def _null_only(why: str) -> Rule:
    """Only null (the default): a recipe cannot write what the option takes (``why``)."""
    return described('null', lambda value: None if value is None else f'{value!r} cannot be given in a recipe: {why}')


_PROBABILITY = _real(0, 1)
_BELOW_ONE = _real(0, 1, open_high=True)  # 1 itself breaks the algorithm (see where it is used)
_FACTOR = _real(0, 1, open_low=True)  # a scale or fraction that 0 would turn into an empty input
_POSITIVE = _real(0, open_low=True)
_PSEUDOCOUNT = _real(0)  # of Beta(alpha, alpha); CutMix and MixUp assert alpha >= 0 and take 0 as a coefficient of 0
_COUNT = _whole(1)
_CHANNELS = _whole(0)  # a layer-width threshold: layers at least this wide are changed (0: all)
_SEVERITY = _whole(0, 10)  # Composer's augmentation intensity scale
_AUGMENTATION_SETS = choices('all', 'safe', 'original')  # composer.algorithms.utils.augmentation_sets


# Algorithms the recipes' data path cannot run, and why: it yields uint8 NHWC batches, normalised on the device
# inside the model's first step (channels_last_algo.app.data.loaders), never PIL images.
NOT_ON_THIS_DATA_PATH: dict[str, str] = {
    'randaugment': 'it transforms PIL images in the dataset, and the recipe data path decodes to uint8 arrays',
    'augmix': 'it transforms PIL images in the dataset, and the recipe data path decodes to uint8 arrays',
    'selective_backprop': 'it scores the raw uint8 batch with the model before the device normalises it',
}


# --- the table -----------------------------------------------------------------------------------------

# Recipe algorithm name (the registry's) -> option -> the rule its value must satisfy.
ALGORITHM_RANGES: dict[str, dict[str, Rule]] = {
    'alibi': {
        'max_sequence_length': _COUNT,
        # the training batch is reshaped to sequences this fraction as long (and 1 / it times as many)
        'train_sequence_length_scaling': _FACTOR,
    },
    'augmix': {
        'severity': _SEVERITY,
        'depth': count_or(-1, 'a random depth of 1 to 3 per chain'),
        'width': _COUNT,
        'alpha': _POSITIVE,  # Beta and Dirichlet pseudocount, "must be > 0" (docstring)
        'augmentation_set': _AUGMENTATION_SETS,
    },
    'blurpool': {'min_channels': _CHANNELS},
    'colout': {
        # the fraction of rows / columns dropped; at 1 none is kept (int(0 * H) = 0), an empty image
        'p_row': _BELOW_ONE,
        'p_col': _BELOW_ONE,
        'resize_target': _flag_or('auto'),
    },
    'composer_channels_last': {},
    'cutmix': {'alpha': _PSEUDOCOUNT},
    'cutout': {
        'num_holes': _COUNT,
        'length': _real(0, 1, open_low=True, open_high=True),  # the hole's side as a fraction, "in (0, 1)"
    },
    'ema': {
        # 0 would divide by zero: smoothing = 2 ** -(update_interval / half_life)
        'half_life': _or_none(time_string('ep ba'), 'when smoothing is given'),
        'smoothing': _or_none(_real(0, 1, open_low=True, open_high=True), 'when half_life is given'),
        'ema_start': time_string('ep ba dur', allow_zero=True),
        # updates at steps where step % update_interval == 0, so not 0
        'update_interval': _or_none(time_string('ep ba'), "1 in half_life's unit, or 1ba with smoothing"),
    },
    'factorize': {
        'min_channels': _CHANNELS,
        'latent_channels': _width_or_fraction(1),
        'min_features': _CHANNELS,
        'latent_features': _width_or_fraction(0.5),  # "a float within [0, 0.5)" (docstring)
    },
    'gated_linear_units': {
        'act_fn': _null_only("act_fn takes a Python function; leave it out to keep the model's own activation"),
    },
    'ghost_batchnorm': {'ghost_batch_size': _COUNT},  # the batch is split into ceil(batch / size) chunks
    'gradient_clipping': {
        'clipping_type': choices('adaptive', 'norm', 'value'),
        'clipping_threshold': _POSITIVE,  # 0 clips every gradient to 0; a negative bound inverts the clamp
    },
    'gyro_dropout': {
        'p': _BELOW_ONE,  # kept units are scaled by 1 / (1 - p)
        'sigma': _COUNT,
        'tau': _COUNT,
    },
    'label_smoothing': {'smoothing': _PROBABILITY},
    'layer_freezing': {
        'freeze_start': _BELOW_ONE,  # freezing begins after this fraction of the run: at 1 it never does
        'freeze_level': _PROBABILITY,  # the fraction of layers frozen at the end (default 1.0: all)
    },
    # apply_at takes an Event object, which a recipe cannot write; Composer refuses any other value itself
    'low_precision_groupnorm': {},
    'low_precision_layernorm': {},
    'mixup': {'alpha': _PSEUDOCOUNT},
    'no_op_model': {},
    'progressive_resizing': {
        'mode': choices('crop', 'resize'),
        'initial_scale': _FACTOR,
        'finetune_fraction': _PROBABILITY,
        'delay_fraction': _PROBABILITY,  # "in between 0 and 1" (docstring); Composer checks only the sum
        'size_increment': _COUNT,  # sizes are rounded to a multiple of it (divided by it)
    },
    'randaugment': {
        'severity': _SEVERITY,
        'depth': _whole(0),  # augmentations applied per image
        'augmentation_set': _AUGMENTATION_SETS,
    },
    'sam': {
        'rho': _POSITIVE,  # "Must be greater than 0" (docstring)
        'epsilon': _POSITIVE,  # added to the gradient norm it divides by
        'interval': _COUNT,  # SAM runs where (step + 1) % interval == 0
    },
    'selective_backprop': {
        'start': _PROBABILITY,
        'end': _PROBABILITY,
        'keep': _FACTOR,  # the selection weights are ranks ** (1 / keep - 1)
        'scale_factor': _FACTOR,  # the selection pass's downsampling; Composer refuses > 1 at the first batch
        'interrupt': _whole(0),  # a plain step every interrupt batches; 0: never
    },
    'seq_length_warmup': {
        'duration': _FACTOR,  # 0 warmup steps would divide by zero at the first batch
        'min_seq_length': _COUNT,
        'max_seq_length': _COUNT,
        'step_size': _COUNT,
    },
    'squeeze_excite': {
        'latent_channels': _POSITIVE,  # a width (>= 1) or, below 1, a fraction of the conv's output channels
        'min_channels': _CHANNELS,
    },
    'stochastic_depth': {
        'target_layer_name': choices('ResNetBottleneck'),  # the keys of Composer's _STOCHASTIC_LAYER_MAPPING
        'stochastic_method': choices('block', 'sample'),
        'drop_rate': _PROBABILITY,
        'drop_distribution': choices('uniform', 'linear'),
        # compared with the run's elapsed fraction, so a time in ep or ba fails at the first batch
        'drop_warmup': _fraction_or_time(),
    },
    'swa': {
        'swa_start': time_string('ep dur', allow_zero=True),
        'swa_end': time_string('ep dur'),
        'update_interval': time_string('ep ba'),  # updates where step % update_interval == 0
        'anneal_strategy': choices('linear', 'lin', 'cos', 'cosine'),
        'anneal_steps': _COUNT,
        'swa_lr': _or_none(_real(0), 'the last learning rate of the schedule'),
    },
    'weight_standardization': {'n_last_layers_ignore': _whole(0)},
}


# --- rules that tie options together -------------------------------------------------------------------


class CrossRule(NamedTuple):
    """A rule on several ``options`` of one algorithm; ``problem`` gets their values in that order and
    words what is wrong with the first of them, or returns None."""

    options: tuple[str, ...]
    problem: Callable[..., Optional[str]]


def _ramp_problem(delay: float, finetune: float) -> Optional[str]:
    if 1 - finetune - delay > 0:
        return None
    return (
        f'{delay!r} plus finetune_fraction {finetune!r} leaves no time to grow from initial_scale to full size '
        '(Composer divides by 1 - delay_fraction - finetune_fraction); lower either so that they add up to less than 1'
    )


def _interval_problem(start: float, end: float) -> Optional[str]:
    if start < end:
        return None
    return f'{start!r} is not before end {end!r}, so selective backprop would never run; use start < end'


def _warmup_steps_problem(longest: int, shortest: int, step: int) -> Optional[str]:
    if (longest - shortest) // step >= 1:
        return None
    return (
        f'{longest!r} is not at least step_size {step!r} above min_seq_length {shortest!r} (Composer divides by '
        f'(max_seq_length - min_seq_length) // step_size); use max_seq_length >= {shortest + step}'
    )


def _both_averages_problem(smoothing: Optional[float], half_life: Optional[str]) -> Optional[str]:
    if smoothing is None or half_life is None:
        return None
    return f'{smoothing!r} is given with half_life {half_life!r} and EMA takes one of them; set half_life to null'


def _no_average_problem(half_life: Optional[str], smoothing: Optional[float]) -> Optional[str]:
    if half_life is not None or smoothing is not None:
        return None
    return "None, and so is smoothing; EMA needs one of them: a half_life such as '1000ba' or a smoothing such as 0.999"


# Algorithm -> the rules between its options; Composer's constructors check the other pairs themselves
# (SWA's swa_start < swa_end, BlurPool's replace_convs or replace_maxpools, ColOut's resize_target with batch).
ALGORITHM_CROSS_RULES: dict[str, list[CrossRule]] = {
    'ema': [
        CrossRule(('smoothing', 'half_life'), _both_averages_problem),
        CrossRule(('half_life', 'smoothing'), _no_average_problem),
    ],
    'progressive_resizing': [CrossRule(('delay_fraction', 'finetune_fraction'), _ramp_problem)],
    'selective_backprop': [CrossRule(('start', 'end'), _interval_problem)],
    'seq_length_warmup': [CrossRule(('max_seq_length', 'min_seq_length', 'step_size'), _warmup_steps_problem)],
}


# --- checking ------------------------------------------------------------------------------------------


def algorithm_option_problem(name: str, option: str, value: Any) -> Optional[str]:
    """What is wrong with ``value`` for ``option`` of the algorithm ``name`` (a recipe's algorithm
    name), or None; None too for an option without a rule (a bool, a batch key)."""
    rule = ALGORITHM_RANGES.get(name, {}).get(option)
    return None if rule is None else rule(value)


def algorithm_cross_problem(name: str, cls: type, options: Mapping[str, Any]) -> Optional[tuple[str, str]]:
    """The first rule of :data:`ALGORITHM_CROSS_RULES` that ``options`` of the algorithm ``name``
    (class ``cls``, whose signature gives the options left out) break, as ``(option, problem)``; None
    when they fit. A rule is skipped while one of its options breaks its own range.

    Example:
        >>> class Ramp:
        ...     def __init__(self, delay_fraction=0.5, finetune_fraction=0.2): ...
        >>> algorithm_cross_problem('progressive_resizing', Ramp, {'finetune_fraction': 0.5})[0]
        'delay_fraction'
    """
    defaults = {key: p.default for key, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}
    values = {**defaults, **options}
    for rule in ALGORITHM_CROSS_RULES.get(name, []):
        if any(key not in values or algorithm_option_problem(name, key, values[key]) for key in rule.options):
            continue
        problem = rule.problem(*(values[key] for key in rule.options))
        if problem is not None:
            return rule.options[0], problem
    return None
