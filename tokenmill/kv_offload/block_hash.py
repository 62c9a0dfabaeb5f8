"""Block keys: a chain of hashes over whole blocks of token ids, seeded by the model's KV
identity and the LoRA adapter, as vLLM's prefix-cache block hashes are.

    key[0] = H(seed(identity, adapter), tokens[0:bs])
    key[i] = H(key[i-1], tokens[i*bs:(i+1)*bs])

So a key names the K/V of one block *given everything before it*: the same tokens after a
different prefix, under another adapter or another model's identity, have another key.
BLAKE2b with 16-byte digests: collisions are out of reach, and it hashes a block in ~1 us.
"""

from __future__ import annotations

import hashlib
import struct

DIGEST_SIZE = 16


def chain_seed(identity: str, namespace: str | None) -> bytes:
    """The key before a sequence's first block: the model's KV identity and the adapter's key
    (None: the base model)."""
    text = f"{identity}\0{namespace if namespace is not None else ''}"
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_SIZE).digest()


def block_keys(seed: bytes, token_ids: list[int] | tuple[int, ...], block_size: int,
               start: int = 0, prev: bytes | None = None) -> list[bytes]:
    """Keys of the whole blocks of `token_ids` from block `start` on; `prev`: the key of block
    start - 1 (None: computed from the seed and the tokens before)."""
    n = len(token_ids) // block_size
    if prev is None:
        prev = seed
        for i in range(start):
            prev = _next(prev, token_ids[i * block_size:(i + 1) * block_size])
    keys = []
    for i in range(start, n):
        prev = _next(prev, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(prev)
    return keys


def _next(prev: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(prev, digest_size=DIGEST_SIZE)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()
