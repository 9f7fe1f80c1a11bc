"""A run folder that holds one run: its lock, atomic checkpoint files, and the choice of where to resume.

:class:`RunFolder` is the folder a training run writes its checkpoints to. Opening it for a
run (:meth:`RunFolder.open`) takes a lock held for the whole run (a lock file with the pid,
locked with ``flock``, so a lock left by a dead process is known to be stale:
:mod:`~channels_last_algo.app.runs.run_lock`) and refuses a
folder that holds another run's checkpoints unless the run resumes them or is told to
overwrite them; :meth:`RunFolder.check` makes every refusal first, writing nothing.
Checkpoints are written atomically (:meth:`RunFolder.write`: a temporary file, ``fsync``,
``os.replace``), so an interruption leaves every earlier checkpoint whole, and a failed write
(a full disk) names the cause and the newest whole checkpoint. :meth:`RunFolder.resume_point`
picks the newest readable checkpoint, or checks a chosen one. Nothing here needs Composer:
checkpoints are checked and read with ``torch.load`` (:mod:`~channels_last_algo.app.runs.checkpoint_files`).

Example:
    >>> import tempfile
    >>> folder = RunFolder(Path(tempfile.mkdtemp()) / 'run')
    >>> with folder.open():
    ...     path = folder.write('ep0-ba2-rank0.pt', lambda file: file.write(b'weights'))
    >>> [c.path.name for c in folder.checkpoints()], folder.latest().resolve() == path
    (['ep0-ba2-rank0.pt'], True)
    >>> with folder.open():   # doctest: +ELLIPSIS
    ...     pass
    Traceback (most recent call last):
    ...
    channels_last_algo.app.runs.checkpoint_files.RunFolderError: .../run holds the checkpoints of an earlier run ...
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Optional, Union

from channels_last_algo.app.recipes.value_rules import parse_time
from channels_last_algo.app.runs.checkpoint_files import (
    CHECKPOINT_NAME,
    CHECKPOINT_PATTERN,
    LATEST_NAME,
    Checkpoint,
    RunFolderError,
    check_readable,
    not_a_file,
    progress,
    read_state,
)
from channels_last_algo.app.runs.run_lock import NEW_FOLDER, RunLock

__all__ = ['RunFolder']

log = logging.getLogger(__name__)

_PARTIAL = '.partial'
# what frees a checkpoint write that failed with an errno, before --resume continues the run
_WRITE_FIXES = {
    errno.ENOSPC: 'free space on its disk',
    errno.EDQUOT: 'free space or raise the disk quota',
    errno.EFBIG: 'raise the file size limit (ulimit -f)',
    errno.EROFS: 'make its file system writable',
    errno.EACCES: 'make the folder writable',
    errno.EPERM: 'make the folder writable',
}


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _os_error(error: BaseException) -> Optional[OSError]:
    """The OSError that ``error`` is or was raised from (``torch.save`` turns a failed write into a
    RuntimeError raised while handling it), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class RunFolder:
    """The checkpoint folder of one run. See the module docstring."""

    def __init__(self, folder: Union[str, os.PathLike]) -> None:
        self.folder = Path(folder)
        self._lock = RunLock(self.folder)
        self._unreadable: dict[Path, str] = {}  # checkpoints --resume skipped, and why: this run may replace them

    def __repr__(self) -> str:
        return f'{type(self).__name__}({str(self.folder)!r})'

    # --- the lock ---------------------------------------------------------------------------------

    def check(
        self, resume: Union[bool, str, os.PathLike] = False, overwrite: bool = False, max_duration: Optional[str] = None
    ) -> Optional[Path]:
        """Every refusal of :meth:`open`, found without writing anything or keeping the lock, so that a
        run can make it before any other work: a folder that cannot hold a run (a file, not writable, a
        folder for its lock), a live run holding it, and :meth:`prepare`'s. Returns the checkpoint to
        resume from as things are now."""
        self._lock.check()
        return self._plan(resume, overwrite, max_duration)[0]

    def lock(self) -> None:
        """Hold the folder for this process until :meth:`unlock` (or the process ends). RunFolderError
        naming the pid of another live run that holds it, or the path and the fix when the folder cannot
        hold a run (:meth:`check`). The lock of a process that is gone is taken over, with a log line."""
        self._lock.take()

    def unlock(self) -> None:
        """Release the lock and remove the lock file; nothing if not locked."""
        self._lock.release()

    @contextlib.contextmanager
    def open(
        self, resume: Union[bool, str, os.PathLike] = False, overwrite: bool = False, max_duration: Optional[str] = None
    ) -> Iterator[Optional[Path]]:
        """Lock the folder for a run, make it ready and yield the checkpoint to resume from
        (:meth:`prepare`); unlock at the end."""
        self.lock()
        try:
            yield self.prepare(resume, overwrite, max_duration)
        finally:
            self.unlock()

    def prepare(
        self, resume: Union[bool, str, os.PathLike] = False, overwrite: bool = False, max_duration: Optional[str] = None
    ) -> Optional[Path]:
        """With the lock held: remove what interrupted writes left, refuse entries named as
        checkpoints that are no checkpoint files (a folder, a link), pick the checkpoint to resume
        from (:meth:`resume_point`), and refuse checkpoints this run would overwrite (another
        run's, or later ones than the resumed one) unless ``overwrite``, which deletes them."""
        for partial in self.folder.glob(f'.*{_PARTIAL}'):
            if not partial.is_dir():
                log.warning('%s: removing %s, left by an interrupted checkpoint write', self.folder, partial.name)
                partial.unlink()
        start, clashing = self._plan(resume, overwrite, max_duration)
        self._warn_skipped()
        if clashing:
            log.warning('%s: --overwrite: deleting %s', self.folder, ', '.join(c.path.name for c in clashing))
            for checkpoint in clashing:
                checkpoint.path.unlink()
            if not self.latest().exists():
                with contextlib.suppress(FileNotFoundError):
                    self.latest().unlink()
        return start

    def _plan(
        self, resume: Union[bool, str, os.PathLike], overwrite: bool, max_duration: Optional[str]
    ) -> tuple[Optional[Path], list[Checkpoint]]:
        """:meth:`prepare`'s refusals, with nothing changed: the checkpoint to resume from and the
        checkpoints ``overwrite`` deletes."""
        for path in sorted(self.folder.iterdir()) if self.folder.is_dir() else []:
            named = CHECKPOINT_PATTERN.match(path.name) or (path.name == LATEST_NAME and not path.is_symlink())
            kind = not_a_file(path) if named else None  # `latest` is the link each write moves
            if kind is not None:
                raise RunFolderError(
                    f'{path} is named as a checkpoint but is {kind}; move it out of {self.folder}, or {NEW_FOLDER}'
                )
        start, batches = self._resume_point(resume, max_duration)
        ours = start is not None and start.resolve().parent == self.folder.resolve()
        clashing = [
            c
            for c in self.checkpoints()
            if (not ours or c.batch > batches) and c.path not in self._unreadable and c.path != start
        ]
        latest = self.latest()
        if latest.is_file() and not latest.is_symlink() and latest != start:  # a checkpoint copied in as `latest`
            clashing.append(Checkpoint(latest, -1, -1))  # the first write would replace it with its link
        if clashing and not overwrite:
            raise self._clash(start, ours, clashing)
        return start, clashing

    def _clash(self, start: Optional[Path], ours: bool, clashing: list[Checkpoint]) -> RunFolderError:
        """The refusal of a run that would overwrite ``clashing``, with the fix that fits how it started."""
        shown = ', '.join(c.path.name for c in clashing[-3:]) + (', ...' if len(clashing) > 3 else '')
        if start is None:
            return RunFolderError(
                f'{self.folder} holds the checkpoints of an earlier run ({shown}); continue it with --resume, '
                'give this run a new folder (--set train.save_folder=PATH), or replace them with --overwrite'
            )
        if ours:
            return RunFolderError(
                f'{start} is older than {shown} in the same folder, which this run would overwrite; continue '
                f'from the newest with --resume alone, or add --overwrite to delete them and continue from {start.name}'
            )
        return RunFolderError(
            f'{self.folder} holds the checkpoints of another run ({shown}); resume {start} into a new folder '
            '(--set train.save_folder=PATH), or replace them with --overwrite'
        )

    # --- checkpoint files ------------------------------------------------------------------------

    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoint files (``ep{E}-ba{B}-rank0.pt``), oldest first."""
        paths = self.folder.iterdir() if self.folder.is_dir() else ()
        named = ((path, CHECKPOINT_PATTERN.match(path.name)) for path in paths)
        found = [Checkpoint(path, int(m.group(1)), int(m.group(2))) for path, m in named if m and not path.is_symlink()]
        return sorted(found, key=lambda c: (c.batch, c.epoch))

    def latest(self) -> Path:
        """The ``latest-rank0.pt`` link to the newest checkpoint (it may be missing or dangling)."""
        return self.folder / LATEST_NAME

    def write(self, name: str, save: Callable[[BinaryIO], Any]) -> Path:
        """Write a checkpoint atomically: ``save(file)`` into a temporary file of this folder, fsync,
        rename to ``name``, then point ``latest-rank0.pt`` at it: an interruption leaves the old file
        set or the new one. A failed write (a full disk) raises RunFolderError (:meth:`_write_failure`)."""
        target = self.folder / name
        partial = self.folder / f'.{name}.{os.getpid()}{_PARTIAL}'
        link = self.folder / f'.{LATEST_NAME}.{os.getpid()}{_PARTIAL}'
        try:
            with open(partial, 'wb') as file:
                save(file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, target)
            os.symlink(target.name, link)
            os.replace(link, self.latest())
            _fsync_folder(self.folder)
        except Exception as error:
            cause = _os_error(error)
            if cause is None:
                raise
            raise RunFolderError(self._write_failure(name, cause)) from error
        finally:  # after an interruption: nothing half-made stays behind
            for leftover in (partial, link):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
        return target

    def _write_failure(self, name: str, cause: OSError) -> str:
        """The line that says which checkpoint write failed, why, what is whole and how to go on."""
        whole = self.checkpoints()
        kept = f'the newest whole checkpoint is {whole[-1].path}' if whole else 'no whole checkpoint is in it yet'
        then = 'then continue with --resume' if whole else 'then run again'
        fix = _WRITE_FIXES.get(cause.errno, 'fix the cause')  # type: ignore[arg-type]
        return (
            f'cannot write checkpoint {name} in {self.folder}: {cause.strerror or cause} (nothing is lost: {kept}); '
            f'{fix}, {then}'
        )

    def keep_newest(self, count: int, upto: Optional[int] = None) -> None:
        """Delete all but the ``count`` newest checkpoints (-1: keep all) of those up to batch ``upto`` (the
        run's own: a file named later, which ``--resume`` skipped as unusable, neither counts nor goes)."""
        if count > 0:
            ours = [c for c in self.checkpoints() if upto is None or c.batch <= upto]
            for checkpoint in ours[:-count]:
                checkpoint.path.unlink()

    # --- resuming ---------------------------------------------------------------------------------

    def resume_point(self, resume: Union[bool, str, os.PathLike], max_duration: Optional[str] = None) -> Optional[Path]:
        """The checkpoint to resume from: None when ``resume`` is False; with True the newest readable
        one here (newer unusable ones named in a warning each); with a path that one. RunFolderError
        naming the file and the fix when there is none, it is unreadable, or it reached ``max_duration``."""
        start = self._resume_point(resume, max_duration)[0]
        self._warn_skipped()
        return start

    def _warn_skipped(self) -> None:
        for problem in self._unreadable.values():
            log.warning('--resume: skipping an unusable checkpoint: %s', problem)

    def _resume_point(
        self, resume: Union[bool, str, os.PathLike], max_duration: Optional[str]
    ) -> tuple[Optional[Path], int]:
        """:meth:`resume_point` and the batches trained up to it."""
        if resume is False:
            return None, 0
        if resume is True:
            path, state = self._newest_readable()
        else:
            path = Path(resume)
            check_readable(path)
            state = read_state(path)
        done = progress(state)
        named = CHECKPOINT_PATTERN.match(path.name)
        if named and int(named.group(2)) != done['ba']:  # the name orders the checkpoints: it must be true
            raise RunFolderError(
                f'{path} is named batch {named.group(2)} but holds batch {done["ba"]}; rename it '
                f'{CHECKPOINT_NAME.format(epoch=done["ep"], batch=done["ba"])} or move it out'
            )
        if max_duration is not None:
            length, unit = parse_time(max_duration)
            if unit in done and done[unit] >= length:
                end = 'the end of a finished run' if done[unit] == length else 'past the end of this run'
                raise RunFolderError(
                    f'{path} is {end} ({done[unit]}{unit} of train.max_duration {max_duration}); to train on, '
                    'raise it (--set train.max_duration=...) and resume, or start afresh in a new folder '
                    '(--set train.save_folder=PATH)'
                )
        return path, done['ba']

    def _newest_readable(self) -> tuple[Path, dict[str, Any]]:
        """The newest checkpoint here that is whole and a training checkpoint, and its state; the
        ones newer than it are kept in ``_unreadable``, for a warning each, and may be replaced."""
        candidates = [c.path for c in reversed(self.checkpoints())]
        if not candidates:
            if not (self.latest().is_symlink() or self.latest().exists()):
                raise RunFolderError(
                    f'--resume: {self.folder} holds no checkpoint to resume from; train once without '
                    '--resume first, or set train.save_folder to the run to resume'
                )
            candidates = [self.latest()]  # a checkpoint copied in under the name `latest`, or a link
        for path in candidates:
            try:
                check_readable(path)  # names a dangling link or a broken file
                return path, read_state(path)
            except RunFolderError as error:
                self._unreadable[path] = error.problem
        newest = self._unreadable[candidates[0]]
        raise RunFolderError(
            f'--resume: no readable checkpoint in {self.folder} (the newest: {newest}); resume one from elsewhere with '
            '--resume PATH, or start afresh with --overwrite instead of --resume'
        )
