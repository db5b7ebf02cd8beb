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
