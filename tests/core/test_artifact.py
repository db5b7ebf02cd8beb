import errno
import json
import os
import struct

import pytest
import torch
from helpers import tensor_byte_ranges

from padim.core import artifact
from padim.core.artifact import ArtifactError, load_artifact, read_header, save_artifact
from padim.core.packing import pack_lower, unpack_lower


def test_round_trip(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.randn(2).half()}
    save_artifact(tmp_path / "m.padim", tensors, {"backbone": "resnet18", "nested": {"x": [1, 2]}})
    loaded, header = load_artifact(tmp_path / "m.padim")
    assert header["nested"] == {"x": [1, 2]} and header["format_version"] == artifact.FORMAT_VERSION
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype


def test_file_is_safetensors_and_nothing_else(tmp_path):
    """8-byte length, JSON header, then exactly the tensors' bytes: there is no room for a pickle."""
    path = tmp_path / "m.padim"
    tensors = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.float16)}
    save_artifact(path, tensors, {})
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    assert "padim" in header["__metadata__"]
    spans = sorted(tuple(e["data_offsets"]) for k, e in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # contiguous, no gaps
    assert 8 + length + spans[-1][1] == len(raw)  # and nothing after them
    assert raw[8 + length :] == tensors["a"].numpy().tobytes() + tensors["b"].numpy().tobytes()


@pytest.mark.parametrize("cut", [0.5, 0.95])
def test_truncated_file_gives_one_line_error(tmp_path, cut):
    path = tmp_path / "m.padim"
    save_artifact(path, {"a": torch.randn(1000)}, {})
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(ArtifactError) as info:
        load_artifact(path)
    assert "\n" not in str(info.value) and "m.padim" in str(info.value)


def test_foreign_and_missing_files(tmp_path):
    png = tmp_path / "x.padim"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
    with pytest.raises(ArtifactError, match="not a readable padim model"):
        load_artifact(png)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ArtifactError, match="not a padim model"):
        load_artifact(tmp_path / "other.safetensors")
    with pytest.raises(ArtifactError, match="no such model file"):
        load_artifact(tmp_path / "missing.padim")


def test_newer_format_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(artifact, "FORMAT_VERSION", artifact.FORMAT_VERSION + 1)
    save_artifact(tmp_path / "new.padim", {"a": torch.zeros(1)}, {})
    monkeypatch.undo()
    with pytest.raises(ArtifactError, match="upgrade padim"):
        load_artifact(tmp_path / "new.padim")


def test_failed_write_keeps_previous_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "m.padim"
    save_artifact(path, {"a": torch.ones(3)}, {"v": 1})
    before = path.read_bytes()

    def broken():  # the first chunk is written, then the user presses Ctrl-C
        yield torch.zeros(2)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_artifact(path, {"a": torch.zeros(3), "b": artifact.TensorStream(torch.float32, (4,), broken)}, {"v": 2})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.padim"]


def test_pack_unpack_lower_and_symmetric():
    a = torch.randn(3, 5, 5, dtype=torch.float64)
    lower = a.tril()
    assert pack_lower(a).shape == (3, 15)
    torch.testing.assert_close(unpack_lower(pack_lower(a), 5), lower)
    sym = a + a.transpose(1, 2)
    torch.testing.assert_close(unpack_lower(pack_lower(sym), 5, symmetric=True), sym)


def test_new_files_are_world_readable_and_modes_are_kept(tmp_path):
    path = tmp_path / "m.padim"
    save_artifact(path, {"a": torch.zeros(1)}, {})
    assert path.stat().st_mode & 0o777 == 0o644
    path.chmod(0o640)
    save_artifact(path, {"a": torch.ones(1)}, {})
    assert path.stat().st_mode & 0o777 == 0o640


def flip_bit(path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_any_tensor_is_refused_naming_it(tmp_path):
    tensors = {"mean": torch.randn(4, 3), "precision_factor": torch.randn(4, 6).half(), "count": torch.tensor(7)}
    clean = tmp_path / "clean.padim"
    save_artifact(clean, tensors, {"kind": "test"})
    for name, (start, end) in tensor_byte_ranges(clean).items():
        broken = tmp_path / f"{name}.padim"
        broken.write_bytes(clean.read_bytes())
        flip_bit(broken, (start + end) // 2, bit=3)
        with pytest.raises(ArtifactError) as info:
            load_artifact(broken)
        assert f"tensor '{name}' does not match its digest" in str(info.value) and "\n" not in str(info.value)
        # a tensor that is not read is not checked (serving skips the training accumulators)
        assert load_artifact(broken, skip_prefixes=(name,))[1]["verified"] is True


def test_a_changed_header_value_is_refused(tmp_path):
    path = tmp_path / "m.padim"
    save_artifact(path, {"a": torch.zeros(2)}, {"calibration": {"threshold": 21.07}})
    raw = path.read_bytes()
    assert raw.count(b"21.07") == 1
    path.write_bytes(raw.replace(b"21.07", b"23.07"))  # one flipped bit in a digit: 1 -> 3
    with pytest.raises(ArtifactError, match="header does not match its digest"):
        read_header(path)


def test_format_one_files_still_load_unverified(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "old.padim"
    save_file({"a": torch.ones(2)}, str(path), metadata={"padim": json.dumps({"format_version": 1, "kind": "x"})})
    tensors, header = load_artifact(path)
    assert header["verified"] is False and torch.equal(tensors["a"], torch.ones(2))


def test_the_disk_is_asked_to_write_while_the_file_is_still_being_written(tmp_path, monkeypatch):
    """Every WRITEBACK_BYTES the written part is flushed on a worker thread (fdatasync), so that the final fsync of
    a file of several GB waits for its tail only; the file is the same."""
    asked = []
    monkeypatch.setattr(artifact, "WRITEBACK_BYTES", 100)
    monkeypatch.setattr(artifact, "_FLUSH", lambda fd: asked.append(os.fstat(fd).st_size))
    chunks = [torch.full((40,), float(i)) for i in range(6)]  # 160 bytes each
    stream = artifact.TensorStream(torch.float32, (6, 40), lambda: iter(chunks))
    save_artifact(tmp_path / "m.padim", {"s": stream, "b": torch.arange(7)}, {"kind": "test"})
    loaded, _ = load_artifact(tmp_path / "m.padim")
    assert torch.equal(loaded["s"], torch.stack(chunks)) and torch.equal(loaded["b"], torch.arange(7))
    assert asked and asked[0] < (tmp_path / "m.padim").stat().st_size  # asked before the last chunk was written


def test_a_flush_that_fails_fails_the_write_and_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "m.padim"
    save_artifact(path, {"a": torch.ones(3)}, {"v": 1})
    before = path.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(artifact, "WRITEBACK_BYTES", 8)
    monkeypatch.setattr(artifact, "_FLUSH", full)
    with pytest.raises(OSError, match="No space"):
        save_artifact(path, {"a": torch.zeros(300)}, {"v": 2})

    def interrupted():  # a write that fails on its own while a flush fails: its own error is the one raised
        yield torch.zeros(300)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_artifact(path, {"a": artifact.TensorStream(torch.float32, (600,), interrupted)}, {"v": 3})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.padim"]


def test_streamed_tensors_are_written_chunk_by_chunk_and_any_safetensors_reader_agrees(tmp_path):
    from safetensors import safe_open

    big = torch.randn(10, 7, dtype=torch.float64)
    stream = artifact.TensorStream(
        torch.float16, (6, 5), lambda: (torch.arange(i * 10, i * 10 + 10).half() for i in range(3))
    )
    tensors = {"count": torch.tensor(3), "big": big, "factor": stream, "flag": torch.tensor([True, False])}
    save_artifact(tmp_path / "m.padim", tensors, {"kind": "test"})
    loaded, header = load_artifact(tmp_path / "m.padim")
    assert torch.equal(loaded["factor"], torch.arange(30).half().view(6, 5)) and torch.equal(loaded["big"], big)
    assert header["tensor_sha256"]["factor"] == artifact.tensor_sha256(torch.arange(30).half().view(6, 5))
    with safe_open(str(tmp_path / "m.padim"), framework="pt") as handle:  # the library itself reads it
        assert json.loads(handle.metadata()["padim"])["kind"] == "test"
        for name in ("count", "big", "factor", "flag"):
            assert torch.equal(handle.get_tensor(name), loaded[name])
    with pytest.raises(ValueError, match="declared"):
        save_artifact(
            tmp_path / "short.padim",
            {"f": artifact.TensorStream(torch.float16, (6, 5), lambda: [torch.zeros(3).half()])},
            {},
        )
    assert not (tmp_path / "short.padim").exists()


def test_copy_with_a_new_header_streams_the_tensors_and_keeps_them(tmp_path):
    tensors = {"a": torch.randn(300, 5), "b": torch.arange(7)}
    save_artifact(tmp_path / "m.padim", tensors, {"calibration": {"threshold": 1.0}})
    before = load_artifact(tmp_path / "m.padim")[0]
    artifact.copy_artifact(tmp_path / "m.padim", tmp_path / "m.padim", {"calibration": {"threshold": 2.0}})
    after, header = load_artifact(tmp_path / "m.padim")
    assert header["calibration"]["threshold"] == 2.0 and all(torch.equal(after[k], before[k]) for k in tensors)
    assert [p.name for p in tmp_path.iterdir()] == ["m.padim"]


def test_a_damaged_file_is_not_copied(tmp_path):
    save_artifact(tmp_path / "m.padim", {"a": torch.randn(1000)}, {"v": 1})
    ((start, end),) = tensor_byte_ranges(tmp_path / "m.padim").values()
    flip_bit(tmp_path / "m.padim", (start + end) // 2)
    with pytest.raises(ArtifactError, match="'a' does not match its digest"):
        artifact.copy_artifact(tmp_path / "m.padim", tmp_path / "copy.padim", {"v": 2})
    assert not (tmp_path / "copy.padim").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m.padim"]


def test_a_tensor_without_a_digest_is_refused_by_load_and_by_copy(tmp_path):
    """A verified header (its own digest consistent) that leaves one tensor's digest out: the
    file was altered. Loading refuses it, and so does copying (which would otherwise give the
    unchecked tensor a fresh digest in the copy)."""
    from safetensors.torch import save_file

    tensors = {"a": torch.ones(3), "b": torch.zeros(2)}
    header = {
        "format_version": artifact.FORMAT_VERSION,
        "kind": "test",
        "tensor_sha256": {"a": artifact.tensor_sha256(tensors["a"])},
    }
    header["header_sha256"] = artifact._header_sha256(header)
    path = tmp_path / "altered.padim"
    save_file(tensors, str(path), metadata={artifact.HEADER_KEY: json.dumps(header, sort_keys=True)})
    assert read_header(path)["verified"] is True  # the header itself is consistent
    with pytest.raises(ArtifactError, match="tensor 'b' has no digest in the header; the file was altered"):
        load_artifact(path)
    with pytest.raises(ArtifactError, match="tensor 'b' has no digest in the header; the file was altered"):
        artifact.copy_artifact(path, tmp_path / "copy.padim", {"v": 2})
    assert not (tmp_path / "copy.padim").exists()
