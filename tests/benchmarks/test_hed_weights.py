"""HED's VGG16 as a torchvision state_dict (benchmarks/hed_weights.py), against a float64 reference of what HED
computes, on a small .h5 written here in HED's layout (the suite never downloads)."""

import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import hed_weights  # noqa: E402  (a benchmark's module, beside its script)

from padim.models.features.backbones import build_backbone  # noqa: E402

#: VGG16's convolutions: (in, out), in HED's order.
WIDTHS = (
    [(3, 64), (64, 64), (64, 128), (128, 128), (128, 256), (256, 256), (256, 256)] + [(256, 512)] + [(512, 512)] * 5
)


@pytest.fixture(scope="module")
def h5(tmp_path_factory) -> Path:
    """Random kernels and biases in HED's file layout (block*/layers/conv2d*/vars/0 and 1, keras' (kh, kw, in, out)),
    with side outputs as HED's file has, which the conversion leaves."""
    path = tmp_path_factory.mktemp("hed") / "hed.weights.h5"
    rng = np.random.default_rng(0)
    widths = iter(WIDTHS)
    with h5py.File(path, "w") as file:
        for block, count in hed_weights.BLOCKS:
            for i in range(count):
                cin, cout = next(widths)
                group = file.create_group(f"{block}/layers/conv2d{'' if i == 0 else f'_{i}'}/vars")
                group["0"] = (rng.standard_normal((3, 3, cin, cout)) / np.sqrt(9 * cin)).astype(np.float32)
                group["1"] = rng.standard_normal(cout).astype(np.float32)
        file["dsn1/vars/0"] = np.zeros((1, 1, 64, 1), np.float32)
    return path


def keras_same_conv(image: np.ndarray, kernel: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """What a keras Conv2D(padding='same') computes, in float64: ``(H, W, in)`` -> ``(H, W, out)``."""
    h, w, _ = image.shape
    padded = np.pad(image, ((1, 1), (1, 1), (0, 0)))
    out = np.zeros((h, w, kernel.shape[3]))
    for i in range(3):
        for j in range(3):
            out += padded[i : i + h, j : j + w] @ kernel[i, j].astype(np.float64)
    return out + bias


def test_the_first_convolution_reads_normalised_rgb_as_hed_reads_bgr_minus_its_mean(h5):
    rng = np.random.default_rng(1)
    pixels = rng.random((12, 12, 3))  # RGB, 0-1
    kernel, bias = hed_weights.keras_convolutions(h5)[0]
    hed_input = 255 * pixels[:, :, ::-1] - np.array(hed_weights.HED_MEAN)  # BGR minus the mean on 0-255
    expected = keras_same_conv(hed_input, kernel, bias)
    state = hed_weights.hed_state_dict(h5)
    z = (pixels - np.array(hed_weights.IMAGENET_MEAN)) / np.array(hed_weights.IMAGENET_STD)
    got = (
        F.conv2d(
            torch.from_numpy(z.transpose(2, 0, 1))[None],
            state["features.0.weight"].double(),
            state["features.0.bias"].double(),
            padding=1,
        )[0]
        .numpy()
        .transpose(1, 2, 0)
    )
    inside = (slice(1, -1), slice(1, -1))  # the border pads other values (docs: the module's docstring)
    scale = np.abs(expected[inside]).max()
    assert np.abs(got[inside] - expected[inside]).max() <= 1e-6 * scale  # float32 weights of float64 folding
    assert np.abs(got - expected).max() > 1e-3 * scale  # and the border does differ: the test would see a mix-up


def test_every_other_convolution_is_kerass_in_torchs_layout(h5):
    rng = np.random.default_rng(2)
    state = hed_weights.hed_state_dict(h5)
    for index, (kernel, bias) in list(
        zip(hed_weights.TORCHVISION_CONVS, hed_weights.keras_convolutions(h5), strict=True)
    )[1:]:
        image = rng.standard_normal((5, 6, kernel.shape[2]))
        expected = keras_same_conv(image, kernel, bias)
        got = (
            F.conv2d(
                torch.from_numpy(image.transpose(2, 0, 1))[None],
                state[f"features.{index}.weight"].double(),
                state[f"features.{index}.bias"].double(),
                padding=1,
            )[0]
            .numpy()
            .transpose(1, 2, 0)
        )
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_the_file_is_a_vgg16_weights_file_for_every_stage(h5, tmp_path):
    torch.save(hed_weights.hed_state_dict(h5), tmp_path / "hed_vgg16.pth")
    model, info = build_backbone("vgg16", str(tmp_path / "hed_vgg16.pth"), layers=("features.15", "features.30"))
    assert info.source == "file"
    assert torch.equal(model.features[28].bias, torch.from_numpy(hed_weights.keras_convolutions(h5)[12][1]))
