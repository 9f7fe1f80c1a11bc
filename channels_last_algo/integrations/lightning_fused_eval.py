"""``FusedEvalCallback``: Lightning validation, test and prediction on a fused copy of the network.

At each pass's first batch the network the LightningModule holds is swapped for
:func:`~channels_last_algo.core.fuse.fuse_for_inference` of its current weights, and put back at
the pass's end (:class:`~channels_last_algo.core.fuse.FusedEvaluation`), so training and checkpoints
never see the copy. ``ChannelsLastCallback(fuse_eval=True)`` runs one.

Example:
    >>> from channels_last_algo import FusedEvalCallback
    >>> FusedEvalCallback(network='backbone')
    FusedEvalCallback(network='backbone')
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from channels_last_algo.integrations import require

require('lightning', 'lightning')

import lightning.pytorch as pl

from channels_last_algo.core.fuse import FusedEvaluation
from channels_last_algo.core.fuse.evaluation import parameter_holders
from channels_last_algo.core.options import Option, check_options

__all__ = ['FusedEvalCallback']

# This callback's option, checked as the guard checks its own (core.options).
_OPTIONS = {
    'network': Option(
        None,
        lambda value: value is None or isinstance(value, str),
        'the name of a LightningModule attribute (a str)',
        'the LightningModule attribute holding the network to fuse',
    ),
}


class FusedEvalCallback(pl.Callback):
    """Validate, test and predict on a fused copy of the network (BatchNorm folded, activations and
    residual adds fused into the convolutions), built at each pass's first batch.

    Args:
        network: the LightningModule attribute holding the network to fuse; by default its one
            child module with parameters. Checked when fit or the pass starts.

    Example:
        .. code-block:: python

            trainer = L.Trainer(callbacks=[FusedEvalCallback()])
            trainer.validate(lightning_module, val_dataloader)
    """

    def __init__(self, *, network: Optional[str] = None) -> None:
        check_options(_OPTIONS, network=network)
        self.network = network
        self._evaluation = FusedEvaluation()

    def __repr__(self) -> str:
        return f'{type(self).__name__}({"" if self.network is None else f"network={self.network!r}"})'

    def loop_name(self, loop: str) -> str:
        """``loop`` named with the pass under way, whose fused copy is new (:meth:`FusedEvaluation.loop_name`)."""
        return self._evaluation.loop_name(loop)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.network_of(pl_module)  # refused now, not at the first validation after training

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.network_of(pl_module)
        self._evaluation.begin_pass()

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._evaluation.first_batch(functools.partial(self.network_of, pl_module), batch)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation.end()

    on_test_start = on_predict_start = on_validation_start
    on_test_batch_start = on_predict_batch_start = on_validation_batch_start
    on_test_end = on_predict_end = on_validation_end

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._evaluation.end()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._evaluation.end()  # Lightning skips teardown hooks after an exception

    def network_of(self, pl_module: pl.LightningModule) -> tuple[pl.LightningModule, str, torch.nn.Module]:
        """The module, the attribute and the network to fuse; a ValueError naming what is wrong."""
        attribute = self.network or _network_attribute(pl_module)
        network = getattr(pl_module, attribute, None)
        from torch._dynamo.eval_frame import OptimizedModule

        if isinstance(network, OptimizedModule):
            raise ValueError(
                f'fused evaluation: {type(pl_module).__name__}.{attribute} is compiled with torch.compile, '
                'which does its own fusion; leave fused evaluation (fuse_eval) off'
            )
        if not isinstance(network, torch.nn.Module):
            raise ValueError(
                f'fused evaluation: {type(pl_module).__name__}.{attribute} is {type(network).__name__}, '
                'not the network to fuse; name it with network=...'
            )
        return pl_module, attribute, network


def _network_attribute(pl_module: pl.LightningModule) -> str:
    """The LightningModule's one child with parameters; a ValueError naming them where there is not one."""
    holders = parameter_holders(pl_module)
    if len(holders) != 1:
        raise ValueError(
            f'fused evaluation fuses the child module of the LightningModule that holds its parameters; '
            f'{type(pl_module).__name__} has {len(holders)} such children ({", ".join(holders) or "none"}): '
            'name the one to fuse with network=...'
        )
    return holders[0]
