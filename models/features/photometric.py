"""Photometric standardisation: each picture's light taken out before the backbone reads it (``train --standardise``).

A lamp that ages, an exposure that drifts, a lens that gathers dust: each multiplies every pixel of a picture by a
little more or less, or spreads them a little more or less about their mean. The Gaussians of a good fit are tight,
and such a change moves every feature of every pixel: a threshold that assumes nothing flags a third of the pictures
10% brighter, and one that covers the change (``--expect``) has to stand far above every normal picture to do so.
What can be normalised need not be insured.

``gain``: each picture's brightness alone set to one level (the mean of its pixels, all channels, to :data:`LEVEL` in
0-1 units: mid grey), by one gain: no centring, no contrast stretch. A lamp's gain is taken out; what a picture's
contrast says (a crack's dark line, a cell's grain) is kept. On ELPV's polycrystalline cells it keeps more of the
defects than ``picture``, whose stretch hides part of them (docs/quality.md has the measurements).
``channels``: each channel of each picture is set to mean 0 and spread 1 on the ImageNet-normalised input (the
statistics the backbone was trained on), read over the whole model input (a tiled model's whole picture, not each
tile). A change of a channel's 8-bit values by a gain and an offset then changes nothing but rounding and clipping.
``picture``: each channel to mean 0, one gain for all three (the root of their mean variance), so the ratios of the
channels' contrasts are kept; a lamp's gain and a contrast change are taken out as well, a colour cast's gain is
not.
What it cannot tell from light: a content whose own spread varies from picture to picture (cells on a slide, grass)
is stretched by its content too, which costs ranking there (docs/calibration.md has the measurements).

Inside the exported graph as in torch (:class:`padim.models.deploy.export.ExportedScorer`): a client sends the
picture normalised as ``padim.json`` says, as before.
"""

from __future__ import annotations

import torch

from padim.models.choices import STANDARDISE
from padim.models.features.backbones import IMAGENET_MEAN, IMAGENET_STD

#: The least spread a picture is stretched from (ImageNet-normalised units: about one 8-bit level, 1 / (255 x
#: 0.229)). A flat field, whose channels vary by less, is centred and stretched no further: its noise is not
#: blown up to a textured picture's contrast.
FLAT = 0.02
#: ``gain``: the brightness (mean pixel, 0-1 units) every picture is set to: mid grey. The average ImageNet
#: picture's (0.449) ranks ELPV's mono cells higher (.911-.913 against .890-.892 with random resnet18) and keeps a
#: seeded random int8 backbone closer to float32, but flags 5 of 25 pictures of the moon's other region against 2
#: (benchmarks/shift.py; docs/quality.md): the promise on another region comes first.
LEVEL = 0.5
#: ``gain``: the brightness is read on a grid of ``1 / LEVEL_GRID`` (a 16th of an 8-bit level), so that every
#: runtime computes the same gain from it.
LEVEL_GRID = 4096
#: ``gain``: the least brightness a picture is raised from (about five 8-bit levels): a black frame is not blown up.
DARK = 0.02


def standardised(images: torch.Tensor, mode: str) -> torch.Tensor:
    """``(B, 3, H, W)`` float32 ImageNet-normalised pictures -> each picture scaled to one brightness (``gain``),
    its channels set to mean 0 and spread 1 (``channels``), or to mean 0 each and one gain for all (``picture``);
    ``none``: ``images`` as they are.

    Reductions and broadcasts only, so that every exporter traces it (ONNX, OpenVINO, TensorRT) and a CUDA graph
    captures it.
    """
    if mode == "none":
        return images
    if mode not in STANDARDISE:
        raise ValueError(f"standardise: {mode!r} is not one of {', '.join(STANDARDISE)}")
    if mode == "gain":
        return _gained(images)
    mean = images.mean(dim=(2, 3), keepdim=True)  # (B, 3, 1, 1)
    centred = images - mean
    variance = (centred * centred).mean(dim=(2, 3), keepdim=True)  # (B, 3, 1, 1)
    if mode == "picture":
        variance = variance.mean(dim=1, keepdim=True)  # (B, 1, 1, 1): one gain for every channel
    return centred * torch.rsqrt(variance.clamp_min(FLAT * FLAT))


def _gained(images: torch.Tensor) -> torch.Tensor:
    """``gain``: pixels ``p = x s + m`` (0-1 units) times ``LEVEL / mean(p)``, normalised again:
    ``x g + (m / s)(g - 1)``."""
    std = images.new_tensor(IMAGENET_STD).view(1, 3, 1, 1)
    mean = images.new_tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    # (B, 1, 1, 1): the mean pixel in 0-1 units, from each channel's mean (one pass over the picture, where the
    # pixels un-normalised first took two more; the same number but for its last bits, which the grid takes out)
    level = (images.mean(dim=(2, 3), keepdim=True) * std + mean).mean(dim=1, keepdim=True)
    # on a grid of 1/4096: ONNX Runtime sums the pixels in another order than torch, and a last-bit difference in
    # the gain moves a pixel across an int8 backbone's rounding step now and then (1% of a score); rounded, both
    # give the same gain, bit for bit, but for a mean within a float's last bit of a grid line
    level = torch.round(level * LEVEL_GRID) / LEVEL_GRID
    gain = LEVEL / level.clamp_min(DARK)
    return images * gain + (mean / std) * (gain - 1)
