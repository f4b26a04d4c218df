"""The message format between stages: pure packing and unpacking of byte buffers, no I/O.

One message is one uint8 buffer on the stage's device::

    int64 prefix  [total_bytes, kind, num_meta_ints, skeleton_bytes, step,
                   micro-batches in the step, carried value (float64 bits, or NaN), 0]
    int64 meta    (dtype, requires_grad, ndim, *shape) per tensor leaf
    skeleton      pickled nesting and non-tensor leaves; empty when equal to the previous one
    tensors       each tensor's bytes, 64-byte aligned; unpacked tensors are views of the buffer

A RESIZE message (kind 1) carries no payload: its ``total_bytes`` announces the size of the
next message on the channel (the receiver must post a receive of exactly that size).

:func:`read_header` and :func:`unpack` check every size and code against the buffer they are
given and raise :class:`WireError` for a truncated or malformed one: a damaged message is an
error, never a wrong tensor.
"""

from __future__ import annotations

import math
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .microbatch import flatten, unflatten

__all__ = [
    "ALIGN", "DATA", "RESIZE", "PREFIX_BYTES", "Header", "WireError", "pack", "pack_resize",
    "read_header", "unpack",
]

ALIGN = 64  # cache line: unpacked tensors are views of the buffer at these offsets
_PREFIX = struct.Struct("<8q")
PREFIX_BYTES = _PREFIX.size
DATA, RESIZE = 0, 1
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_TENSOR = "__tensor__"  # stands for a tensor leaf in the pickled skeleton


class WireError(ValueError):
    """A buffer that is not a whole, well-formed message (truncated, or damaged)."""


@dataclass(frozen=True)
class Header:
    """The prefix of a message. For RESIZE, ``total_bytes`` is the size of the next message."""

    total_bytes: int
    kind: int
    num_meta: int
    skeleton_bytes: int
    step: int
    num_microbatches: int
    carry: float  # a value riding along (the step's loss on its last gradient), else NaN


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack(
    payload: Any,
    *,
    step: int,
    num_microbatches: int,
    device: torch.device,
    carry: float = math.nan,
    previous_skeleton: bytes | None = None,
) -> tuple[Tensor, bytes]:
    """``(message, skeleton)``: ``payload`` packed into one buffer on ``device``.

    ``skeleton`` is the payload's pickled nesting; pass it as ``previous_skeleton`` for the
    next message on the same channel, which then omits it when it has not changed.
    """
    leaves, spec = flatten(payload)
    tensors = [x for x in leaves if isinstance(x, Tensor)]
    skeleton = pickle.dumps((spec, [_TENSOR if isinstance(x, Tensor) else x for x in leaves]))
    sent_skeleton = b"" if skeleton == previous_skeleton else skeleton
    meta: list[int] = []
    for tensor in tensors:
        if tensor.dtype not in _DTYPE_CODE:
            raise TypeError(f"cannot send a tensor of dtype {tensor.dtype} between stages")
        meta += [_DTYPE_CODE[tensor.dtype], int(tensor.requires_grad), tensor.dim()]
        meta += tensor.shape
    offset = aligned(PREFIX_BYTES + 8 * len(meta) + len(sent_skeleton))
    offsets = []
    for tensor in tensors:
        offsets.append(offset)
        offset = aligned(offset + tensor.numel() * tensor.element_size())
    total = offset
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    head = _PREFIX.pack(total, DATA, len(meta), len(sent_skeleton), step, num_microbatches,
                        _float_bits(carry), 0)
    head += struct.pack(f"<{len(meta)}q", *meta) + sent_skeleton
    buffer[: len(head)].copy_(_as_bytes(head))
    for tensor, start in zip(tensors, offsets, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
    return buffer, skeleton


def pack_resize(size: int, new_size: int, *, step: int, num_microbatches: int,
                device: torch.device) -> Tensor:
    """A RESIZE message of ``size`` bytes announcing that the next one has ``new_size``."""
    if size < PREFIX_BYTES or new_size < PREFIX_BYTES:
        raise ValueError(f"messages have at least {PREFIX_BYTES} bytes, got {size} -> {new_size}")
    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    buffer[:PREFIX_BYTES].copy_(_as_bytes(
        _PREFIX.pack(new_size, RESIZE, 0, 0, step, num_microbatches, 0, 0)))
    return buffer


def read_header(buffer: Tensor) -> Header:
    """The prefix of ``buffer``, checked against the buffer's length."""
    length = buffer.numel()
    if length < PREFIX_BYTES:
        raise WireError(f"truncated message: {length} bytes, a message has at least "
                        f"{PREFIX_BYTES}")
    total, kind, num_meta, skeleton_bytes, step, num_microbatches, carry_bits, _ = (
        _PREFIX.unpack_from(_host(buffer, PREFIX_BYTES)))
    if kind == RESIZE:
        if total < PREFIX_BYTES:
            raise WireError(f"RESIZE message announces {total} bytes, fewer than a prefix")
    elif kind != DATA:
        raise WireError(f"unknown message kind {kind} (not a message, or a damaged one)")
    elif total != length:
        raise WireError(f"message says it has {total} bytes but the buffer holds {length} "
                        "(truncated, or sender and receiver disagree on its size)")
    elif num_meta < 0 or skeleton_bytes < 0 or (
            PREFIX_BYTES + 8 * num_meta + skeleton_bytes > length):
        raise WireError(f"message of {length} bytes cannot hold {num_meta} meta ints and a "
                        f"{skeleton_bytes}-byte skeleton")
    return Header(total, kind, num_meta, skeleton_bytes, step, num_microbatches,
                  _bits_float(carry_bits))


def unpack(buffer: Tensor, header: Header, previous_skeleton: Any = None) -> tuple[Any, Any]:
    """``(payload, skeleton)`` of a DATA message whose ``header`` came from :func:`read_header`.

    Tensors are views of ``buffer``. ``skeleton`` is the parsed nesting; pass it as
    ``previous_skeleton`` for the next message on the same channel (sent without one when it
    did not change).
    """
    if header.kind != DATA:
        raise WireError("a RESIZE message has no payload")
    num_meta, skeleton_bytes = header.num_meta, header.skeleton_bytes
    length = buffer.numel()
    meta_end = PREFIX_BYTES + 8 * num_meta
    host = _host(buffer, meta_end + skeleton_bytes)
    meta = struct.unpack_from(f"<{num_meta}q", host, PREFIX_BYTES)
    if skeleton_bytes:
        try:
            skeleton = pickle.loads(host[meta_end : meta_end + skeleton_bytes])
            spec, kinds = skeleton
        except Exception as exc:  # noqa: BLE001 - any damage to the pickle is a wire error
            raise WireError(f"damaged skeleton ({type(exc).__name__}: {exc})") from exc
    elif previous_skeleton is None:
        raise WireError("message omits its skeleton but none was received before on this channel")
    else:
        skeleton = previous_skeleton
        spec, kinds = skeleton
    offset = aligned(meta_end + skeleton_bytes)
    tensors: list[Tensor] = []
    pos = 0
    while pos < num_meta:
        if pos + 3 > num_meta:
            raise WireError(f"meta ends inside a tensor's entry ({num_meta} ints)")
        dtype_code, requires_grad, ndim = meta[pos], meta[pos + 1], meta[pos + 2]
        shape = meta[pos + 3 : pos + 3 + ndim]
        if not 0 <= dtype_code < len(_DTYPES) or requires_grad not in (0, 1) or ndim < 0 or (
                len(shape) != ndim or any(size < 0 for size in shape)):
            raise WireError(f"damaged tensor entry (dtype {dtype_code}, requires_grad "
                            f"{requires_grad}, shape {list(shape)})")
        pos += 3 + ndim
        dtype = _DTYPES[dtype_code]
        nbytes = _numel(shape) * dtype.itemsize
        if offset + nbytes > length:
            raise WireError(f"tensor {len(tensors)} of shape {list(shape)} ends at byte "
                            f"{offset + nbytes}, past the message's {length}")
        tensor = buffer[offset : offset + nbytes].view(dtype).view(shape).detach()
        tensors.append(tensor.requires_grad_(True) if requires_grad else tensor)
        offset = aligned(offset + nbytes)
    if offset != length:
        raise WireError(f"message has {length} bytes but its tensors end at {offset}")
    leaves, taken = [], 0
    for kind in kinds:
        if isinstance(kind, str) and kind == _TENSOR:
            if taken == len(tensors):
                raise WireError(f"skeleton expects more than the {len(tensors)} tensors the "
                                "message holds")
            kind, taken = tensors[taken], taken + 1
        leaves.append(kind)
    if taken != len(tensors):
        raise WireError(f"skeleton expects {taken} tensors, the message holds {len(tensors)}")
    return unflatten(leaves, spec), skeleton


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _host(buffer: Tensor, nbytes: int) -> Any:
    """The first ``nbytes`` of a uint8 buffer as host memory that ``struct`` can read."""
    if buffer.device.type == "cpu":
        return buffer.numpy()  # shares the buffer's memory, no copy
    return buffer[:nbytes].cpu().numpy()


def _as_bytes(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
