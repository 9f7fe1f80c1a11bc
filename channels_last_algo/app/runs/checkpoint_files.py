"""The checkpoint files of a run: their names, whether one is whole, and the training state it holds.

Nothing here needs Composer: a checkpoint is checked as a zip archive (``torch.save``'s format) and read
with ``torch.load``. :class:`RunFolderError` is the one-line refusal of a run folder or checkpoint.

Example:
    >>> CHECKPOINT_NAME.format(epoch=1, batch=6), bool(CHECKPOINT_PATTERN.match('ep1-ba6-rank0.pt'))
    ('ep1-ba6-rank0.pt', True)
    >>> check_readable(Path('missing.pt'))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    channels_last_algo.app.runs.checkpoint_files.RunFolderError: missing.pt does not exist; give --resume ...
"""

from __future__ import annotations

import dataclasses
import os
import re
import zipfile
from pathlib import Path
from typing import Any, Optional

__all__ = [
    'CHECKPOINT_NAME',
    'CHECKPOINT_PATTERN',
    'LATEST_NAME',
    'Checkpoint',
    'RunFolderError',
    'check_readable',
    'not_a_file',
    'progress',
    'read_state',
]

CHECKPOINT_PATTERN = re.compile(r'^ep(\d+)-ba(\d+)-rank0\.pt$')
LATEST_NAME = 'latest-rank0.pt'
CHECKPOINT_NAME = 'ep{epoch}-ba{batch}-rank0.pt'


class RunFolderError(ValueError):
    """A run folder or checkpoint that cannot be used as asked: ``problem`` names the file and what is
    wrong, and the message adds the ``fix``."""

    def __init__(self, problem: str, fix: str = '') -> None:
        super().__init__(f'{problem}; {fix}' if fix else problem)
        self.problem = problem


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint file of the run folder and the training time it was written at."""

    path: Path
    epoch: int
    batch: int


def not_a_file(path: Path) -> Optional[str]:
    """What ``path`` is when it is there but no regular file of its own: ``'a link to X'`` (``', which
    does not exist'``), ``'a folder'`` or ``'not a regular file'`` (a pipe); None otherwise."""
    if path.is_symlink():
        return f'a link to {os.readlink(path)}' + ('' if path.exists() else ', which does not exist')
    if path.is_file() or not path.exists():
        return None
    return 'a folder' if path.is_dir() else 'not a regular file'


def check_readable(path: Path) -> None:
    """RunFolderError naming ``path`` unless it is a whole checkpoint: a zip archive (``torch.save``'s
    format) whose every member matches its CRC. Reads the file once; unpickles nothing."""
    if not path.is_file():
        state = f'is {not_a_file(path)}' if path.exists() or path.is_symlink() else 'does not exist'
        raise RunFolderError(f'{path} {state}', 'give --resume a checkpoint file, or --resume alone for the newest one')
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        damaged = f'not a whole checkpoint ({error})'
    else:
        damaged = None if damaged is None else f'member {damaged} fails its checksum'
    if damaged is not None:
        raise RunFolderError(
            f'{path} is truncated or corrupt: {damaged}',
            'resume from an earlier checkpoint with --resume PATH, or delete the file and use --resume for the newest '
            'readable one',
        )


def read_state(path: Path) -> dict[str, Any]:
    """The ``state`` of the Composer checkpoint at ``path``, memory-mapped (tensors are read
    when touched). It unpickles the file: read only checkpoints you trust, such as your own runs'."""
    import torch

    try:
        checkpoint = torch.load(path, map_location='cpu', mmap=True, weights_only=False)
    except Exception as error:  # a file torch cannot unpickle: say which, whatever the cause
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise RunFolderError(
            f'{path} cannot be read as a checkpoint ({reason})', 'resume another with --resume PATH'
        ) from error
    state = checkpoint.get('state') if isinstance(checkpoint, dict) else None
    try:
        progress(state)  # type: ignore[arg-type]
        whole = isinstance(state['model'], dict)  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        whole = False
    if not whole:
        raise RunFolderError(
            f'{path} is not a Composer training checkpoint (no state.model and state.timestamp)',
            'resume from a checkpoint that channels-last train wrote',
        )
    return state  # type: ignore[return-value]


def progress(state: dict[str, Any]) -> dict[str, int]:
    """The checkpoint's training time: epochs (``ep``), batches (``ba``) and samples (``sp``) done."""
    timestamp = state['timestamp']['Timestamp']
    return {'ep': int(timestamp['epoch']), 'ba': int(timestamp['batch']), 'sp': int(timestamp['sample'])}
