"""Prefix identity: content-addressed block keys.

A block key is SHA-256 over a canonical, length-prefixed, domain-tagged encoding::

    root key  = SHA-256( "kvctl/namespace/v1" | field_1 | ... | field_n )
    block key = SHA-256( "kvctl/block/v1" | parent key | token ids | extra keys )

Each field is encoded as ``tag (1 byte) | length (u32 LE) | bytes``; token ids as
``count (u32 LE) | ids (u32 LE each)``. The encoding is injective, so two
different inputs never share a preimage, and it uses no process state: keys are
equal across processes and hosts whatever PYTHONHASHSEED is.

The chain is rooted in a `Namespace` (model revision, tokenizer digest, adapter,
position policy, multimodal digest, cache dtype and scale version, block size,
tenant). Changing any of them makes every old key unreachable. Only full blocks
get keys. Keys are computed by the daemon from token ids; a key is never
accepted from a client.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import astuple, dataclass, fields, replace
from typing import Iterable, NewType, Sequence

BlockKey = NewType("BlockKey", bytes)
"""32-byte SHA-256 digest naming a full block and everything before it."""

_NAMESPACE_TAG = b"kvctl/namespace/v1"
_BLOCK_TAG = b"kvctl/block/v1"
_MAX_TOKEN_ID = 2**32 - 1


_pack_u32 = struct.Struct("<I").pack


def _field(tag: int, payload: bytes) -> bytes:
    return bytes((tag,)) + _pack_u32(len(payload)) + payload


def _encode_extra(value: str | bytes | int) -> bytes:
    if isinstance(value, bytes):
        return _field(1, value)
    if isinstance(value, str):
        return _field(2, value.encode("utf-8"))
    if isinstance(value, int) and not isinstance(value, bool):
        return _field(3, str(value).encode("ascii"))
    raise TypeError(f"extra key: expected str, bytes or int, got {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that must match for two equal token prefixes to share KV."""

    model_revision: str = "none"  # digest of the config and weight files
    tokenizer_digest: str = "none"  # digest of tokenizer.json and its config
    adapter_id: str = ""  # LoRA or other adapter; "" for the base model
    position_policy: str = "rope"  # how positions are encoded (RoPE variant, offsets)
    multimodal_digest: str = ""  # digest of non-text inputs mixed into the prompt
    cache_dtype: str = "auto"  # storage format of the cached K/V
    scale_version: str = ""  # id/version of the quantisation scales in use
    block_size: int = 16  # tokens per block
    tenant: str = "default"  # isolation domain; tenants never share unless told to

    def __post_init__(self) -> None:
        validate_block_size(self.block_size)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "block_size" and not isinstance(value, str):
                raise ValueError(f"namespace.{f.name}: expected a string, got {value!r}")
        if not self.tenant:
            raise ValueError("namespace.tenant: must not be empty")

    def root_key(self) -> BlockKey:
        """SHA-256 of the namespace's canonical encoding (field order is fixed)."""
        parts = [_NAMESPACE_TAG]
        for index, value in enumerate(astuple(self)):
            parts.append(_field(index, str(value).encode("utf-8")))
        return BlockKey(hashlib.sha256(b"".join(parts)).digest())

    def space_key(self) -> BlockKey:
        """The block space this namespace's keys belong to: the namespace less its tenant and its
        adapter (model revision, tokenizer, cache format, scales, block size). The tiers accept
        only payloads of the space served; a pin remembers the one it was made in."""
        return replace(self, tenant="*", adapter_id="").root_key()

    def describe(self) -> dict[str, str | int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def validate_block_size(block_size: int) -> int:
    """Block sizes are powers of two from 1 to 512 tokens."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 1 <= block_size <= 512 \
            or block_size & (block_size - 1):
        raise ValueError(f"block_size: expected a power of two from 1 to 512, got {block_size!r}")
    return block_size


def check_token_ids(token_ids: Sequence[int]) -> None:
    """Raise ValueError unless every id is an integer in [0, 2**32)."""
    if not token_ids:
        return
    try:
        low, high = min(token_ids), max(token_ids)
        if low < 0 or high > _MAX_TOKEN_ID or not all(isinstance(t, int) for t in (low, high)):
            raise TypeError
    except TypeError:
        bad = next((t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t <= _MAX_TOKEN_ID), None)
        raise ValueError(f"token_ids: every id must be an integer in [0, 2**32), found {bad!r}") from None


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """``count (u32 LE) | ids (u32 LE)``; ids must be 0 <= id < 2**32."""
    try:
        return struct.pack(f"<{len(token_ids) + 1}I", len(token_ids), *token_ids)
    except struct.error:
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN_ID), None)
        raise ValueError(f"token_ids: every id must be an integer in [0, 2**32), found {bad!r}") from None


def block_key(parent: BlockKey, token_ids: Sequence[int], extra_keys: Iterable[str | bytes | int] = ()) -> BlockKey:
    """Key of one full block given its parent's key (or the namespace root).

    Encoding: tag | field 0 = parent | field 1 = token ids | field 2 = extra keys.
    """
    tokens = encode_token_ids(token_ids)
    extras = b"".join([_encode_extra(e) for e in extra_keys])
    return BlockKey(hashlib.sha256(b"".join((
        _BLOCK_TAG,
        b"\x00", _pack_u32(len(parent)), parent,
        b"\x01", _pack_u32(len(tokens)), tokens,
        b"\x02", _pack_u32(len(extras)), extras,
    ))).digest())


def chain_keys(namespace: Namespace, token_ids: Sequence[int],
               extra_keys: Iterable[str | bytes | int] = ()) -> list[BlockKey]:
    """Keys of every full block of `token_ids` under `namespace`, root first."""
    hasher = PrefixHasher(namespace, extra_keys)
    return hasher.feed(token_ids)


class PrefixHasher:
    """Incremental chain hashing for one sequence: feed tokens, get keys of newly full blocks.

    Keeps only the last key and the tokens of the partial block; `copy()` gives
    an independent hasher for a forked sequence.

    `private` = (blocks, nonce): from block `blocks` on, every key also hashes `nonce` (bytes a
    request draws for itself), so no other request's chain reaches those blocks and they reach
    none cached before: the blocks before are shared as always. A request that asks for its
    prompt to be cached only up to a point (OpenAI's `prompt_cache_options.mode: "explicit"`)
    hashes the rest this way; its own samples and its recompute after a preemption still share it.
    """

    __slots__ = ("namespace", "block_size", "private", "_extra", "_parent", "_pending", "_blocks")

    def __init__(self, namespace: Namespace, extra_keys: Iterable[str | bytes | int] = (),
                 private: tuple[int, bytes] | None = None) -> None:
        self.namespace = namespace  # what its chain is hashed under
        self.block_size = namespace.block_size
        self.private = private
        self._extra = tuple(extra_keys)
        self._parent = namespace.root_key()
        self._pending: list[int] = []
        self._blocks = 0  # full blocks hashed so far

    def feed(self, token_ids: Sequence[int]) -> list[BlockKey]:
        check_token_ids(token_ids)
        keys: list[BlockKey] = []
        pending = self._pending
        pending.extend(token_ids)
        size = self.block_size
        start = 0
        while len(pending) - start >= size:
            extra = self._extra
            if self.private is not None and self._blocks >= self.private[0]:
                extra = (*extra, self.private[1])
            self._parent = block_key(self._parent, pending[start:start + size], extra)
            keys.append(self._parent)
            self._blocks += 1
            start += size
        del pending[:start]
        return keys

    def copy(self) -> "PrefixHasher":
        twin = PrefixHasher.__new__(PrefixHasher)
        twin.namespace = self.namespace
        twin.block_size = self.block_size
        twin.private = self.private
        twin._extra = self._extra
        twin._parent = self._parent
        twin._pending = list(self._pending)
        twin._blocks = self._blocks
        return twin
