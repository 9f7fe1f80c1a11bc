"""Run code that may crash the process in a child process, and record what happened.

A layout kernel bug can corrupt the heap and kill the Python process. Probing one in the
process that asks would kill the test runner or the training script; here the code runs in a
fresh interpreter (the same ``sys.executable``, ``sys.path`` and working directory) with a
timeout, and its fate comes back as a :class:`ProbeResult`: ``'ok'`` (with the function's
return value), ``'crashed'`` (the signal that killed it), ``'wrong numbers'`` (the code raised
:class:`WrongNumbers`, or a repro script failed an ``assert``), ``'timeout'`` (killed after
``timeout`` seconds: a hang) or ``'error'`` (another exception, or a non-zero exit).

Example:
    >>> result = run_code('import os; os.abort()')
    >>> result.status, result.signal
    ('crashed', 'SIGABRT')
    >>> run_code('assert 1 + 1 == 3').status
    'wrong numbers'
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

__all__ = ['STATUSES', 'ProbeResult', 'WrongNumbers', 'run_code', 'run_isolated']

STATUSES = ('ok', 'crashed', 'wrong numbers', 'timeout', 'error')
_DETAIL_LINES = 12


# The child's side of run_isolated, self-contained so that a child imports only what the call needs:
# load the call, run it, pickle the value or the error (the qualified names of its classes).
_CHILD = """
import pickle, sys, traceback
call_path, answer_path = sys.argv[1:3]
with open(call_path, 'rb') as file:
    fn, args, kwargs = pickle.load(file)
try:
    payload = pickle.dumps({'value': fn(*args, **kwargs)})
except Exception as error:
    types = [f'{cls.__module__}.{cls.__qualname__}' for cls in type(error).__mro__]
    payload = pickle.dumps({'error': traceback.format_exc(), 'types': types})
with open(answer_path, 'wb') as file:
    file.write(payload)
"""


class WrongNumbers(AssertionError):
    """Raised by a probed function whose numbers differ from the reference: a result, not an error."""


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What became of one child process.

    Attributes:
        status: one of :data:`STATUSES`.
        seconds: wall time of the child, start to end.
        returncode: its exit status (negative: the signal that killed it; None: timed out).
        signal: the name of that signal (``'SIGSEGV'``), if one killed it.
        value: what the function returned (:func:`run_isolated`, status ``'ok'``).
        detail: the error message, or the last lines the child wrote to stderr.
    """

    status: str
    seconds: float
    returncode: Optional[int] = None
    signal: Optional[str] = None
    value: Any = None
    detail: str = ''

    @property
    def ok(self) -> bool:
        return self.status == 'ok'

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (without ``value``, which may be any object)."""
        return {
            'status': self.status,
            'seconds': round(self.seconds, 2),
            'returncode': self.returncode,
            'signal': self.signal,
            'detail': self.detail,
        }

    def __str__(self) -> str:
        what = f'crashed ({self.signal})' if self.signal else self.status
        detail = f': {self.detail.splitlines()[-1]}' if self.detail and self.status != 'ok' else ''
        return f'{what} after {self.seconds:.1f} s{detail}'


def _tail(text: str) -> str:
    return '\n'.join(text.strip().splitlines()[-_DETAIL_LINES:])


def _child_env(env: Optional[dict[str, str]]) -> dict[str, str]:
    """The parent's environment, ``env`` on top, and ``PYTHONPATH`` set to the parent's
    ``sys.path`` so that the child imports what the parent can (test modules included)."""
    paths = [p or os.getcwd() for p in sys.path]
    return {**os.environ, **(env or {}), 'PYTHONPATH': os.pathsep.join(paths)}


def _run(
    command: list[str], timeout: float, env: Optional[dict[str, str]]
) -> tuple[float, Optional[subprocess.CompletedProcess]]:
    start = time.perf_counter()
    try:
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=_child_env(env), cwd=os.getcwd()
        )
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, None
    return time.perf_counter() - start, completed


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f'signal {-returncode}'


def _outcome(seconds: float, completed: Optional[subprocess.CompletedProcess], timeout: float) -> Optional[ProbeResult]:
    """The result when the child timed out or died from a signal; None when it exited."""
    if completed is None:
        return ProbeResult('timeout', seconds, detail=f'no result after {timeout:g} s (a hang, or too little time)')
    if completed.returncode < 0:
        return ProbeResult(
            'crashed', seconds, completed.returncode, _signal_name(completed.returncode), detail=_tail(completed.stderr)
        )
    return None


def run_code(code: str, timeout: float = 120.0, env: Optional[dict[str, str]] = None) -> ProbeResult:
    """Run the Python script ``code`` in a child process (``python -c code``).

    ``'ok'`` when it exits 0, ``'crashed'`` when a signal kills it, ``'wrong numbers'`` when it
    ends with an ``AssertionError``, ``'timeout'`` after ``timeout`` seconds, ``'error'`` otherwise.
    ``env`` adds environment variables (e.g. ``ONEDNN_MAX_CPU_ISA``).
    """
    seconds, completed = _run([sys.executable, '-c', code], timeout, env)
    result = _outcome(seconds, completed, timeout)
    if result is not None:
        return result
    detail = _tail(completed.stderr)
    if completed.returncode == 0:
        return ProbeResult('ok', seconds, 0, detail=detail)
    last = detail.splitlines()[-1] if detail else ''
    status = 'wrong numbers' if last.startswith('AssertionError') else 'error'
    return ProbeResult(status, seconds, completed.returncode, detail=detail)


def _write_call(path: Path, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
    """Pickle the call for the child; ValueError saying what to define at module level if it cannot travel."""
    try:
        path.write_bytes(pickle.dumps((fn, args, kwargs)))
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise ValueError(
            f'cannot send {getattr(fn, "__name__", fn)!r} and its arguments to a child process '
            f'({error}); define the function and the classes of its arguments at module level, '
            'where the child can import them by name'
        ) from error


def _answer_result(reply: dict[str, Any], seconds: float, returncode: int) -> ProbeResult:
    """The result of a child that wrote its answer: the value, or the error it raised."""
    if 'value' in reply:
        return ProbeResult('ok', seconds, returncode, value=reply['value'])
    status = 'wrong numbers' if f'{WrongNumbers.__module__}.{WrongNumbers.__qualname__}' in reply['types'] else 'error'
    return ProbeResult(status, seconds, returncode, detail=_tail(reply['error']))


def run_isolated(
    fn: Callable[..., Any], *args: Any, timeout: float = 300.0, env: Optional[dict[str, str]] = None, **kwargs: Any
) -> ProbeResult:
    """Call ``fn(*args, **kwargs)`` in a child process and return its fate and return value.

    ``fn``, its arguments and its return value travel by pickle: ``fn`` and the classes of
    the arguments (a model's, say) must be importable by name, i.e. defined at module level.
    ``fn`` raises :class:`WrongNumbers` to report numbers that differ (status
    ``'wrong numbers'``); any other exception gives ``'error'`` with its message.

    Example:
        >>> import operator
        >>> run_isolated(operator.add, 2, 3).value
        5
    """
    with tempfile.TemporaryDirectory(prefix='channels_last_probe_') as folder:
        call, answer = Path(folder) / 'call.pkl', Path(folder) / 'answer.pkl'
        _write_call(call, fn, args, kwargs)
        seconds, completed = _run([sys.executable, '-c', _CHILD, str(call), str(answer)], timeout, env)
        result = _outcome(seconds, completed, timeout)
        if result is not None:
            return result
        if not answer.exists():
            return ProbeResult(
                'error',
                seconds,
                completed.returncode,
                detail=_tail(completed.stderr) or f'the child exited with status {completed.returncode}',
            )
        reply = pickle.loads(answer.read_bytes())
    return _answer_result(reply, seconds, completed.returncode)
