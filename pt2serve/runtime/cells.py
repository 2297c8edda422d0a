"""The cell KV pool: per-token cells shared by every sequence, with reference counts for shared prefixes.

    k_pools[layer], v_pools[layer] : [num_cells, kv_heads, head_dim], views of one tensor allocated once
    cell 0                         : SCRATCH_CELL, written by padding tokens, never handed out
    cells 1..num_cells-1           : handed out one per token position; a cell shared by a prefix clone
                                     is freed when its last holder lets go

The allocator is host-side bookkeeping only (no tensors), so it is tested without a device.
"""

from __future__ import annotations

import numpy as np
import torch

from pt2serve.contract import SCRATCH_CELL
from pt2serve.errors import Pt2ServeError


class CellAllocator:
    def __init__(self, num_cells: int) -> None:
        if num_cells < 2:
            raise ValueError("a pool needs the scratch cell and at least one more")
        self.num_cells = num_cells
        self._refcount = np.zeros(num_cells, dtype=np.int32)
        self._refcount[SCRATCH_CELL] = 1  # never handed out, never freed
        # Pop from the end: low cell numbers are handed out first.
        self._free = list(range(num_cells - 1, SCRATCH_CELL, -1))

    @property
    def capacity(self) -> int:
        """Cells that can ever be handed out (all but the scratch cell)."""
        return self.num_cells - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> np.ndarray | None:
        """`count` fresh cells, or None when the pool has too few free."""
        if count > len(self._free):
            return None
        cells = np.array([self._free.pop() for _ in range(count)], dtype=np.int64)
        self._refcount[cells] = 1
        return cells

    def share(self, cells: np.ndarray) -> None:
        """Another holder now uses these cells (a prefix clone): they outlive the first holder."""
        np.add.at(self._refcount, cells, 1)

    def free(self, cells: np.ndarray) -> None:
        """Drop one hold on each cell; cells nobody holds return to the free list."""
        if len(cells) == 0:
            return
        held, count = np.unique(cells, return_counts=True)
        if np.any(held == SCRATCH_CELL) or np.any(self._refcount[held] < count):
            raise ValueError("freeing a cell more times than it is held")
        np.add.at(self._refcount, cells, -1)
        released = np.unique(cells[self._refcount[cells] == 0])
        self._free.extend(int(c) for c in released[::-1])


class CellTable:
    """One sequence's cells in position order (cell of position i at index i), growable without copies."""

    def __init__(self, cells: np.ndarray | None = None) -> None:
        initial = cells if cells is not None else np.empty(0, dtype=np.int64)
        self._cells = np.empty(max(16, 2 * len(initial)), dtype=np.int64)
        self._cells[: len(initial)] = initial
        self.length = len(initial)

    def append(self, cells: np.ndarray) -> None:
        needed = self.length + len(cells)
        if needed > len(self._cells):
            grown = np.empty(max(needed, 2 * len(self._cells)), dtype=np.int64)
            grown[: self.length] = self._cells[: self.length]
            self._cells = grown
        self._cells[self.length:needed] = cells
        self.length = needed

    def truncate(self, length: int) -> np.ndarray:
        """Drop positions >= length; returns the dropped cells (for the caller to free)."""
        dropped = self._cells[length:self.length].copy()
        self.length = min(self.length, length)
        return dropped

    @property
    def cells(self) -> np.ndarray:
        """A view of the live cells; valid until the next append."""
        return self._cells[: self.length]


def allocate_kv_pools(
    num_layers: int, num_cells: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One zeroed tensor [layers, 2, cells, kv_heads, head_dim] and its per-layer K and V views.

    Each view is contiguous, as compiled methods require (a strided view would be silently misread).
    Zeroed so padding entries that a mask excludes never hold NaN (0 * NaN would leak through).
    """
    storage = torch.zeros((num_layers, 2, num_cells, num_kv_heads, head_dim), dtype=dtype, device=device)
    k_pools = [storage[layer, 0] for layer in range(num_layers)]
    v_pools = [storage[layer, 1] for layer in range(num_layers)]
    return storage, k_pools, v_pools


def cells_that_fit(
    free_bytes: int, fraction: float, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """How many cells `fraction` of `free_bytes` holds."""
    return int(free_bytes * fraction) // bytes_per_cell(num_layers, num_kv_heads, head_dim, dtype)


def bytes_per_cell(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def check_pool_fits(num_cells: int, cache: dict, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, with the sizes, a pool larger than the memory available for it (before allocating: on the
    CPU an allocation that is too large ends the process through the kernel's OOM killer)."""
    needed = num_cells * bytes_per_cell(cache["num_layers"], cache["num_kv_heads"], cache["head_dim"], dtype)
    available = available_memory_bytes(device)
    if available is not None and needed > available:
        where = "GPU" if device.type == "cuda" else "host"
        raise Pt2ServeError(
            f"a KV pool of {num_cells} cells needs {needed / 1e9:.2f} GB, but only {available / 1e9:.2f} GB of "
            f"{where} memory is available: lower --num-cells"
        )


def available_memory_bytes(device: torch.device) -> int | None:
    """Free device memory on a GPU; the kernel's MemAvailable on a CPU (None where it cannot tell)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
