"""The `encrypted_content` of a reasoning item: the reasoning's text, carried to the next turn by
a client that keeps its own conversation (`store: false`, `include: ["reasoning.encrypted_content"]`,
as Codex sends them).

Encoded, not encrypted: kvd gives the reasoning's text in the item's `content` as well, so the blob
hides nothing from its client; it has only to come back whole, to any replica of a fleet (no key to
share). It is the text as JSON, compressed (zlib) and in URL-safe base64, behind a prefix that names
the format. A blob without that prefix is another server's (OpenAI's, say): kvd cannot read it,
and the item's summary stands in for it.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib

PREFIX = "kvd-reasoning-v1."
MOST_TEXT_BYTES = 64 * 2**20  # a blob that would inflate past this is refused, not inflated


class BlobError(ValueError):
    """A blob with kvd's prefix that does not decode (cut, or altered)."""


def encode(text: str) -> str:
    """The blob that carries `text`."""
    packed = zlib.compress(json.dumps({"text": text}).encode("utf-8"))
    return PREFIX + base64.urlsafe_b64encode(packed).decode("ascii")


def decode(blob: str) -> str | None:
    """The text `blob` carries; None for a blob that is not kvd's; BlobError for one of kvd's
    that does not decode."""
    if not blob.startswith(PREFIX):
        return None
    try:
        packed = base64.b64decode(blob[len(PREFIX):].encode("ascii"), altchars=b"-_", validate=True)
    except (UnicodeError, binascii.Error):
        raise BlobError("it is not URL-safe base64") from None
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(packed, MOST_TEXT_BYTES)
    except zlib.error:
        raise BlobError("it is not zlib-compressed, or was altered") from None
    if inflater.unconsumed_tail or not inflater.eof:
        raise BlobError("it is cut short, or inflates past 64 MiB")
    try:
        text = json.loads(raw.decode("utf-8"))["text"]
    except (UnicodeError, ValueError, KeyError, TypeError):
        raise BlobError("it carries no text") from None
    if not isinstance(text, str):
        raise BlobError("it carries no text")
    return text
