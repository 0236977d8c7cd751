"""Block keys: chained digests over token ids, seeded by a namespace digest.

``key_i = xxh3_128(key_{i-1} || tokens of block i || extra_i)`` with ``key_{-1}`` the
namespace digest.  A key therefore names a whole prefix, not one block: two prompts share
key ``i`` only if they share every token up to the end of block ``i`` and the namespace.

Everything hashed is canonical bytes (little-endian uint32 token ids, length-prefixed UTF-8
fields), so keys agree across processes, machines and ``PYTHONHASHSEED``; Python's ``hash()``
and pickle are never involved.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import attrs
import xxhash
from ucm.core.settings import int_at_least

KEY_BYTES = 16
_NAMESPACE_TAG = b"ucm-namespace-v2"  # v2: block format 2 (the payload digest)


@attrs.frozen
class Namespace:
    """Everything that must differ for two caches never to share a block.

    ``model`` fingerprints the weights (model id and revision, dtype, quantisation);
    ``layout`` describes the bytes of a block (the engine's KV layout, block size, shard
    shape); ``rank``/``world_size`` name the shard when ranks store different data;
    ``group`` names the KV-cache group of a hybrid model; ``cache_salt`` isolates tenants.
    """

    model: str = attrs.field(validator=attrs.validators.instance_of(str))
    layout: str = attrs.field(validator=attrs.validators.instance_of(str))
    rank: int = attrs.field(default=0, validator=int_at_least(0))
    world_size: int = attrs.field(default=1, validator=int_at_least(0))
    group: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    cache_salt: str = attrs.field(default="", validator=attrs.validators.instance_of(str))

    def __attrs_post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a non-empty fingerprint of the model")
        if self.world_size < 1 or self.rank >= self.world_size:
            raise ValueError(
                "rank must be in [0, world_size), "
                f"got rank={self.rank} world_size={self.world_size}"
            )

    def canonical_bytes(self) -> bytes:
        out = bytearray(_NAMESPACE_TAG)
        for name, value in (
            ("model", self.model),
            ("layout", self.layout),
            ("rank", str(self.rank)),
            ("world_size", str(self.world_size)),
            ("group", self.group),
            ("cache_salt", self.cache_salt),
        ):
            for part in (name.encode(), value.encode("utf-8")):
                out += len(part).to_bytes(4, "little")
                out += part
        return bytes(out)

    def digest(self) -> bytes:
        return xxhash.xxh3_128_digest(self.canonical_bytes())


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; ids outside [0, 2**32) are refused."""
    try:
        arr = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None
    except TypeError as exc:
        raise TypeError(f"token ids must be integers: {exc}") from None
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def block_keys(
    namespace: Namespace | bytes,
    token_ids: Sequence[int],
    block_tokens: int,
    *,
    extras: Sequence[bytes] | None = None,
) -> list[bytes]:
    """Keys of every full block of ``token_ids`` (a trailing partial block has none).

    ``extras[i]``, when given, is mixed into block ``i`` (for inputs that are not token ids,
    such as hashes of multimodal features placed in that block).
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive integer, got {block_tokens!r}")
    parent = namespace.digest() if isinstance(namespace, Namespace) else bytes(namespace)
    if len(parent) != KEY_BYTES:
        raise ValueError(f"a namespace digest is {KEY_BYTES} bytes, got {len(parent)}")
    n_blocks = len(token_ids) // block_tokens
    if extras is not None and len(extras) < n_blocks:
        raise ValueError(f"extras has {len(extras)} entries for {n_blocks} blocks")
    data = token_bytes(token_ids[: n_blocks * block_tokens])
    step = 4 * block_tokens
    keys: list[bytes] = []
    digest = xxhash.xxh3_128_digest
    for i in range(n_blocks):
        chunk = data[i * step : (i + 1) * step]
        if extras is not None and extras[i]:
            chunk = chunk + b"\x00extra" + bytes(extras[i])
        parent = digest(parent + chunk)
        keys.append(parent)
    return keys


def scoped_keys(chain: Sequence[bytes], scope: Namespace | bytes) -> list[bytes]:
    """Keys of ``chain`` (prefix keys from :func:`block_keys`) within ``scope``.

    One token chain serves every shard and KV-cache group of a model: each ``(rank, group)``
    gets its own keys as ``xxh3_128(scope digest || chain key)``, one hash per block instead
    of a pass over the tokens per scope.
    """
    digest = scope.digest() if isinstance(scope, Namespace) else bytes(scope)
    h = xxhash.xxh3_128_digest
    return [h(digest + key) for key in chain]


def placed_extras(
    items: Sequence[tuple[str, int, int]], num_tokens: int, block_tokens: int
) -> list[bytes] | None:
    """``extras`` for :func:`block_keys`: inputs that are not token ids, by the blocks they
    fall in (``None`` when there are none).

    ``items``: ``(identifier, offset, length)`` of each input (an image's content hash and
    the placeholder tokens standing for it in the prompt).  Block ``i`` mixes in the
    identifier and the offset, relative to the block's start, of every item overlapping its
    tokens, so the same placeholders with another image, or the same image at another
    place, give other keys from that block on.
    """
    if not items:
        return None
    extras = []
    for i in range(num_tokens // block_tokens):
        start, end = i * block_tokens, (i + 1) * block_tokens
        out = bytearray()
        for identifier, offset, length in items:
            if offset < end and offset + length > start:
                name = identifier.encode("utf-8")
                out += len(name).to_bytes(4, "little") + name
                out += (offset - start).to_bytes(8, "little", signed=True)
        extras.append(bytes(out))
    return extras
