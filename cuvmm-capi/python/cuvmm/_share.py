"""What a CUDA tensor on cuvmm memory becomes on its way to another process, besides its block.

The block travels as the library's hand-off ticket (``cuvmm_offer``, ``cuvmm_take``: the
protocol, its checks and its threads are the library's, see docs/WIRE.md "The hand-off"). What
only Python knows travels beside it: a descriptor (:func:`encode` / :func:`decode`) of where the
storage lies in the block, and the tensor's dtype, size, strides and storage offset, every field
checked on arrival.
"""

from __future__ import annotations

VERSION = 4

_FIELDS = ("version", "offset", "nbytes", "dtype", "size", "stride", "storage_offset", "requires_grad",
           "parameter")


def encode(*, offset: int, nbytes: int, dtype: str, size, stride, storage_offset: int, requires_grad: bool,
           parameter: bool) -> tuple:
    """The descriptor of a tensor whose storage (``nbytes``) starts ``offset`` bytes into its block.

    >>> decode(encode(offset=512, nbytes=1024, dtype="float32", size=(2, 3), stride=(3, 1),
    ...               storage_offset=4, requires_grad=False, parameter=False), 4096)["offset"]
    512
    """
    return (VERSION, int(offset), int(nbytes), dtype, tuple(int(s) for s in size), tuple(int(s) for s in stride),
            int(storage_offset), bool(requires_grad), bool(parameter))


def _int(name, v, lo=0):
    if type(v) is not int or v < lo:
        raise ValueError(f"descriptor field {name}: {v!r} is not an integer >= {lo}")
    return v


def decode(d, block_len: int) -> dict:
    """The fields of a descriptor, checked against the ``block_len`` bytes of its block: one that
    does not describe a storage inside the block is refused (ValueError), whoever made it."""
    if not isinstance(d, tuple) or len(d) != len(_FIELDS):
        raise ValueError("not a cuvmm tensor descriptor")
    f = dict(zip(_FIELDS, d))
    if f["version"] != VERSION:
        raise ValueError(f"descriptor version {f['version']!r}, this cuvmm reads {VERSION}")
    for name in ("offset", "nbytes", "storage_offset"):
        _int(name, f[name])
    if f["offset"] + f["nbytes"] > block_len:
        raise ValueError(f"the storage ({f['nbytes']} bytes at offset {f['offset']}) ends past its block "
                         f"({block_len} bytes)")
    if not isinstance(f["dtype"], str) or not f["dtype"].isidentifier():
        raise ValueError(f"descriptor field dtype: {f['dtype']!r}")
    for name in ("size", "stride"):
        if not isinstance(f[name], tuple) or not all(type(v) is int and v >= 0 for v in f[name]):
            raise ValueError(f"descriptor field {name}: {f[name]!r} is not a tuple of integers >= 0")
    if len(f["size"]) != len(f["stride"]):
        raise ValueError("size and stride differ in length")
    for name in ("requires_grad", "parameter"):
        if type(f[name]) is not bool:
            raise ValueError(f"descriptor field {name}: {f[name]!r}")
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
