"""Pass 1's spool: the rows appended read back slice by slice, on disk and in a device's memory alike."""

import pytest
import torch

from padim.core.spool import EmbeddingSpool


@pytest.mark.parametrize("device", [None, "cpu"], ids=["disk", "memory"])
def test_a_spool_reads_back_every_slice_of_the_rows_appended(tmp_path, device):
    x = torch.randn(7, 10, 3)
    with EmbeddingSpool(tmp_path, capacity=8, pixels=10, dim=3, slice_pixels=4, device=device) as spool:
        assert spool.append(x[:4]) == range(0, 4)
        assert spool.append(x[4:].double()) == range(4, 7)  # stored as float32, whatever comes
        assert spool.slices == [(0, 4), (4, 8), (8, 10)] and spool.nbytes == 7 * 10 * 3 * 4
        for index, (start, stop) in enumerate(spool.slices):
            read = spool.read(index, 2, 6)
            assert read.dtype == torch.float32 and torch.equal(read, x[2:6, start:stop])
        with pytest.raises(ValueError, match="holds 8 rows"):
            spool.append(x[:2])
        with pytest.raises(ValueError, match="not in the spool"):
            spool.read(0, 5, 8)
        with pytest.raises(ValueError, match="cannot spool a batch of shape"):
            spool.append(torch.zeros(1, 9, 3))
        assert (spool.file is None) == (spool.held is not None) == (device is not None)  # one place or the other


def test_a_spool_in_memory_makes_no_file_and_lets_its_memory_go_when_closed(tmp_path):
    spool = EmbeddingSpool(tmp_path / "scratch", 4, 5, 3, 2, device="cpu")
    assert spool.held is not None and spool.held.shape == (4, 5, 3)  # all of it at once: no surprise mid-fit
    assert not (tmp_path / "scratch").exists()
    spool.close()
    assert spool.held is None


@pytest.mark.parametrize("device", [None, "cpu"], ids=["disk", "memory"])
def test_a_float16_spool_keeps_half_the_bytes_and_reads_back_float16s_rounding(tmp_path, device):
    x = torch.randn(6, 10, 3) * 300
    with EmbeddingSpool(tmp_path, 8, 10, 3, 4, device=device, dtype=torch.float16) as spool:
        spool.append(x[:3])
        spool.append(x[3:])
        assert spool.dtype == torch.float16 and spool.nbytes == 6 * 10 * 3 * 2
        for index, (start, stop) in enumerate(spool.slices):
            read = spool.read(index, 1, 6)
            assert read.dtype == torch.float32
            assert torch.equal(read, x[1:6, start:stop].half().float())  # each value rounded once, to float16
            assert (read - x[1:6, start:stop]).abs().max() <= x.abs().max() * 2**-11
    if device is None:  # what the file takes on disk
        assert EmbeddingSpool.size(6, 10, 3, torch.float16) * 2 == EmbeddingSpool.size(6, 10, 3)


@pytest.mark.parametrize("device", [None, "cpu"], ids=["disk", "memory"])
def test_a_float16_spool_widens_to_float32_before_a_value_beyond_float16s_range(tmp_path, device):
    small, large = torch.randn(3, 10, 3), torch.randn(2, 10, 3)
    large[1, 4, 2] = 1e6  # float16 would keep infinity
    with EmbeddingSpool(tmp_path, 8, 10, 3, 4, device=device, dtype=torch.float16) as spool:
        spool.append(small)
        spool.append(large)
        assert spool.dtype == torch.float32 and spool.nbytes == 5 * 10 * 3 * 4
        for index, (start, stop) in enumerate(spool.slices):
            read = spool.read(index, 0, 5)
            assert torch.equal(read[:3], small[:, start:stop].half().float())  # the rows before, as they were kept
            assert torch.equal(read[3:], large[:, start:stop])  # the rest exactly
        assert torch.isfinite(spool.read(1, 0, 5)).all()


def test_a_spool_keeps_float32_or_float16_only(tmp_path):
    with pytest.raises(ValueError, match="float32 or float16"):
        EmbeddingSpool(tmp_path, 4, 5, 3, 2, dtype=torch.bfloat16)
