"""Prefix caching: the keys and values of a prompt's leading blocks, kept for the next prompt that starts the same way.

Shape notation: L layers, Hkv key/value heads, N positions of a block, Dh head width, C model width.

A prompt is read in blocks of ``N`` positions (:data:`oneblock.inference.prefill.CHUNK`, the same fixed chunks
whether anything is cached or not). Block ``i`` is named by a chain hash: the digest of the digest of block
``i - 1`` and block ``i``'s own ids, so a name stands for every id from the start of the prompt to the end of the
block, as vLLM's automatic prefix caching names its blocks. The keys and values a block leaves in the cache
depend on exactly those ids (causal attention: a position sees only itself and earlier ones), so two prompts
whose first ``k`` blocks are equal hold bit-equal keys and values there, and the second may copy them in place
of computing them: what it then computes from its tail is what it would have computed without the cache (the
same chunks, over the same keys), bit for bit.

``PrefixCache`` holds whole blocks under a budget of bytes, each entry one (L, 2, Hkv, N, Dh) tensor (keys then
values per layer) with the block's last hidden states (N, C) (what the head reads: a prompt that asks for its own
tokens' scores takes them from there instead of recomputing the block), and evicts the least recently used. A
prompt's chain is touched from its last block back to its first, so a block is always used more recently than
every block that extends it, and eviction takes the ends of chains before their beginnings (an entry whose parent
is gone could never be found again).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from oneblock.errors import InputError


@dataclass(frozen=True)
class CachedBlock:
    """One cached block: its position in the prompt, its ids, its keys and values (L, 2, Hkv, N, Dh), and the
    last layer's output at its positions (N, C), before the final norm (``None`` where it was not kept)."""

    index: int
    ids: tuple[int, ...]
    kv: Tensor
    hidden: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.hidden.nbytes if self.hidden is not None else 0)


def chain(ids: Sequence[int], size: int, namespace: str = "") -> list[bytes]:
    """The names of the whole blocks of ``ids``: block ``i`` (ids ``[i * size, (i + 1) * size)``) is named by the
    SHA-256 of block ``i - 1``'s name and its own ids; the first block's parent is ``namespace`` (which keeps
    apart the keys and values of different weights, such as adapters, over the same ids)."""
    names = []
    parent = hashlib.sha256(b"oneblock-prefix\0" + namespace.encode()).digest()
    for start in range(0, len(ids) - size + 1, size):
        block = ",".join(str(int(i)) for i in ids[start : start + size]).encode()
        parent = hashlib.sha256(parent + block).digest()
        names.append(parent)
    return names


class PrefixCache:
    """Whole blocks of keys and values named by their chain hashes, under ``budget`` bytes, least recently used
    evicted first.

    Args:
        budget: bytes the entries may hold together (0 holds nothing: every lookup misses).
        size: positions per block (the prefill's chunk).

    Attributes:
        hits, misses: blocks found and not found by ``lookup`` (a lookup stops at the first block it misses).
        stored, evicted: blocks added and dropped.
    """

    def __init__(self, budget: int, size: int) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise InputError(f"budget must be an int >= 0 (bytes of cached keys and values); got {budget!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InputError(f"size must be an int >= 1 (positions per block); got {size!r}")
        self.budget, self.size = budget, size
        self.entries: collections.OrderedDict[bytes, CachedBlock] = collections.OrderedDict()  # oldest use first
        self.bytes = 0
        self.hits = self.misses = self.stored = self.evicted = 0

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def lookup(self, names: Sequence[bytes], ids: Sequence[int]) -> list[CachedBlock]:
        """The cached blocks that start the prompt ``ids`` (named ``names``), in order, up to the first missing
        one; each found block's ids are checked against the prompt's, so a hash collision cannot pass."""
        found: list[CachedBlock] = []
        if not self.enabled:
            return found
        for i, name in enumerate(names):
            block = self.entries.get(name)
            if block is None or block.ids != tuple(ids[i * self.size : (i + 1) * self.size]):
                break
            found.append(block)
        self.hits += len(found)
        self.misses += len(names) > len(found)
        return found

    def store(self, name: bytes, index: int, ids: Sequence[int], kv: Tensor, hidden: Tensor | None = None) -> bool:
        """Keep block ``index`` of a prompt (its ``size`` ids, its keys and values (L, 2, Hkv, N, Dh) and its
        hidden states (N, C), owned by the cache from now on); least recently used blocks make room. Returns
        whether it is kept (a block larger than the whole budget is not)."""
        if name in self.entries:
            return True
        block = CachedBlock(index, tuple(int(i) for i in ids), kv, hidden)
        nbytes = block.nbytes
        if nbytes > self.budget:
            return False
        while self.bytes + nbytes > self.budget:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evicted += 1
        self.entries[name] = block
        self.bytes += nbytes
        self.stored += 1
        return True

    def touch(self, names: Sequence[bytes]) -> None:
        """Mark a prompt's blocks used now, its last block first and its first block last (see the module)."""
        for name in reversed(names):
            if name in self.entries:
                self.entries.move_to_end(name)

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
