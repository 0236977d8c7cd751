"""Signed blocks: a deployment secret that keys every block's name and authenticates its bytes.

A store that others can write (a shared mount, a Mooncake cluster other tenants reach, a
host with other users) is only as trustworthy as its least trusted writer: block keys are
public digests of the token ids, so anyone can compute the key of a prompt and put bytes
under it.  With a secret configured, a store

* names each block by a keyed digest of its key (:meth:`BlockSigner.name`), so the name of a
  prompt's block cannot be computed, probed or pre-empted without the secret;
* seals each block with a MAC over its header and payload (keyed BLAKE3, in place of the
  xxh3 checksum), checked on every load: a block without a valid MAC is a miss.

The secret is read from a file or an environment variable named in the configuration
(``file:PATH`` / ``env:NAME``), never from the configuration itself, so that it is never in a
logged or shared config.  Keyed BLAKE3 was chosen by measurement (2 MiB blocks, one core of
the development machine): 6.4 GB/s, against 1.8 GB/s for HMAC-SHA256 (SHA-NI) and 0.95 GB/s
for keyed BLAKE2b; ``ucm bench store --secret`` measures what it costs a store.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import attrs
from blake3 import blake3  # type: ignore[import-untyped]
from ucm.core.settings import ConfigError

MAC_BYTES = 32
#: a secret shorter than this is refused (a password-like string is guessable offline)
SECRET_MIN_BYTES = 16
_SECRET_MAX_BYTES = 4096
_NAME_CONTEXT = "ucm 2026-11 block names"
_MAC_CONTEXT = "ucm 2026-11 block MAC"


def secret_reference(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Validator: ``None``, ``env:NAME`` or ``file:PATH`` (the secret itself is refused)."""
    if value is None:
        return
    if isinstance(value, str):
        scheme, sep, rest = value.partition(":")
        if sep and scheme == "env" and rest and rest.replace("_", "a").isalnum():
            return
        if sep and scheme == "file" and rest:
            return
    raise ConfigError(
        attribute.name,
        "must be 'env:NAME' (an environment variable holding the secret) or 'file:PATH' "
        "(a file holding it, readable by its owner only); the secret itself never goes in "
        f"the configuration. Got {_masked(value)}",
    )


secret_reference.allowed = "`env:NAME` or `file:PATH`"  # type: ignore[attr-defined]


def _masked(value: object) -> str:
    if isinstance(value, str) and not value.startswith(("env:", "file:")):
        return f"a {type(value).__name__} of {len(value)} characters (not shown)"
    return repr(value)


def read_secret(reference: str, where: str = "store.secret") -> bytes:
    """The secret that ``reference`` (``env:NAME`` or ``file:PATH``) points at."""
    scheme, _, rest = reference.partition(":")
    if scheme == "env":
        value = os.environ.get(rest)
        if value is None:
            raise ConfigError(where, f"environment variable {rest} is not set")
        secret = value.encode("utf-8").strip()
        origin = f"environment variable {rest}"
    else:
        secret = _read_secret_file(os.path.expanduser(rest), where)
        origin = rest
    if len(secret) < SECRET_MIN_BYTES:
        raise ConfigError(
            where,
            f"the secret in {origin} is {len(secret)} bytes; at least {SECRET_MIN_BYTES} are "
            "needed (for example: python -c 'import secrets; print(secrets.token_hex(32))')",
        )
    return secret


def _read_secret_file(path: str, where: str) -> bytes:
    try:
        # Links are followed only where this user or root made them, in folders nobody
        # else can change (Kubernetes mounts secrets through root's links); the file itself
        # is opened without following one, and must be private, like an ssh key.
        from ucm.core.store.folder import resolve_trusted  # the store package imports this

        real = resolve_trusted(path, where, "the secret file")
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigError(where, f"cannot read the secret file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(where, f"the secret file {path} is not a regular file")
        if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o077:
            raise ConfigError(
                where,
                f"the secret file {path} (owner uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}) must belong to you (or root) and be "
                f"readable by its owner only: chmod 600 {path}",
            )
        data = os.read(fd, _SECRET_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _SECRET_MAX_BYTES:
        raise ConfigError(
            where, f"the secret file {path} holds more than {_SECRET_MAX_BYTES} bytes"
        )
    return data.strip()


@attrs.frozen(repr=False)
class BlockSigner:
    """Names and MACs of blocks under one secret (two keys derived from it)."""

    _name_key: bytes
    _mac_key: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> BlockSigner:
        return cls(
            blake3(secret, derive_key_context=_NAME_CONTEXT).digest(),
            blake3(secret, derive_key_context=_MAC_CONTEXT).digest(),
        )

    def name(self, key: bytes) -> bytes:
        """The name a block of ``key`` is stored under (as long as a key)."""
        return blake3(key, key=self._name_key).digest(len(key))  # type: ignore[no-any-return]

    def hasher(self) -> Any:
        """A MAC being computed (``update``, then ``digest``: 32 bytes)."""
        return blake3(key=self._mac_key)

    def __repr__(self) -> str:
        return "BlockSigner(<secret>)"


def signer_for(reference: str | None, where: str = "store.secret") -> BlockSigner | None:
    """The signer of a store configured with secret ``reference`` (``None``: unsigned)."""
    if reference is None:
        return None
    return BlockSigner.from_secret(read_secret(reference, where))
