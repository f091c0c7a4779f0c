"""The streaming safetensors writer and the bounded, hashed, mapped reader of checkpoint/storage/files.py."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.storage.files import (
    Checksum,
    python_block_sums,
    read_tensors,
    read_verified,
    verify_file,
    write_tensors,
)

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaNs included), same dtype and shape."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for x in shape:
        numel *= x
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)  # every bit pattern: NaNs, infinities, subnormals


def _tensors() -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(DTYPES):
        name = str(dtype).removeprefix("torch.")
        tensors[f"{name}/matrix"] = _random(dtype, (5, 3), i)
        tensors[f"{name}/transposed"] = _random(dtype, (4, 7), 100 + i).t()  # non-contiguous
        tensors[f"{name}/strided"] = _random(dtype, (20,), 200 + i)[::3]
        tensors[f"{name}/scalar"] = _random(dtype, (), 300 + i)
        tensors[f"{name}/empty"] = _random(dtype, (0, 4), 400 + i)
    tensors["complex/conj"] = _random(torch.complex64, (3,), 7).conj()  # a lazy conjugate view
    tensors["float/neg"] = torch.randn(3, dtype=torch.float64).neg()
    tensors["float/expanded"] = torch.arange(3.0).expand(4, 3)
    return tensors


def _blocksum(data: bytes) -> str:
    """blocksum as docs/checkpoints.md defines it, in plain Python: zero-pad to whole
    4096-byte blocks, sum each block's little-endian 64-bit words modulo 2**64, and
    take the sha256 of those sums (little-endian) followed by the size."""
    return hashlib.sha256(
        _sums(data + bytes(-len(data) % 4096)) + len(data).to_bytes(8, "little")
    ).hexdigest()


def _sums(padded: bytes) -> bytes:
    return b"".join(
        (sum(struct.unpack_from("<512Q", padded, start)) % 2**64).to_bytes(8, "little")
        for start in range(0, len(padded), 4096)
    )


def _entry(data: bytes) -> dict:
    return {"blocksum": _blocksum(data), "size": len(data)}


def _manifest(path: Path) -> dict:
    return {"files": {path.name: _entry(path.read_bytes())}}


def test_every_dtype_round_trips_bit_for_bit_and_safetensors_reads_the_file(tmp_path: Path) -> None:
    tensors = _tensors()
    entry = write_tensors(tmp_path / "t.safetensors", tensors)
    data = (tmp_path / "t.safetensors").read_bytes()
    assert entry == {"blocksum": _blocksum(data), "size": len(data)}
    by_safetensors = load_file(tmp_path / "t.safetensors")
    by_fnaccel = read_tensors(tmp_path, "t.safetensors", {"files": {"t.safetensors": entry}})
    assert set(by_safetensors) == set(by_fnaccel) == set(tensors)
    for name, tensor in tensors.items():
        expected = tensor.resolve_conj().resolve_neg()
        assert _same(by_safetensors[name], expected), name
        assert _same(by_fnaccel[name], expected), name
        # each tensor owns exactly its memory: APIs such as Generator.set_state rely on it
        assert by_fnaccel[name].untyped_storage().nbytes() == expected.numel() * expected.element_size(), name


def test_the_data_section_matches_safetensors_own_writer(tmp_path: Path) -> None:
    """Every tensor: the same dtype name, shape and bytes as safetensors' own writer
    gives it (the order among tensors of one element size may differ), every
    tensor aligned to its element size."""
    tensors = {k: v.contiguous() for k, v in _tensors().items() if "conj" not in k and "neg" not in k}
    write_tensors(tmp_path / "ours.safetensors", tensors)
    ours, theirs = (tmp_path / "ours.safetensors").read_bytes(), save_tensors(tensors)

    def split(data: bytes) -> tuple[dict, bytes]:
        n = int.from_bytes(data[:8], "little")
        return json.loads(data[8 : 8 + n]), data[8 + n :]

    (our_header, our_data), (their_header, their_data) = split(ours), split(theirs)
    assert len(ours) == len(theirs) and set(our_header) == set(their_header) == set(tensors)
    for name, tensor in tensors.items():
        mine, reference = our_header[name], their_header[name]
        assert (mine["dtype"], mine["shape"]) == (reference["dtype"], reference["shape"]), name
        begin, end = mine["data_offsets"]
        assert our_data[begin:end] == their_data[slice(*reference["data_offsets"])], name
        assert (len(ours) - len(our_data) + begin) % tensor.element_size() == 0, name


def test_a_file_of_unaligned_tensors_from_another_writer_reads_correctly(tmp_path: Path) -> None:
    one, two = torch.tensor([7], dtype=torch.uint8), torch.tensor([1.5, -2.25], dtype=torch.float64)
    header = json.dumps(
        {
            "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            "b": {"dtype": "F64", "shape": [2], "data_offsets": [1, 17]},
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "u.safetensors"
    path.write_bytes(
        len(header).to_bytes(8, "little") + header + one.numpy().tobytes() + two.numpy().tobytes()
    )
    loaded = read_tensors(tmp_path, path.name, _manifest(path))
    assert torch.equal(loaded["a"], one) and torch.equal(loaded["b"], two)
    assert torch.equal(load_file(path)["b"], two)


MALFORMED = {
    "short": b"\x01\x02",
    "header past the end": (1000).to_bytes(8, "little") + b"{}",
    "not json": (4).to_bytes(8, "little") + b"{{{{",
    "not an object": (2).to_bytes(8, "little") + b"[]",
    "unknown dtype": b'{"a":{"dtype":"X9","shape":[1],"data_offsets":[0,1]}}',
    "negative shape": b'{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}',
    "offsets disagree with shape": b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}',
    "gap": b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
    "overlap": b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[1],'
    b'"data_offsets":[1,2]}}',
    "bytes left over": b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    "bool shape": b'{"a":{"dtype":"U8","shape":[true],"data_offsets":[0,1]}}',
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_file_hashed_as_listed_is_refused_by_name(tmp_path: Path, case: str) -> None:
    body = MALFORMED[case]
    if body.startswith(b"{"):  # a header: give it its length and two data bytes
        body = len(body).to_bytes(8, "little") + body + b"\x00\x00"
    path = tmp_path / "m.safetensors"
    path.write_bytes(body)
    with pytest.raises(CheckpointError, match=r"m\.safetensors: not a valid safetensors file"):
        read_tensors(tmp_path, path.name, _manifest(path))


@pytest.mark.parametrize("where", [3, 20, -1])  # the header length, the header, the data
def test_a_flipped_byte_is_named_corrupt_wherever_it_lands(tmp_path: Path, where: int) -> None:
    path = tmp_path / "c.safetensors"
    write_tensors(path, {"w": torch.arange(64, dtype=torch.float32)})
    manifest = _manifest(path)
    assert torch.equal(read_tensors(tmp_path, path.name, manifest)["w"], torch.arange(64.0))
    verify_file(tmp_path, path.name, manifest)
    data = bytearray(path.read_bytes())
    data[where] ^= 0x40
    path.write_bytes(bytes(data))
    for read in (read_tensors, verify_file, read_verified):
        with pytest.raises(CheckpointError, match=r"c\.safetensors: corrupt \(its blocksum does not match"):
            read(tmp_path, path.name, manifest)


@pytest.mark.parametrize("size", [0, 1, 8, 4095, 4096, 4097, 3 * 4096 + 1000, 3 * 2**20 + 5000])
def test_blocksum_is_the_documented_sum_whatever_the_chunks(size: int) -> None:
    """Checksum agrees with the definition however the bytes are cut, and so do the
    block sums without torch (what a process that never imports torch uses)."""
    data = os.urandom(size - size % 4096)
    assert python_block_sums(data) == _sums(data)
    data = os.urandom(size)
    for chunk in (size or 1, 1, 7, 4096, 5000) if size < 2**20 else (size, 2**20 + 7, 4096 * 300 + 1):
        digest = Checksum()
        for start in range(0, size, chunk):
            digest.update(data[start : start + chunk])  # read-only bytes, as the header piece of a write
        assert digest.hexdigest() == _blocksum(data), chunk
    writable = Checksum()
    writable.update(memoryview(bytearray(data)))
    assert writable.hexdigest() == _blocksum(data)


def test_blocksum_sees_a_flipped_bit_anywhere_a_zeroed_block_moved_blocks_and_an_appended_zero() -> None:
    data = bytearray(os.urandom(2**21 + 100))  # torch sums the blocks, Python the last one
    reference = Checksum()
    reference.update(data)

    def digest(changed: bytes) -> str:
        checksum = Checksum()
        checksum.update(changed)
        return checksum.hexdigest()

    for where in (0, 7, 8, 4095, 4096, 2 * 4096 + 17, len(data) - 1):
        for bit in (0, 7):
            flipped = bytearray(data)
            flipped[where] ^= 1 << bit
            assert digest(flipped) != reference.hexdigest(), (where, bit)
    zeroed = data[:4096] + bytes(4096) + data[8192:]
    swapped = data[4096:8192] + data[:4096] + data[8192:]
    for changed in (zeroed, swapped, data + b"\0", data[:-1]):
        assert digest(changed) != reference.hexdigest()


def test_loaded_tensors_are_private_views_that_outlive_their_file(tmp_path: Path) -> None:
    """The tensors map the file copy-on-write: writing one leaves the file alone, and
    replacing or deleting the file (what a later save or a rotation does) leaves
    them as they were read."""
    path = tmp_path / "p.safetensors"
    expected = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2, 3], dtype=torch.int64)}
    write_tensors(path, expected)
    before = path.read_bytes()
    loaded = read_tensors(tmp_path, path.name, _manifest(path))
    loaded["w"].add_(1)
    assert path.read_bytes() == before
    torch.testing.assert_close(load_file(path)["w"], expected["w"])
    replacement = tmp_path / "next.safetensors"
    write_tensors(replacement, {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.int64)})
    os.replace(replacement, path)
    assert torch.equal(loaded["w"], expected["w"] + 1) and torch.equal(loaded["b"], expected["b"])
    path.unlink()
    assert torch.equal(loaded["b"], expected["b"])


def test_verify_file_checks_the_size_before_reading_and_refuses_what_is_not_a_regular_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "v.bin"
    path.write_bytes(b"x" * 100)
    manifest = _manifest(path)
    verify_file(tmp_path, "v.bin", manifest)
    manifest["files"]["v.bin"]["size"] = 99
    with pytest.raises(
        CheckpointError, match=r"v\.bin: truncated or extended \(100 bytes, the manifest says 99\)"
    ):
        verify_file(tmp_path, "v.bin", manifest)
    (tmp_path / "zero.bin").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"zero\.bin: a symbolic link"):
        verify_file(tmp_path, "zero.bin", {"files": {"zero.bin": _entry(bytes(8))}})


def test_an_unsupported_dtype_or_layout_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"'q' has dtype torch.complex128, which safetensors cannot store"
    ):
        write_tensors(tmp_path / "x.safetensors", {"q": torch.zeros(2, dtype=torch.complex128)})
    with pytest.raises(CheckpointError, match=r"'s' is torch.sparse_coo; save its dense form"):
        write_tensors(tmp_path / "y.safetensors", {"s": torch.eye(2).to_sparse()})
