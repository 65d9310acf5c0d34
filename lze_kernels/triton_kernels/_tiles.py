"""Views of a ``[R, 4]`` tile as four ``[R]`` columns and back.

A prompt's state is one 16-byte row per table (``layout.py``); loading it as a ``[R, 4]`` tile
lets the compiler use vector loads and stores (``ld.global.v4`` when a thread owns a whole row,
as in the PTX of the small-group variants), and ``reshape`` + ``split`` take it apart without
arithmetic (``split`` peels the last dimension of size 2: element ``2 i + j`` of a row is
``[i, j]`` after the reshape).
"""

import triton
import triton.language as tl


@triton.jit
def unpack4(tile):
    """Columns 0..3 of a ``[R, 4]`` tile."""
    even, odd = tl.split(tl.reshape(tile, (tile.shape[0], 2, 2)))
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def pack4(c0, c1, c2, c3):
    """The ``[R, 4]`` tile whose columns are c0..c3 (inverse of :func:`unpack4`)."""
    tile = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    return tl.reshape(tile, (c0.shape[0], 4))
