"""An engine's paged caches as the mover takes them: the tensors of one batch's layers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from ucm.kernels.api import payload_nbytes


@attrs.frozen
class Caches:
    """The cache tensors one batch of blocks moves between (one a layer, or K and V of
    each), in the order of the payload's layout; each block id names a block of every one.

    ``scales``: the per-block scale tensors of a quantized cache, beside the data.
    ``null_block``: an engine block id that holds nothing (vLLM's null block): skipped."""

    tensors: Sequence[torch.Tensor]
    scales: Sequence[torch.Tensor] | None = None
    null_block: int | None = None

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

    def payload_nbytes(self, blocks: int = 1) -> int:
        """A store block's payload: ``blocks`` engine blocks of every tensor."""
        scales = None if self.scales is None else list(self.scales)
        return payload_nbytes(list(self.tensors), blocks, scales=scales)
