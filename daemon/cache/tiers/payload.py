"""The block payload: how one cached block travels to disk or Redis and back.

    offset  size  field
    0       4     magic b"KVB1"
    4       2     format version (4: the device's bytes; 5: compressed, see below)
    6       2     header length H (bytes from offset 0 to the end of the scale version)
    8       32    block key (SHA-256 chain key)
    40      32    space digest (namespace without the tenant: model, tokenizer, format, scales)
    72      32    root key (first block of its chain: names its prefix tree)
    104     32    parent key (the block before it in its chain; zeros for the root)
    136     64    tenant (ASCII, zero-padded; zeros when not known): whose namespace the key is in,
                  so `kvctl evict --tenant` reaches a lower tier's blocks after a restart too
    200     4     depth (position of the block in its chain, 0 = root)
    204     4     block size (tokens)
    208     4     KV heads
    212     4     head dim
    216     2     layers L
    218     L     dtype code per layer
    218+L   2     scale version length S, then S bytes of UTF-8
    (version 5 only) 1   codec (1 int8, 2 fp8_e4m3: codec.py)
    H       8     payload length P (u64)
    H+8     P     version 4: per layer, K bytes then V bytes ([block_size, heads, head_dim], C order);
                  version 5: the codec's body (codec.py): per-row scales, then a byte a value
    H+8+P   8     XXH3-64 of every byte before it

Blocks stored as the device holds them keep version 4, byte for byte, so daemons of an earlier
release sharing a Redis still read them; only compressed ones (`tier_compress`) are version 5.
The layer dtypes in the header are always the device cache's: what the block decodes to.

All integers are little-endian. No pickle: a payload is decoded by reading the header and
viewing the tensor bytes. A payload is accepted only when the magic, version, key, space
digest and layout equal what the reader expects and the checksum matches; anything else
raises PayloadError, which callers count as a miss.

XXH3-64 (the `xxhash` library, about 5x the speed of CRC-32 here) guards against torn and
corrupted bytes, not against an attacker who can write to the tier: a shared Redis is trusted
like the daemon's own disk. Decoded tensors are read-only views of the payload buffer (no copy):
they are only ever copied into the cache.
"""

from __future__ import annotations

import functools
import struct
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Sequence

import torch
import xxhash

from .codec import CODEC_CODES, CODEC_NAMES, check_codec, compress, decompress, unsupported
from .codec import body_bytes as codec_body_bytes

MAGIC = b"KVB1"
VERSION = 4  # 4: parent key and tenant (prefix trees and tenants known from a lower tier); 2: XXH3-64 (1: CRC-32)
VERSION_COMPRESSED = 5  # 4 with a codec byte: the body is compressed (codec.py)
READABLE = (VERSION, VERSION_COMPRESSED)
TENANT_BYTES = 64  # the longest tenant name kvd accepts (daemon/server/auth.py: TENANT_PATTERN)
_FIXED = struct.Struct(f"<4sHH32s32s32s32s{TENANT_BYTES}sIIIIH")
_NO_PARENT = bytes(32)
_U16 = struct.Struct("<H")
_U8 = struct.Struct("<B")
_U64 = struct.Struct("<Q")
_CRC = struct.Struct("<Q")

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.int8: 4,
    torch.float8_e4m3fn: 5, torch.float8_e5m2: 6,
}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class PayloadError(ValueError):
    """A payload that must not be served: the message says which check failed (never content)."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason  # short label for counters: magic, version, key, space, layout, length, checksum
        super().__init__(f"{reason}: {detail}")


@dataclass(frozen=True)
class BlockLayout:
    """Shape and format of one block's K/V across layers; payloads must match it exactly."""

    layer_dtypes: tuple[torch.dtype, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    scale_version: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layer_dtypes)

    def layer_bytes(self, layer: int) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim * self.layer_dtypes[layer].itemsize

    @property
    def block_bytes(self) -> int:
        """K and V bytes of one block over all layers (the payload body)."""
        return sum(2 * self.layer_bytes(i) for i in range(self.num_layers))

    def header_bytes(self, codec: str = "none") -> int:
        return (_FIXED.size + self.num_layers + _U16.size + len(self.scale_version.encode()) + _U64.size
                + (_U8.size if codec != "none" else 0))

    def body_bytes(self, codec: str = "none") -> int:
        """Bytes of one block's body as stored with `codec`."""
        if codec == "none":
            return self.block_bytes
        return codec_body_bytes(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        """Whole encoded payload: header, body and checksum (stored as the device holds it)."""
        return self.stored_bytes("none")

    def stored_bytes(self, codec: str) -> int:
        """Whole encoded payload of one block stored with `codec`."""
        return self.header_bytes(codec) + self.body_bytes(codec) + _CRC.size

    def codec_for(self, codec: str) -> str:
        """The codec blocks of this layout are written with when `codec` is asked for: itself, or
        none where this layout cannot be compressed (a quantised device cache)."""
        return codec if unsupported(self.layer_dtypes, codec) is None else "none"

    def describe(self) -> str:
        names = [str(d).replace("torch.", "") for d in self.layer_dtypes]
        dtypes = names[0] if len(set(names)) == 1 else ",".join(names)
        return (f"block_size={self.block_size} heads={self.num_kv_heads} head_dim={self.head_dim} "
                f"layers={self.num_layers} dtypes={dtypes} scales={self.scale_version or '-'}")


@dataclass(frozen=True)
class BlockMeta:
    """Where a block sits in its chain (read from a header without the body)."""

    key: bytes
    root: bytes
    depth: int
    parent: bytes | None  # None for the root (depth 0)
    tenant: str | None = None  # whose namespace the key was hashed under; None where not known
    # What the device knew of its use when it came down (for listings; not in the header, so
    # unknown after a restart or for another daemon's block): prefix hits, clock reading of last use.
    hits: int | None = field(default=None, compare=False)
    last_use: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.tenant is not None and (not self.tenant.isascii() or not 0 < len(self.tenant) <= TENANT_BYTES):
            raise ValueError(f"tenant: expected 1 to {TENANT_BYTES} ASCII characters, got {self.tenant!r}")

    @classmethod
    def of(cls, block) -> "BlockMeta":
        """The chain position, tenant and use of an indexed pool block (daemon/cache/pool.py: Block)."""
        return cls(block.key, block.root, block.depth, block.parent, block.tenant, block.hits, block.last_use)


class MetaBook(MutableMapping):
    """A tier's index of chain positions, key -> BlockMeta, each held as a plain tuple of its fields.

    Python's collector stops tracking a tuple of bytes, numbers and strings once it has seen it;
    a BlockMeta it walks in every whole-heap collection for as long as the block stays in the tier,
    and those collections stop every thread. A million of them added 133 ms to each (kvd's start
    freezes the ones its disk scan makes, but a tier's blocks turn over while it serves); held as
    tuples, nothing. A BlockMeta is made again when one is read."""

    __slots__ = ("_rows",)

    def __init__(self) -> None:
        self._rows: dict[bytes, tuple] = {}

    def __setitem__(self, key: bytes, meta: BlockMeta) -> None:
        self._rows[key] = (meta.key, meta.root, meta.depth, meta.parent, meta.tenant, meta.hits, meta.last_use)

    def __getitem__(self, key: bytes) -> BlockMeta:
        return BlockMeta(*self._rows[key])

    def __delitem__(self, key: bytes) -> None:
        del self._rows[key]

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def __iter__(self):
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


def _header(layout: BlockLayout, space: bytes, meta: BlockMeta, codec: str = "none") -> bytes:
    scale = layout.scale_version.encode("utf-8")
    codes = bytes(DTYPE_CODES[d] for d in layout.layer_dtypes)
    tail = b"" if codec == "none" else _U8.pack(CODEC_CODES[codec])
    length = _FIXED.size + len(codes) + _U16.size + len(scale) + len(tail)
    version = VERSION if codec == "none" else VERSION_COMPRESSED
    return b"".join((_FIXED.pack(MAGIC, version, length, meta.key, space, meta.root,
                                 meta.parent or _NO_PARENT, (meta.tenant or "").encode("ascii"), meta.depth,
                                 layout.block_size, layout.num_kv_heads, layout.head_dim, layout.num_layers),
                     codes, _U16.pack(len(scale)), scale, tail, _U64.pack(layout.body_bytes(codec))))


def encode_parts(layout: BlockLayout, space: bytes, metas: Sequence[BlockMeta],
                 layers: Sequence[tuple[torch.Tensor, torch.Tensor]], codec: str = "none") -> list[list]:
    """Each block's payload as a list of buffers (header, K and V of every layer, checksum) that
    concatenate to the payload, without copying the tensor bytes: write them with writev, or
    stream them as one Redis value. `layers[l]` is (K, V) of the group on the CPU, [n, ...].
    With a `codec` (codec.py) the bodies are compressed where this layout and group allow it, and
    stored as they are where not (see `BlockLayout.codec_for`)."""
    if len(layers) != layout.num_layers:
        raise ValueError(f"layers: expected {layout.num_layers}, got {len(layers)}")
    n = len(metas)
    for k, v in layers:
        if k.shape[0] != n or v.shape[0] != n:
            raise ValueError(f"layers: {k.shape[0]} blocks of tensors for {n} keys")
    codec = layout.codec_for(check_codec(codec))
    packed = compress(layers, codec) if codec != "none" else None
    if packed is None:
        codec = "none"
        views = [(k.contiguous().view(torch.uint8).reshape(n, -1).numpy(),
                  v.contiguous().view(torch.uint8).reshape(n, -1).numpy()) for k, v in layers]
    else:
        views = [tuple(t.contiguous().numpy() for t in packed)]
    out = []
    for i, meta in enumerate(metas):
        parts = [_header(layout, space, meta, codec)]
        for first, second in views:
            parts.append(first[i].data)
            parts.append(second[i].data)
        digest = xxhash.xxh3_64()
        for part in parts:
            digest.update(part)
        parts.append(_CRC.pack(digest.intdigest()))
        out.append(parts)
    return out


def encode_blocks(layout: BlockLayout, space: bytes, metas: Sequence[BlockMeta],
                  layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[bytes]:
    """One contiguous payload per block (see `encode_parts` to avoid the copy)."""
    return [b"".join(parts) for parts in encode_parts(layout, space, metas, layers)]


def payload_length(payload) -> int:
    """Bytes of a payload given as bytes-like or as a list of buffers."""
    if isinstance(payload, list):
        return sum(memoryview(p).nbytes for p in payload)
    return memoryview(payload).nbytes


def read_header(data: bytes | memoryview, offset: int = 0) -> tuple[BlockMeta, bytes, int]:
    """(chain position, space digest, total payload length) of the payload at `offset`, for
    scanning. Checks only the magic, version and lengths; `decode_block` does the full check."""
    data = memoryview(data)[offset:]
    if len(data) < _FIXED.size:
        raise PayloadError("length", f"{len(data)} bytes is shorter than a header")
    meta = peek_meta(data)
    _, _, header_len, _, space, *_ = _FIXED.unpack_from(data, 0)
    if len(data) < header_len + _U64.size:
        raise PayloadError("length", "truncated header")
    (body,) = _U64.unpack_from(data, header_len)
    return meta, space, header_len + _U64.size + body + _CRC.size


PEEK_BYTES = _FIXED.size  # a payload's first bytes that `peek_meta` needs


def header_span(data: bytes | memoryview) -> int:
    """Bytes from a payload's start to its body (the header and the body's length), from its
    first PEEK_BYTES bytes: how much to read to check the header alone."""
    if len(data) < _FIXED.size:
        raise PayloadError("length", f"{len(data)} bytes is shorter than a header")
    (header_len,) = _U16.unpack_from(data, 6)
    return header_len + _U64.size


def peek_meta(data: bytes | memoryview) -> BlockMeta:
    """The chain position and tenant from a payload's first PEEK_BYTES bytes (a Redis GETRANGE),
    to choose entries without fetching them whole. Checks the magic and version only."""
    if len(data) < _FIXED.size:
        raise PayloadError("length", f"{len(data)} bytes is shorter than a header")
    magic, version, _, key, _, root, parent, tenant, depth, *_ = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise PayloadError("magic", "not a kvctl block payload")
    if version not in READABLE:
        raise PayloadError("version", f"format version {version}, this kvd reads {READABLE[0]} and {READABLE[1]}")
    try:
        return BlockMeta(key, root, depth, parent if depth else None, tenant.rstrip(b"\0").decode("ascii") or None)
    except ValueError:
        raise PayloadError("layout", "the tenant field is not an ASCII name") from None


def peek_space(data: bytes | memoryview) -> bytes | None:
    """The space digest from a payload's first PEEK_BYTES bytes; None where they are not the
    header of a payload of this format version."""
    if len(data) < _FIXED.size:
        return None
    magic, version, _, _, space, *_ = _FIXED.unpack_from(data, 0)
    return space if magic == MAGIC and version in READABLE else None


class BlockData:
    """A verified block's K/V: (K, V) per layer, each [block, heads, dim], as views of the
    payload's bytes made on demand (indexing, iteration, len); `stacked()` is the whole block
    as one [layers, 2, block, heads, dim] tensor when every layer has the same dtype."""

    __slots__ = ("raw", "layout", "codec", "_layers", "_decompressed")

    def __init__(self, raw: torch.Tensor, layout: BlockLayout, codec: str = "none") -> None:
        self.raw, self.layout, self.codec, self._layers, self._decompressed = raw, layout, codec, None, None

    @property
    def decoded(self) -> bool:
        """Whether reading its K/V is free now: stored whole, or already decompressed."""
        return self.codec == "none" or self._decompressed is not None

    def stacked(self) -> torch.Tensor | None:
        lay = self.layout
        if len(set(lay.layer_dtypes)) != 1:
            return None
        if self.codec != "none":  # a new tensor in the device's dtype, made once
            if self._decompressed is None:
                self._decompressed = decompress(self.raw, self.codec, lay.layer_dtypes[0], lay.num_layers,
                                                lay.block_size, lay.num_kv_heads, lay.head_dim)
            return self._decompressed
        return self.raw.view(lay.layer_dtypes[0]).view(lay.num_layers, 2, lay.block_size, lay.num_kv_heads,
                                                       lay.head_dim)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._layers is None:
            body = self.stacked()
            if body is not None:
                self._layers = [tuple(layer.unbind(0)) for layer in body.unbind(0)]
            else:
                lay = self.layout
                shape = (lay.block_size, lay.num_kv_heads, lay.head_dim)
                out, offset = [], 0
                for layer, dtype in enumerate(lay.layer_dtypes):
                    size = lay.layer_bytes(layer)
                    out.append((self.raw[offset:offset + size].view(dtype).view(shape),
                                self.raw[offset + size:offset + 2 * size].view(dtype).view(shape)))
                    offset += 2 * size
                self._layers = out
        return self._layers

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers()[layer]

    def __iter__(self):
        return iter(self.layers())

    def __len__(self) -> int:
        return self.layout.num_layers


def check_header(data: bytes | memoryview, layout: BlockLayout, space: bytes,
                 key: bytes | None = None) -> tuple[BlockMeta, str, int, int]:
    """Verify a payload's header, not its body, against the expected space and layout (and
    `key`, when given): (chain position, codec, header bytes, whole payload's length). `data`
    may stop anywhere after the header: the disk tier's start scan reads headers alone."""
    meta, got_space, total = read_header(data)
    if key is not None and meta.key != key:
        raise PayloadError("key", "payload holds another block")
    if got_space != space:
        raise PayloadError("space", "payload belongs to another model, tokenizer, format or scale set")
    codec = payload_codec(data)
    lengths, shape = _layout_fields(layout, codec)
    # the header as this layout writes it: the fields before the depth came from `data` (meta) or
    # were checked above (magic, space), so the version and lengths and all after the depth remain
    if (data[4:8] != lengths or data[_DEPTH_END:_DEPTH_END + len(shape)] != shape
            or (meta.depth == 0 and data[104:136] != _NO_PARENT)):
        raise PayloadError("layout", f"payload layout differs from {layout.describe()}")
    return meta, codec, _DEPTH_END + len(shape), total


_DEPTH_END = 204  # offset of the block size, the first field a layout fixes after the depth


@functools.lru_cache(maxsize=64)
def _layout_fields(layout: BlockLayout, codec: str) -> tuple[bytes, bytes]:
    """(version and header length, the bytes from the block size to the body's length) of every
    header of this layout and codec: what `check_header` compares, made once, not per payload."""
    header = _header(layout, bytes(32), BlockMeta(bytes(32), bytes(32), 0, None), codec)
    return header[4:8], header[_DEPTH_END:]


_CHAIN = struct.Struct(f"<32s32x32s32s{TENANT_BYTES}sI")  # from offset 8: key, (space), root, parent, tenant, depth


class HeaderScanner:
    """Checks the headers of one layout and space as `check_header` does, with the bytes a layout
    fixes compared whole (the start scan's cost a block is this, for a tier of small payloads):
    `check(head)` is (chain position, whole payload's length), or None where `head` is not such a
    header of a codec this kvd writes; then `check_header` says which check fails."""

    def __init__(self, layout: BlockLayout, space: bytes) -> None:
        self.space = space
        # first 8 bytes -> [(the bytes the layout fixes after the depth, the header's end, payload length)]
        self._shapes: dict[bytes, list[tuple[bytes, int, int]]] = {}
        for codec in CODEC_CODES:
            if layout.codec_for(codec) != codec:
                continue
            header = _header(layout, space, BlockMeta(bytes(32), bytes(32), 0, None), codec)
            total = len(header) + layout.body_bytes(codec) + _CRC.size
            # compressed codecs share the first 8 bytes and differ in the codec byte: keep each
            self._shapes.setdefault(header[:8], []).append((header[_DEPTH_END:], len(header), total))

    def check(self, head: bytes | memoryview) -> tuple[BlockMeta, int] | None:
        shapes = self._shapes.get(bytes(head[:8]))
        if shapes is None or head[40:72] != self.space:
            return None
        for shape, end, total in shapes:
            if len(head) >= end and head[_DEPTH_END:end] == shape:
                break
        else:
            return None
        key, root, parent, tenant, depth = _CHAIN.unpack_from(head, 8)
        if depth == 0 and parent != _NO_PARENT:
            return None
        try:
            return BlockMeta(key, root, depth, parent if depth else None,
                             tenant.rstrip(b"\0").decode("ascii") or None), total
        except ValueError:
            return None


@functools.lru_cache(maxsize=16)
def header_scanner(layout: BlockLayout, space: bytes) -> HeaderScanner:
    """The HeaderScanner of a layout and space, made once (a segment's walk asks for it)."""
    return HeaderScanner(layout, space)


def verify_payload(data: bytes | memoryview, layout: BlockLayout, space: bytes, key: bytes) -> tuple[str, int, int]:
    """Check a payload whole against the expected key, space and layout, and its XXH3-64, without
    making tensors of it: (codec, header bytes, length). Raises PayloadError naming the check."""
    _, codec, header_len, total = check_header(data, layout, space, key)
    if len(data) != total:
        raise PayloadError("length", f"{len(data)} bytes where the header says {total}")
    (stored,) = _CRC.unpack_from(data, total - _CRC.size)
    if xxhash.xxh3_64_intdigest(memoryview(data)[:total - _CRC.size]) != stored:
        raise PayloadError("checksum", "XXH3-64 mismatch")
    return codec, header_len, total


def decode_block(data: bytes | memoryview, layout: BlockLayout, space: bytes, key: bytes) -> BlockData:
    """Verify a payload against the expected key, space and layout; return its K/V (views of
    the payload's bytes, no copy; a compressed payload is decompressed when first read)."""
    codec, header_len, total = verify_payload(data, layout, space, key)
    view = memoryview(data)
    with warnings.catch_warnings():  # a bytes payload is read-only; these views are never written
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(view[header_len:total - _CRC.size], dtype=torch.uint8)
    return BlockData(raw, layout, codec)


def payload_codec(data: bytes | memoryview) -> str:
    """The codec a payload names (none for version 4), checked to be one this kvd reads."""
    _, version, header_len, *_ = _FIXED.unpack_from(data, 0)
    if version == VERSION:
        return "none"
    if not _FIXED.size < header_len <= len(data):
        raise PayloadError("length", f"header length {header_len} in a payload of {len(data)} bytes")
    (code,) = _U8.unpack_from(data, header_len - _U8.size)
    name = CODEC_NAMES.get(code)
    if name is None:
        raise PayloadError("layout", f"unknown compression code {code}")
    return name
