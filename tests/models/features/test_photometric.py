"""Each picture's light set before the backbone (``train --standardise``): against numpy in float64, and the changes
it must take out (a lamp's gain, a contrast; a colour cast under ``channels``) beside what ``picture`` keeps and what
``gain`` keeps (a contrast)."""

import numpy as np
import pytest
import torch

from padim.models.data.images import normalisation, normalise
from padim.models.features.backbones import IMAGENET_MEAN, IMAGENET_STD
from padim.models.features.photometric import DARK, FLAT, LEVEL, LEVEL_GRID, standardised


def reference(images: np.ndarray, mode: str) -> np.ndarray:
    """numpy, float64: each channel of each picture centred on its mean, divided by its standard deviation
    (``channels``) or by the root of the three channels' mean variance (``picture``)."""
    out = np.empty_like(images, dtype=np.float64)
    for b, picture in enumerate(images.astype(np.float64)):
        spreads = [channel.std() for channel in picture]
        if mode == "picture":
            spreads = [np.sqrt(np.mean(np.square(spreads)))] * 3
        for c, channel in enumerate(picture):
            out[b, c] = (channel - channel.mean()) / max(spreads[c], FLAT)
    return out


def gain_reference(images: np.ndarray) -> np.ndarray:
    """numpy, float64, in 0-1 pixel units: each picture times ``LEVEL`` over the mean of all its pixels (read on the
    grid of ``1 / LEVEL_GRID``)."""
    mean = np.array(IMAGENET_MEAN).reshape(1, 3, 1, 1)
    std = np.array(IMAGENET_STD).reshape(1, 3, 1, 1)
    pixels = images.astype(np.float64) * std + mean
    level = np.round(pixels.reshape(len(pixels), -1).mean(axis=1).reshape(-1, 1, 1, 1) * LEVEL_GRID) / LEVEL_GRID
    return (pixels * LEVEL / np.maximum(level, DARK) - mean) / std


def pictures(seed: int = 0, batch: int = 3, side: int = 48) -> torch.Tensor:
    """``(B, 3, side, side)`` uint8 pictures with a texture, each channel its own level and contrast."""
    rng = np.random.default_rng(seed)
    base = rng.normal(0, 1, size=(batch, 1, side, side))
    texture = np.clip(base + 0.3 * rng.normal(size=(batch, 3, side, side)), -3, 3)
    levels = rng.uniform(90, 120, size=(batch, 3, 1, 1))
    spread = rng.uniform(8, 16, size=(batch, 3, 1, 1))
    return torch.from_numpy((levels + spread * texture).round().astype(np.uint8))  # 42-168: room to change


def model_input(pixels: torch.Tensor) -> torch.Tensor:
    return normalise(pixels, *normalisation(IMAGENET_MEAN, IMAGENET_STD))


@pytest.mark.parametrize("mode", ["channels", "picture"])
def test_standardised_equals_numpy(mode):
    images = model_input(pictures())
    np.testing.assert_allclose(standardised(images, mode).numpy(), reference(images.numpy(), mode), atol=2e-5)


def test_gain_equals_numpy():
    images = model_input(pictures())
    np.testing.assert_allclose(standardised(images, "gain").numpy(), gain_reference(images.numpy()), atol=2e-5)


def test_none_is_the_input_itself():
    images = model_input(pictures())
    assert standardised(images, "none") is images
    with pytest.raises(ValueError, match="none, gain, channels, picture"):
        standardised(images, "brightest")


@pytest.mark.parametrize("mode", ["channels", "picture"])
def test_a_brighter_or_flatter_picture_is_the_same_picture(mode):
    """A lamp's gain and a contrast change of the 8-bit values (within 0-255) change nothing but their rounding."""
    pixels = pictures(1).to(torch.float64)
    mean = pixels.mean(dim=(1, 2, 3), keepdim=True)
    same = standardised(model_input(pixels.round().to(torch.uint8)), mode)
    for changed in (pixels * 1.2, pixels * 0.8, mean + 0.8 * (pixels - mean), mean + 1.15 * (pixels - mean) - 10):
        assert 0 <= changed.min() and changed.max() <= 255
        moved = standardised(model_input(changed.round().to(torch.uint8)), mode)
        # one 8-bit step of rounding in a spread of 8-16 levels
        assert (moved - same).abs().max() < 0.15
        assert (moved - same).abs().mean() < 0.03
    unchanged = model_input(pixels.round().to(torch.uint8))
    assert (model_input((pixels * 1.2).round().to(torch.uint8)) - unchanged).abs().mean() > 0.3  # without it


def test_channels_takes_a_colour_cast_out_and_picture_keeps_it():
    """A warmer lamp: red 30% stronger, blue 20% weaker."""
    pixels = pictures(2).to(torch.float64)
    cast = (pixels * torch.tensor([1.3, 1.0, 0.8], dtype=torch.float64).view(1, 3, 1, 1)).round()
    assert 0 <= cast.min() and cast.max() <= 255
    plain, tinted = model_input(pixels.round().to(torch.uint8)), model_input(cast.to(torch.uint8))
    assert (standardised(tinted, "channels") - standardised(plain, "channels")).abs().mean() < 0.03
    assert (tinted - plain).abs().mean() > 0.1  # without it
    assert (standardised(tinted, "picture") - standardised(plain, "picture")).abs().mean() > 0.1


def test_a_flat_picture_is_centred_not_blown_up():
    flat = torch.full((1, 3, 32, 32), 128, dtype=torch.uint8)
    flat[0, :, 0, 0] = 129  # one level off in one pixel: noise, not texture
    out = standardised(model_input(flat), "channels")
    assert out.abs().max() < 1 and out.mean().abs() < 1e-5  # one level over FLAT; 17 if stretched to spread 1
    assert torch.isfinite(standardised(model_input(torch.zeros((2, 3, 16, 16), dtype=torch.uint8)), "channels")).all()


def test_gain_takes_a_lamps_gain_out_and_keeps_a_contrast():
    """``gain``: 20% more or less light is the same picture; a flatter or harsher one (the same mean) is not, and a
    black frame is raised from ``DARK`` at most, not blown up."""
    pixels = pictures(3).to(torch.float64)
    same = standardised(model_input(pixels.round().to(torch.uint8)), "gain")
    for changed in (pixels * 1.2, pixels * 0.8):
        moved = standardised(model_input(changed.round().to(torch.uint8)), "gain")
        assert (moved - same).abs().max() < 0.1 and (moved - same).abs().mean() < 0.02  # rounding only
    mean = pixels.mean(dim=(1, 2, 3), keepdim=True)
    flatter = standardised(model_input((mean + 0.6 * (pixels - mean)).round().to(torch.uint8)), "gain")
    # the contrast is the picture's own: 0.4 of each pixel's distance from the mean, at the picture's gain
    kept = (0.4 * (pixels - mean) * LEVEL / (mean / 255)).abs() / 255 / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    assert float((flatter - same).abs().mean()) == pytest.approx(float(kept.mean()), rel=0.1)
    black = model_input(torch.zeros((2, 3, 16, 16), dtype=torch.uint8))
    torch.testing.assert_close(standardised(black, "gain"), black, atol=1e-5, rtol=0)  # stays black, finite
    dim = torch.zeros((1, 3, 16, 16), dtype=torch.uint8)
    dim[..., ::2, :] = 2  # a mean of one 8-bit level: raised DARK / level-fold at most, not to LEVEL
    raised = standardised(model_input(dim), "gain") * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    raised = raised + torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    assert abs(float(raised.mean()) - LEVEL * (1 / 255) / DARK) < 1e-3
