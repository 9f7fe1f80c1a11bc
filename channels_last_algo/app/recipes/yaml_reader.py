"""YAML as a recipe takes it: UTF-8 text of bounded size, no duplicate keys, bounded alias expansion.

``yaml.safe_load`` keeps the last of two equal keys, so a second ``train:`` section silently drops
every key of the first; it also expands aliases by reference, so ten nested lines of ``[*a, *a, ...]``
("billion laughs") make a value of a billion items that the first walk over it (a check, a log, a
copy) cannot finish. :func:`parse_yaml` refuses both, with the line, before any value is built;
:func:`read_yaml_file` also refuses a file that is not UTF-8 text or is too large to be a recipe.
Each raises :class:`YamlError`, one line with the file, line and fix.

Example:
    >>> parse_yaml('train: {max_duration: 2ep}', 'r.yaml')
    {'train': {'max_duration': '2ep'}}
    >>> parse_yaml('train: {a: 1}\\ntrain: {b: 2}', 'r.yaml')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    channels_last_algo.app.recipes.yaml_reader.YamlError: r.yaml: line 2: the key 'train' is given twice ...
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

import yaml

__all__ = ['MAX_NODES', 'MAX_RECIPE_BYTES', 'YamlError', 'parse_yaml', 'read_yaml_file']

# A recipe has about a hundred values; a thousand times that is far beyond any hand-written one and still
# checked in milliseconds. A value that expands (through aliases) to more nodes than this is refused.
MAX_NODES = 100_000
MAX_RECIPE_BYTES = 1 << 20  # 1 MiB: a recipe is a few KiB of text


class YamlError(ValueError):
    """YAML a recipe cannot be: the message names the file, the line and the fix."""


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _expanded_nodes(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many nodes ``node`` is once every alias in it is expanded (each shared node counted once per use)."""
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = MAX_NODES + 1  # a node that contains itself expands without end
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [item for pair in node.value for item in pair]
    sizes[id(node)] = 1 + sum(_expanded_nodes(child, sizes) for child in children)
    return sizes[id(node)]


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with a key given twice (merge keys ``<<`` excepted:
    overriding what they bring in is their purpose)."""

    source = '<yaml>'  # the file, for messages

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == 'tag:yaml.org,2002:merge':
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, (str, int, float, bool, type(None))):
                    continue  # an unhashable key: the base constructor refuses it
                if key in first:
                    raise YamlError(
                        f'{self.source}: line {_line(key_node)}: the key {key!r} is given twice (first on line '
                        f'{first[key]}); YAML would keep only the second: merge them into one'
                    )
                first[key] = _line(key_node)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, source: str) -> Any:
    """The value of the YAML ``text`` (from ``source``, for messages); :class:`YamlError` if it is not valid
    YAML, gives a key twice in one mapping, nests deeper than Python recurses, or expands through aliases to
    more than :data:`MAX_NODES` nodes."""
    loader = _RecipeLoader(text)
    loader.source = source
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_nodes(node, {})
        if size > MAX_NODES:
            raise YamlError(
                f'{source}: the YAML expands (through its aliases *name) to more than {MAX_NODES:,} values; '
                'a recipe has a few hundred: write the values out, or use fewer nested aliases'
            )
        return loader.construct_document(node)
    except YamlError:
        raise
    except ValueError as error:  # a value Python will not build: an integer of more than 4300 digits
        raise YamlError(f'{source}: a value YAML cannot read: {str(error).splitlines()[0]}') from None
    except RecursionError:
        raise YamlError(f'{source}: the YAML nests too deeply to read; a recipe nests three levels') from None
    except yaml.YAMLError as error:
        mark = getattr(error, 'problem_mark', None)
        where = f' at line {mark.line + 1}, column {mark.column + 1}' if mark else ''
        raise YamlError(f'{source}: not valid YAML{where}: {getattr(error, "problem", None) or error}') from None
    finally:
        loader.dispose()


def read_yaml_file(path: Union[str, os.PathLike]) -> Any:
    """The YAML value in the file ``path`` (see :func:`parse_yaml`); :class:`YamlError` also when the file
    cannot be read, is larger than :data:`MAX_RECIPE_BYTES` or is not UTF-8 text."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_RECIPE_BYTES:
            raise YamlError(f'{path}: {size:,} bytes is too large for a recipe (at most {MAX_RECIPE_BYTES:,})')
        data = path.read_bytes()
    except OSError as error:
        reason = error.strerror or error
        raise YamlError(f'{path}: cannot be read ({reason}); check the path and its permissions') from None
    try:
        text = data.decode('utf-8-sig')
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b'\n') + 1
        raise YamlError(
            f'{path}: line {line}: the byte 0x{data[error.start]:02x} is not UTF-8 text; save the recipe as UTF-8'
        ) from None
    return parse_yaml(text, str(path))
