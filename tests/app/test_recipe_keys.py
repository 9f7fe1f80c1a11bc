"""The recipe key reference: made from the schema, printed by `channels-last train --help-keys`, and
docs/recipe_keys.md kept equal to it (no Composer needed)."""

import dataclasses
import sys
import typing
from pathlib import Path

import pytest
from recipe_runs import RECIPE

from channels_last_algo.app.cli.entry import main
from channels_last_algo.app.recipes.keys import recipe_keys_reference, schema_keys
from channels_last_algo.app.recipes.loading import load_recipe
from channels_last_algo.app.recipes.schema import Recipe, RecipeError
from channels_last_algo.core.options import OPTIONS, options_reference

DOC = Path(__file__).resolve().parents[2] / 'docs' / 'recipe_keys.md'


def test_the_doc_is_the_reference_regenerated():
    assert DOC.read_text() == recipe_keys_reference(), (
        'docs/recipe_keys.md is out of date: channels-last train --help-keys > docs/recipe_keys.md'
    )


def test_the_options_doc_is_the_table_regenerated():
    assert (DOC.parent / 'options.md').read_text() == options_reference(), (
        'docs/options.md is out of date: python -c "from channels_last_algo.core.options import '
        "options_reference; print(options_reference(), end='')\" > docs/options.md"
    )


def test_every_schema_key_has_a_meaning_and_an_entry():
    text = recipe_keys_reference()
    keys = schema_keys()
    assert {'train.device_train_microbatch_size', 'data.synthetic_eval_samples', 'algorithms'} <= set(keys)
    for key in keys + [f'algorithms.channels_last.{option}' for option in OPTIONS]:
        assert f'- `{key}`: ' in text, key
    hints = typing.get_type_hints(Recipe)
    sections = [hints[f.name] for f in dataclasses.fields(Recipe) if dataclasses.is_dataclass(hints[f.name])]
    assert len(keys) == 2 + sum(len(dataclasses.fields(section)) for section in sections)  # name, algorithms
    for cls in [Recipe, *sections]:
        for field in dataclasses.fields(cls):
            assert field.metadata.get('internal') or field.metadata.get('doc'), f'{cls.__name__}.{field.name}'


def test_help_keys_needs_no_recipe_and_no_composer(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, 'composer', None)
    with pytest.raises(SystemExit) as exit_info:
        main(['train', '--help-keys'])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out == recipe_keys_reference()
    assert '- `train.device_train_microbatch_size`: images per forward and backward pass' in out
    assert "  int or str; default: `auto`; accepts: 'auto' (fit the device) or an integer >= 1" in out


def test_the_recipe_flag_of_input_selection_takes_the_same_values():
    """``algorithms.channels_last.inputs`` takes what ``InputSelection`` takes (core/test_inputs.py)."""
    assert load_recipe(RECIPE).algorithms['channels_last']['inputs'] == 'auto'
    assert load_recipe(RECIPE, ['algorithms.channels_last.inputs=[0]']).algorithms['channels_last']['inputs'] == [0]
    with pytest.raises(RecipeError, match=r'algorithms.channels_last.inputs: expected .auto.'):
        load_recipe(RECIPE, ['algorithms.channels_last.inputs=5'])
