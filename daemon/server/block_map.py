"""The physical block map of `kvctl status --blocks`: a character per device block, folded into
at most so many cells for a screen.

kvd reads the characters under the engine's lock (`read_block_map`) and folds them after it
(`fold_block_map`), so a GPU's hundred thousand blocks cross the socket as a couple of thousand
cells; kvctl folds an unfolded map from an older kvd with the same function.
"""

from __future__ import annotations

BLOCK_STATES = {".": "free", "r": "reserved", "a": "active", "s": "shared", "c": "cached", "p": "pinned"}


def read_block_map(cache) -> str:
    """One character per block of a KVCacheManager (BLOCK_STATES); call under the engine's lock."""
    reserved = cache.reserved_block_ids()
    chars = []
    for block in cache.pool.blocks:
        if block.block_id in reserved:
            chars.append("r")
        elif block.ref_count > 1:
            chars.append("s")
        elif block.ref_count == 1:
            chars.append("a")
        elif block.key is not None:
            chars.append("p" if block.pin_count else "c")
        else:
            chars.append(".")
    return "".join(chars)


def fold_block_map(block_map: str, max_cells: int) -> tuple[str, int]:
    """The block map in at most `max_cells` cells: each cell covers `per_cell` consecutive blocks
    and shows the state most of them are in (ties: the first of them). Returns (cells, per_cell)."""
    per_cell = max(1, -(-len(block_map) // max_cells))
    if per_cell == 1:
        return block_map, 1
    cells = []
    for start in range(0, len(block_map), per_cell):
        run = block_map[start:start + per_cell]
        cells.append(max(dict.fromkeys(run), key=run.count))
    return "".join(cells), per_cell
