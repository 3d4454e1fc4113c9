"""Stable 63-bit digests (plan fingerprints, seeds, checksums): 63 bits fit a signed int64
tensor for collectives and a torch seed."""

from __future__ import annotations

import hashlib


def digest63(*parts: bytes | str) -> int:
    """A 63-bit digest of ``parts`` taken in order (strings as UTF-8)."""
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
    return int.from_bytes(digest.digest(), "little") >> 1
