"""Weights kept only in the packed form the bf16 kernels read (`kernels.pack_pairs`): their
row-major storage freed (`ops.linear.release_unpacked`), and how what reads them still can.

A released weight keeps its shape, its packed pairs (on the tensor, as `ops.linear` keeps every
packed copy) and a storage of 0 bytes, which the tensors aliasing it share: views, and the
modules' own parameters that `fuse_linears` pointed into a fused weight. `linear` runs it from
the pairs; `readable` gives its values (or an alias's) unpacked for one use; `packed_rows` looks
rows up (an embedding table tied to the LM head); `restore` gives the storage back for a write.
"""

from __future__ import annotations

import weakref

import torch

from kvforge.ops import kernels

# released weights by their storage's address, which every tensor aliasing them shares
_by_storage: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def release(weight: torch.Tensor) -> int:
    """Free a packed weight's own storage (the caller checked it holds just this weight); the bytes freed."""
    storage = weight.untyped_storage()
    freed = storage.nbytes()
    storage.resize_(0)
    weight._kvforge_released = True
    _by_storage[storage._cdata] = weight
    return freed


def is_released(weight: torch.Tensor) -> bool:
    """Whether this weight itself (not an alias of it) was released."""
    return getattr(weight, "_kvforge_released", False)


def base_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The released weight whose storage `tensor` shares (itself, a view or an alias), or None."""
    base = _by_storage.get(tensor.untyped_storage()._cdata)
    return base if base is not None and is_released(base) else None


def pairs_of(weight: torch.Tensor) -> torch.Tensor:
    """A released weight's packed pairs."""
    return weight._kvforge_packed[kernels.pack_pairs][1]


def readable(tensor: torch.Tensor, start: int = 0) -> torch.Tensor:
    """`tensor[start:]`, or where `tensor` belongs to a released weight, the same slice of its values
    unpacked for this use: the same values at the same place in their storage, which `linear`
    runs as it runs the slice (F.linear: a slice is never packed), so the products keep their bits."""
    base = base_of(tensor)
    if base is None:
        return tensor[start:]
    whole = kernels.unpack_pairs(pairs_of(base))
    return whole.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())[start:]


def packed_rows(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows (R,) of a released weight (N, K), read from its pairs: (R, K)."""
    return pairs_of(weight)[rows // 16, :, rows % 16, :].reshape(rows.shape[0], weight.shape[1])


def restore(tensors) -> list[torch.Tensor]:
    """Give the released weight of each tensor among `tensors` (itself, or the weight it aliases)
    its storage back, unpacked from its pairs, so it can be written in place; the weights restored.
    Only while nothing else runs on them (`weights.update_weights`: between steps)."""
    restored = []
    for tensor in tensors:
        base = base_of(tensor)
        if base is not None:
            base.untyped_storage().resize_(base.numel() * base.element_size())
            kernels.unpack_pairs(pairs_of(base), out=base.detach())
            base._kvforge_released = False
            restored.append(base)
    return restored
