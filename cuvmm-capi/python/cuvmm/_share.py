"""What a CUDA tensor on cuvmm memory becomes on its way to another process, besides its block.

The block travels as the library's hand-off ticket (``cuvmm_offer``, ``cuvmm_take``: the
protocol, its checks and its threads are the library's, see docs/WIRE.md "The hand-off"). What
only Python knows travels beside it: a descriptor (:func:`encode` / :func:`decode`) of where the
storage lies in the block, and the tensor's dtype, size, strides and storage offset, every field
checked on arrival.
"""

from __future__ import annotations

import dataclasses

VERSION = 4


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """A tensor's descriptor, its fields checked (:func:`decode`). On the wire it is the tuple of
    its fields in this order (:func:`encode`): a tuple pickles with no class to import."""

    version: int
    #: Where the storage starts in its block, in bytes.
    offset: int
    #: The storage's size in bytes.
    nbytes: int
    #: The dtype's name in ``torch`` (``"float32"``).
    dtype: str
    size: tuple
    stride: tuple
    storage_offset: int
    requires_grad: bool
    parameter: bool


_FIELDS = tuple(f.name for f in dataclasses.fields(Descriptor))


def encode(*, offset: int, nbytes: int, dtype: str, size, stride, storage_offset: int, requires_grad: bool,
           parameter: bool) -> tuple:
    """The descriptor of a tensor whose storage (``nbytes``) starts ``offset`` bytes into its block.

    >>> decode(encode(offset=512, nbytes=1024, dtype="float32", size=(2, 3), stride=(3, 1),
    ...               storage_offset=4, requires_grad=False, parameter=False), 4096).offset
    512
    """
    return dataclasses.astuple(Descriptor(
        version=VERSION, offset=int(offset), nbytes=int(nbytes), dtype=dtype, size=tuple(int(s) for s in size),
        stride=tuple(int(s) for s in stride), storage_offset=int(storage_offset),
        requires_grad=bool(requires_grad), parameter=bool(parameter)))


def _int(name, v, lo=0):
    if type(v) is not int or v < lo:
        raise ValueError(f"descriptor field {name}: {v!r} is not an integer >= {lo}")
    return v


def decode(d, block_len: int) -> Descriptor:
    """The fields of a descriptor, checked against the ``block_len`` bytes of its block: one that
    does not describe a storage inside the block is refused (ValueError), whoever made it."""
    if not isinstance(d, tuple) or len(d) != len(_FIELDS):
        raise ValueError("not a cuvmm tensor descriptor")
    f = Descriptor(*d)
    if f.version != VERSION:
        raise ValueError(f"descriptor version {f.version!r}, this cuvmm reads {VERSION}")
    for name in ("offset", "nbytes", "storage_offset"):
        _int(name, getattr(f, name))
    if f.offset + f.nbytes > block_len:
        raise ValueError(f"the storage ({f.nbytes} bytes at offset {f.offset}) ends past its block "
                         f"({block_len} bytes)")
    if not isinstance(f.dtype, str) or not f.dtype.isidentifier():
        raise ValueError(f"descriptor field dtype: {f.dtype!r}")
    for name in ("size", "stride"):
        v = getattr(f, name)
        if not isinstance(v, tuple) or not all(type(x) is int and x >= 0 for x in v):
            raise ValueError(f"descriptor field {name}: {v!r} is not a tuple of integers >= 0")
    if len(f.size) != len(f.stride):
        raise ValueError("size and stride differ in length")
    for name in ("requires_grad", "parameter"):
        if type(getattr(f, name)) is not bool:
            raise ValueError(f"descriptor field {name}: {getattr(f, name)!r}")
    return f


def extent(size, stride, storage_offset: int) -> int:
    """Elements of storage a view reaches: one past the furthest element, 0 for an empty view.

    >>> extent((2, 3), (3, 1), 4)
    10
    >>> extent((0, 3), (3, 1), 4)
    0
    """
    if any(s == 0 for s in size):
        return 0
    return storage_offset + 1 + sum((s - 1) * st for s, st in zip(size, stride))
