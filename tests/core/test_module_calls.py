"""The module-call tracker: its helper for modes its listeners enter in one module call and leave in another, and
its idle hooks beside torch.export."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from channels_last_algo.core import module_calls
from channels_last_algo.core.module_calls import (
    exit_mode,
    follow_module_calls,
    hooks_installed,
    subscribe,
    unsubscribe,
)


class Named(TorchFunctionMode):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


def _stack() -> list[str]:
    return [torch._C._get_function_stack_at(i).name for i in range(torch._C._len_torch_function_stack())]


def test_exit_mode_takes_off_the_given_mode_wherever_it_is_and_keeps_the_others_in_order():
    below, middle, top = Named('below'), Named('middle'), Named('top')
    for mode in (below, middle, top):
        mode.__enter__()
    exit_mode(middle)  # not on top: __exit__ alone would pop 'top'
    assert _stack() == ['below', 'top']
    exit_mode(middle)  # gone already: nothing
    assert _stack() == ['below', 'top']
    exit_mode(top)
    exit_mode(below)
    assert _stack() == []


@pytest.fixture(autouse=True)
def _dynamos_caches_emptied_after():
    """torch.nn modules compile through one shared code object, whose cache the tests after share."""
    yield
    torch._dynamo.reset()


class _Silent:
    def entered(self, module, args):
        return None

    def left(self, module, args, kwargs, output, failed):
        return None


def test_idle_hooks_a_compiled_wrapper_keeps_leave_torch_export_working():
    """torch.export (strict in torch 2.7) compiled each eager call of a global hook as a graph of its own and then
    refused the export; the hooks stay on, idle, while a compiled wrapper that ran with them lives."""
    listener = _Silent()
    subscribe(listener)
    compiled = torch.compile(nn.Linear(2, 2), backend='eager')
    compiled(torch.ones(1, 2))
    unsubscribe(listener)
    assert hooks_installed(), 'the compiled wrapper keeps the hooks'
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Sequential(nn.Conv2d(4, 2, 1))).eval()
    x = torch.randn(2, 3, 6, 6)
    exported = torch.export.export(model, (x,)).module()
    torch.testing.assert_close(exported(x), model(x))
    del compiled
    gc.collect()
    assert hooks_installed() == bool(list(module_calls._compiled)), 'off once no compiled wrapper that saw them lives'


class _Names(_Silent):
    def __init__(self):
        self.seen = []

    def entered(self, module, args):
        self.seen.append(type(module).__name__)


def test_a_compiled_call_is_heard_as_the_wrapper_or_the_module_around_it_never_from_inside():
    """Inside a graph the hooks do nothing, in every torch: torch 2.7 calls a compiled network's own hooks eagerly,
    newer torch traces them; a graph break's eager calls are inside too."""
    wrapped = torch.compile(nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU()), backend='eager')
    in_place = nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU())
    in_place.compile(backend='eager')
    broken = torch.compile(_GraphBreak(), backend='eager')
    names = _Names()
    with follow_module_calls(names):
        for _ in range(2):
            nn.Sequential(in_place, nn.Identity())(wrapped(torch.ones(1, 3, 2, 2)))
            broken(torch.ones(1, 4))
    assert names.seen == ['OptimizedModule', 'Sequential', 'Identity', 'OptimizedModule'] * 2


class _GraphBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        torch._dynamo.graph_break()
        return self.inner(x)


@pytest.mark.parametrize('own_hook', [False, True], ids=['only these hooks', 'a global hook of the users own'])
def test_a_compiled_call_while_the_hooks_are_on_warns_of_them_only_where_a_users_own_global_hook_is_on(own_hook):
    """Newer torch warns at each compiled wrapper's call that global hooks fire once more for it: not the user's
    business where the hooks are these (heard once, as the wrapper's), theirs where a hook of their own is on."""
    from torch.nn.modules import module as module_hooks

    if not hasattr(module_hooks, '_has_any_global_hook'):
        pytest.skip('this torch has no notice of global hooks at a compiled call')
    compiled = torch.compile(nn.Linear(2, 2), backend='eager')
    users = module_hooks.register_module_forward_hook(lambda module, args, output: None) if own_hook else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        listener = _Silent()
        subscribe(listener)
        compiled(torch.ones(1, 2))
        unsubscribe(listener)
        if users is not None:
            users.remove()
        del compiled
        gc.collect()
        assert not hooks_installed()
        assert not module_calls._notice_filters, 'the filter comes off with the hooks'
    notices = [w for w in caught if 'global hooks' in str(w.message)]
    assert len(notices) == int(own_hook), [str(w.message) for w in caught]
