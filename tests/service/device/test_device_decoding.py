"""JPEGs decoded where the model scores them (service/device/device_decoding.py): which pictures go, what they
become, and the service's answers with it on (``PADIM_DEVICE_DECODE=on``: the same path on the CPU as on a GPU,
with the CPU's decoder in place of nvJPEG)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from padim.models.data.framing import Framing
from padim.models.deploy.runtimes import load_scorer
from padim.service.app import create_app
from padim.service.device.decoding import Decoder
from padim.service.device.device_decoding import DeviceDecode, jpeg_tensor
from padim.service.settings import ServiceSettings


def jpeg(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=92, **options)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def picture(dataset) -> Image.Image:
    return Image.open(dataset / "test" / "hole" / "000.png").convert("RGB")


def test_which_pictures_go_to_the_device(picture):
    device = DeviceDecode(torch.device("cpu"), Framing(size=64))
    assert device.takes(jpeg(picture), 10**8) == picture.size
    assert device.takes(jpeg(picture.convert("L")), 10**8) == picture.size
    assert device.takes(jpeg(picture.convert("CMYK")), 10**8) is None  # nvJPEG's RGB needs Y'CbCr or grey
    png = io.BytesIO()
    picture.save(png, format="PNG")
    assert device.takes(png.getvalue(), 10**8) is None
    assert device.takes(jpeg(picture), 10) is None  # over the limit: the CPU's decoder says so (413)
    assert device.takes(b"\xff\xd8\xffnot a picture", 10**8) is None
    exif = Image.Exif()
    exif[0x0112] = 6  # a quarter turn: the picture as seen is taller than wide
    wide = picture.resize((96, 48))
    assert device.takes(jpeg(wide, exif=exif), 10**8) == (48, 96)
    region = DeviceDecode(torch.device("cpu"), Framing(roi=(0, 0, 32, 32), size=64))
    assert region.takes(jpeg(picture), 10**8) is None  # a region of interest: framed on the CPU


def test_a_jpeg_decoded_there_is_the_cpus_pixels_within_two_levels(model_file, picture):
    scorer = load_scorer(model_file, "torch", "cpu")
    device = DeviceDecode(torch.device("cpu"), scorer.framing)
    decoder = Decoder(1, 10**8, 10**8, 1024)
    exif = Image.Exif()
    exif[0x0112] = 3  # upside down: turned on both sides
    for data in (jpeg(picture), jpeg(picture.resize((300, 200))), jpeg(picture, exif=exif)):
        on_cpu = decoder.decode(scorer, data, False).tensor
        (there,) = device.decode([jpeg_tensor(data)])
        assert there.shape == on_cpu.shape and there.dtype == on_cpu.dtype == torch.uint8  # normalised when scored
        levels = (there.to(torch.int16) - on_cpu.to(torch.int16)).abs()  # decoders and resizers differ by a level
        assert int(levels.max()) <= 2
        assert float(levels.float().mean()) <= 0.25  # most pixels agree exactly


def test_a_jpeg_the_decoder_refuses_is_none_and_the_others_are_decoded(model_file, picture):
    scorer = load_scorer(model_file, "torch", "cpu")
    device = DeviceDecode(torch.device("cpu"), scorer.framing)
    good = jpeg(picture)
    broken = good[: len(good) // 3]  # cut short: the decoder refuses it
    first, second = device.decode([jpeg_tensor(broken), jpeg_tensor(good)])
    assert first is None and second is not None
    fallback = device.on_cpu(jpeg_tensor(good))  # what the scoring thread does with a refused one it can read
    expected = Decoder(1, 10**8, 10**8, 1024).decode(scorer, good, False).tensor
    assert torch.equal(fallback, expected)


def test_the_service_scores_a_jpeg_decoded_there_as_the_cpu_does(model_file, picture):
    """The same JPEG with a heat map (decoded on the CPU: the heat map is drawn on it) and without (decoded by the
    scoring thread): the same verdict, raw scores within 1% (the resizers differ by a level here and there)."""
    data = jpeg(picture.resize((160, 120)))
    settings = ServiceSettings(models=[model_file], device="cpu", runtime="torch", device_decode="on")
    with TestClient(create_app(settings)) as client:
        for _ in range(600):
            if client.get("/health/ready").status_code == 200:
                break
        state = client.app.state.service
        assert state.models["weave"].batcher.device is not None
        there = client.post("/score", content=data, headers={"content-type": "image/jpeg"}).json()
        on_cpu = client.post("/score?heatmap=true", content=data, headers={"content-type": "image/jpeg"}).json()
        batch = client.post("/score/batch", files=[("file", ("a.jpg", data)), ("file", ("b.png", _png(picture)))])
    assert there["raw_score"] == pytest.approx(on_cpu["raw_score"], rel=1e-2)
    assert there["is_anomaly"] == on_cpu["is_anomaly"] and "heatmap" in on_cpu
    results = batch.json()["results"]
    assert batch.status_code == 200 and results[0]["raw_score"] == pytest.approx(there["raw_score"], rel=1e-5)
    assert np.isfinite(results[1]["raw_score"])  # a PNG in the same batch, decoded on the CPU


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
