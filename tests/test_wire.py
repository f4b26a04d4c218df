"""The message format as pure functions: round trips, alignment, resize, damaged buffers."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from torch import Tensor

from gpipe_core import wire

CPU = torch.device("cpu")


def payload(length: int = 5) -> tuple:
    x = torch.randn(3, length, 4, dtype=torch.float64).requires_grad_(True)
    mask = torch.rand(3, length) > 0.5
    lengths = torch.arange(3)
    return (x, {"mask": mask, "note": "tokens", "n": None}, [lengths, 7])


def pack(value: object, **kwargs: object) -> tuple[Tensor, bytes]:
    return wire.pack(value, step=kwargs.pop("step", 4), num_microbatches=3, device=CPU,
                     **kwargs)  # type: ignore[arg-type]


def roundtrip(buffer: Tensor, previous: object = None) -> object:
    return wire.unpack(buffer, wire.read_header(buffer), previous)[0]


def test_nested_payload_round_trips_with_dtypes_and_requires_grad() -> None:
    sent = payload()
    buffer, _ = pack(sent, carry=2.5)
    header = wire.read_header(buffer)
    assert (header.kind, header.step, header.num_microbatches, header.carry) == (
        wire.DATA, 4, 3, 2.5)
    got = roundtrip(buffer)
    x, inner, (lengths, seven) = got  # type: ignore[misc]
    assert torch.equal(x, sent[0]) and x.dtype == torch.float64 and x.requires_grad
    assert torch.equal(inner["mask"], sent[1]["mask"]) and not inner["mask"].requires_grad
    assert inner["note"] == "tokens" and inner["n"] is None and seven == 7
    assert torch.equal(lengths, sent[2][0]) and lengths.dtype == torch.int64


def test_carry_is_nan_unless_given() -> None:
    assert math.isnan(wire.read_header(pack(payload())[0]).carry)


def test_tensors_are_aligned_views_of_the_buffer() -> None:
    buffer, _ = pack(payload())
    assert buffer.numel() % wire.ALIGN == 0
    x, inner, (lengths, _) = roundtrip(buffer)  # type: ignore[misc]
    for tensor in (x, inner["mask"], lengths):
        offset = tensor.data_ptr() - buffer.data_ptr()
        assert 0 < offset < buffer.numel() and offset % wire.ALIGN == 0


def test_zero_dim_and_empty_tensors() -> None:
    sent = [torch.tensor(3.0), torch.empty(0, 5), torch.ones(2, dtype=torch.bfloat16)]
    got = roundtrip(pack(sent)[0])
    assert [t.shape for t in got] == [t.shape for t in sent]  # type: ignore[attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(got, sent, strict=True))  # type: ignore[call-overload]


def test_skeleton_is_sent_only_when_it_changes() -> None:
    first, skeleton = pack(payload())
    again, skeleton_again = pack(payload(), previous_skeleton=skeleton)
    assert skeleton_again == skeleton and again.numel() < first.numel()
    assert wire.read_header(again).skeleton_bytes == 0
    _, parsed = wire.unpack(first, wire.read_header(first))
    x, *_ = roundtrip(again, parsed)  # type: ignore[misc]
    assert x.shape == (3, 5, 4)
    with pytest.raises(wire.WireError, match="omits its skeleton"):
        roundtrip(again)
    changed, _ = pack([torch.ones(2)], previous_skeleton=skeleton)  # other nesting: sent again
    assert wire.read_header(changed).skeleton_bytes > 0


def test_a_new_shape_changes_the_size_and_resize_announces_it() -> None:
    short, _ = pack(payload(5))
    long, _ = pack(payload(9))
    assert long.numel() > short.numel()
    resize = wire.pack_resize(short.numel(), long.numel(), step=4, num_microbatches=3,
                              device=CPU)
    header = wire.read_header(resize)
    assert resize.numel() == short.numel()
    assert (header.kind, header.total_bytes, header.step) == (wire.RESIZE, long.numel(), 4)
    with pytest.raises(wire.WireError, match="no payload"):
        wire.unpack(resize, header)


def test_unsupported_dtype_is_refused_when_packing() -> None:
    with pytest.raises(TypeError, match="dtype"):
        pack(torch.zeros(2).to(torch.float8_e4m3fn))


def test_every_truncation_is_an_error() -> None:
    buffer, _ = pack(payload())
    for end in range(buffer.numel()):
        with pytest.raises(wire.WireError):
            roundtrip(buffer[:end].clone())


def test_trailing_bytes_are_an_error() -> None:
    buffer, _ = pack(payload())
    longer = torch.cat([buffer, torch.zeros(wire.ALIGN, dtype=torch.uint8)])
    with pytest.raises(wire.WireError, match="says it has"):
        roundtrip(longer)


def patched(buffer: Tensor, index: int, value: int) -> Tensor:
    """``buffer`` with its ``index``-th int64 replaced by ``value``."""
    damaged = buffer.clone()
    damaged[8 * index : 8 * index + 8].copy_(torch.frombuffer(bytearray(struct.pack("<q", value)),
                                                              dtype=torch.uint8))
    return damaged


@pytest.mark.parametrize(
    ("index", "value", "message"),
    [
        (1, 7, "unknown message kind"),  # kind
        (2, 10**6, "cannot hold"),  # meta ints
        (3, -1, "cannot hold"),  # skeleton bytes
        (8, 99, "damaged tensor entry"),  # first tensor's dtype code
        (9, 2, "damaged tensor entry"),  # first tensor's requires_grad
        (10, 7, "damaged tensor entry|meta ends"),  # first tensor's ndim
        (11, 10**9, "past the message"),  # first tensor's first dimension
        (11, 1, "tensors end at"),  # a smaller first dimension: sizes no longer add up
    ],
)
def test_malformed_headers_are_clear_errors(index: int, value: int, message: str) -> None:
    buffer, _ = pack(payload())
    with pytest.raises(wire.WireError, match=message):
        roundtrip(patched(buffer, index, value))


def test_a_damaged_skeleton_is_an_error() -> None:
    buffer, _ = pack(payload())
    header = wire.read_header(buffer)
    start = wire.PREFIX_BYTES + 8 * header.num_meta
    damaged = buffer.clone()
    damaged[start : start + header.skeleton_bytes] = 0x55
    with pytest.raises(wire.WireError, match="skeleton"):
        roundtrip(damaged)


def test_a_skeleton_that_expects_other_tensors_is_an_error() -> None:
    three, _ = pack(payload())
    _, three_tensors = wire.unpack(three, wire.read_header(three))
    _, skeleton = pack([torch.ones(2)])
    one, _ = pack([torch.ones(2)], previous_skeleton=skeleton)  # sent without its skeleton
    with pytest.raises(wire.WireError, match="skeleton expects"):
        roundtrip(one, three_tensors)
