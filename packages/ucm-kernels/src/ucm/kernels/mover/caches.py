"""An engine's paged caches as the mover takes them: the tensors of one batch's layers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from ucm.kernels.api import payload_nbytes
from ucm.kernels.validate import CheckedCaches, check_caches


@attrs.frozen
class Caches:
    """The cache tensors one batch of blocks moves between (one a layer, or K and V of
    each), in the order of the payload's layout; each block id names a block of every one.

    ``scales``: the per-block scale tensors of a quantized cache, beside the data.
    ``null_block``: an engine block id that holds nothing (vLLM's null block): skipped."""

    tensors: Sequence[torch.Tensor]
    scales: Sequence[torch.Tensor] | None = None
    null_block: int | None = None
    #: the tensors checked for the copy kernels, once (:meth:`checked`)
    _checked: list[CheckedCaches] = attrs.field(factory=list, init=False, eq=False, repr=False)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def options(self) -> dict[str, Any]:
        """The keyword arguments of the copy kernels' calls for these caches."""
        options: dict[str, Any] = {}
        if self.scales is not None:
            options["scales"] = list(self.scales)
        if self.null_block is not None:
            options["null_block_id"] = self.null_block
        return options

    def checked(self) -> CheckedCaches:
        """The tensors (and scales) checked and viewed as the copy kernels take them,
        checked on first use only: each step of a run plans a copy of the same caches."""
        if not self._checked:
            scales = None if self.scales is None else list(self.scales)
            self._checked.append(check_caches(list(self.tensors), scales))
        return self._checked[0]

    def copy_options(self) -> dict[str, Any]:
        """The keyword arguments of a copy of :meth:`checked` caches (their scales are in
        them)."""
        return {} if self.null_block is None else {"null_block_id": self.null_block}

    def payload_nbytes(self, blocks: int = 1) -> int:
        """A store block's payload: ``blocks`` engine blocks of every tensor."""
        scales = None if self.scales is None else list(self.scales)
        return payload_nbytes(list(self.tensors), blocks, scales=scales)
