"""The module-call tracker's helper for modes its listeners enter in one module call and leave in another."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from channels_last_algo.core.module_calls import exit_mode


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
