"""Weight frames: round trip, valid safetensors inside, strict rejection of corrupt or hostile streams."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load

from grpo_cli.rollout.transport.codec import FrameError, FrameReader, encode_frame, encode_stream


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(3, 4, generator=g)), ("b", torch.randn(5, generator=g).bfloat16()),
            ("scalar", torch.tensor(7, dtype=torch.int64)), ("empty", torch.zeros(0, 2)),
            ("mask", torch.tensor([True, False])), ("h", torch.randn(2, 2, generator=g).half())]


def _bytes(frames) -> bytes:
    return b"".join(bytes(p) for frame in frames for p in frame)


def _decode(data: bytes, step: int = 7, max_frame: int = 1 << 20):
    reader = FrameReader(max_frame_bytes=max_frame)
    frames = []
    for i in range(0, len(data), step):
        frames += reader.feed(data[i : i + step])
    reader.finish()
    return frames


def test_round_trip_in_odd_sized_pieces_keeps_names_dtypes_values():
    frames = _decode(_bytes(encode_stream(_tensors(), chunk_bytes=40, version=3)))
    assert frames[-1].is_end and frames[-1].metadata["tensors"] == "6"
    got = [t for f in frames for t in f.tensors]
    for (n, t), (m, u) in zip(_tensors(), got, strict=True):
        assert n == m and t.dtype == u.dtype and torch.equal(t, u)
    assert all(f.metadata["version"] == "3" for f in frames)


def test_chunking_groups_small_tensors_and_isolates_big_ones():
    big = [("x", torch.zeros(100)), ("y", torch.zeros(1)), ("z", torch.zeros(1)), ("w", torch.zeros(100))]
    frames = _decode(_bytes(encode_stream(big, chunk_bytes=64, version=0)))
    assert [[n for n, _ in f.tensors] for f in frames] == [["x"], ["y", "z"], ["w"], []]


def test_each_frame_is_a_valid_safetensors_blob():
    frame = next(iter(encode_stream(_tensors(), chunk_bytes=1 << 20, version=0)))
    blob = b"".join(bytes(p) for p in frame[1:])
    loaded = st_load(blob)
    assert set(loaded) == {n for n, _ in _tensors()}


def test_tied_tensors_are_sent_under_both_names():
    w = torch.randn(4, 4)
    frames = _decode(_bytes(encode_stream([("embed", w), ("lm_head", w)], chunk_bytes=1 << 20, version=0)))
    assert [n for n, _ in frames[0].tensors] == ["embed", "lm_head"]


def test_corrupted_byte_fails_the_checksum():
    data = bytearray(_bytes(encode_stream(_tensors(), chunk_bytes=1 << 20, version=0)))
    data[-200] ^= 0xFF
    with pytest.raises(FrameError, match="checksum"):
        _decode(bytes(data))


def test_truncated_stream_is_reported():
    data = _bytes(encode_stream(_tensors(), chunk_bytes=1 << 20, version=0))
    with pytest.raises(FrameError, match="ended inside frame"):
        _decode(data[:-10])


def test_oversized_frame_is_refused_before_buffering():
    data = _bytes(encode_stream([("x", torch.zeros(1000))], chunk_bytes=1 << 20, version=0))
    with pytest.raises(FrameError, match="exceeds the server limit"):
        _decode(data, max_frame=1000)


def test_bad_magic_names_the_format():
    with pytest.raises(FrameError, match="bad magic"):
        _decode(b"x" * 64)


def _raw_frame(header: dict, data: bytes) -> bytes:
    import xxhash

    raw = json.dumps(header).encode()
    blob = struct.pack("<Q", len(raw)) + raw + data
    return b"GRW2" + struct.pack("<Q", len(blob)) + xxhash.xxh3_128(blob).digest() + blob


@pytest.mark.parametrize("header, data, match", [
    ({"x": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "unsupported dtype"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "do not match"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, "trailing bytes"),
    ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "invalid shape"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "invalid data_offsets"),
    ({"__metadata__": {"a": 1}}, b"", "strings to strings"),
])
def test_hostile_headers_are_rejected_with_a_reason(header, data, match):
    with pytest.raises(FrameError, match=match):
        _decode(_raw_frame(header, data))


def test_encode_rejects_unsupported_dtype_by_name():
    with pytest.raises(FrameError, match="complex"):
        encode_frame([("c", torch.zeros(2, dtype=torch.complex64))], {})


def test_file_stream_round_trip_and_checksums(tmp_path):
    """`write_stream` and `read_stream` (checked before decoding) agree; a flipped byte is reported with its
    frame."""
    from grpo_cli.rollout.transport.codec import read_stream, write_stream

    path = tmp_path / "w.bin"
    with path.open("wb") as out:
        size = write_stream(out, _tensors(), chunk_bytes=40, version=2)
    data = bytearray(path.read_bytes())
    assert size == len(data) == len(_bytes(encode_stream(_tensors(), chunk_bytes=40, version=2)))
    frames = list(read_stream(memoryview(data), max_frame_bytes=1 << 20))
    got = [t for f in frames for t in f.tensors]
    assert frames[-1].is_end and len(got) == len(_tensors())
    for (n, t), (m, u) in zip(_tensors(), got, strict=True):
        assert n == m and torch.equal(t, u)
    data[len(data) // 2] ^= 1
    with pytest.raises(FrameError, match="checksum mismatch"):
        list(read_stream(memoryview(data), max_frame_bytes=1 << 20))


def test_file_stream_continues_short_writes():
    """A raw file may take fewer bytes than asked (Linux: ≤ ~2 GiB per write); write_stream writes the rest."""
    import io

    from grpo_cli.rollout.transport.codec import write_stream

    class Trickle(io.BytesIO):
        def write(self, b) -> int:
            return super().write(bytes(memoryview(b)[:7]))

    out = Trickle()
    size = write_stream(out, _tensors(), chunk_bytes=40, version=2)
    assert out.getvalue() == _bytes(encode_stream(_tensors(), chunk_bytes=40, version=2)) and size == len(out.getvalue())
