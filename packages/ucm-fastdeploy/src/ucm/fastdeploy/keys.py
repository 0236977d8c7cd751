"""Store keys for FastDeploy's blocks, from ucm.core.keys.

One chain of prefix digests over the token ids names every block of a prompt for the model
(``namespace``, ``model_version`` and, where ``model_path`` is configured, the digests of
the model's configuration and weights); each tensor-parallel shard then scopes the chain to
its own keys, with the shape of what it stores (layer count, block size, bytes per layer and
block) in the scope.  So two shards, two model versions, two namespaces or two cache shapes
never share a key, while every pod, data-parallel replica, prefill or decode instance and
device of one model and shard does: that is what lets them reuse each other's blocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import attrs
from ucm.core import Namespace, block_keys, scoped_keys

#: bump when what a FastDeploy block holds changes meaning
KEY_VERSION = "fastdeploy-as/1"


@attrs.frozen
class KeySpace:
    """Where one AttentionStore's keys live."""

    namespace: str
    model_version: str
    shard_id: int
    shard_num: int
    layer_num: int
    block_token_size: int
    bytes_per_shard_layer_per_block: int
    model_digest: str = ""  # the content of the model's files (config, weights), when known

    @property
    def model(self) -> str:
        # JSON keeps the names apart: ("a/b", "c") and ("a", "b/c") differ.
        names = [self.namespace, self.model_version]
        return json.dumps([*names, self.model_digest] if self.model_digest else names)

    def chain_seed(self) -> bytes:
        """The digest the token chain starts from: the model, not the shard."""
        return Namespace(self.model, f"{KEY_VERSION};block_tokens={self.block_token_size}").digest()

    def scope(self) -> Namespace:
        layout = (
            f"{KEY_VERSION};layers={self.layer_num};block_tokens={self.block_token_size};"
            f"bytes_per_layer_block={self.bytes_per_shard_layer_per_block}"
        )
        return Namespace(self.model, layout, rank=self.shard_id, world_size=self.shard_num)

    def chain(self, token_ids: Sequence[int], end_block: int) -> list[bytes]:
        """Prefix digests of blocks ``[0, end_block)`` (shared by every shard)."""
        tokens = token_ids[: end_block * self.block_token_size]
        return block_keys(self.chain_seed(), tokens, self.block_token_size)

    def keys(self, token_ids: Sequence[int], start: int, end: int) -> list[bytes]:
        """This shard's keys of blocks ``[start, end)``; block ``i`` is keyed by
        ``token_ids[: (i + 1) * block_token_size]``."""
        return scoped_keys(self.chain(token_ids, end)[start:], self.scope())


def storage_seed(namespace: str) -> bytes:
    """The digest that UCMStorage mixes into FastDeploy's string keys."""
    return Namespace(json.dumps([namespace]), "fastdeploy-kvstorage/1").digest()
