"""torchvision backbones of every family (:mod:`padim.models.families`) and their three weight sources.

One constructor, :func:`network` (torchvision's ``get_model``), makes every backbone, on any device (the meta device
for shapes and sizes). The weights:

- ``imagenet``: torchvision's ``WeightsEnum`` (``IMAGENET1K_V1``, from ``get_model_weights``) through its own
  download and cache (``torch.hub.get_dir()/checkpoints``). Offline without the cached file it fails with
  a message saying where to put the file; it never falls back to other weights.
- ``random``: torchvision's own initialisation under a fixed seed (for EfficientNet and MobileNetV3 with the
  BatchNorms' statistics then set from seeded noise pictures:
  :attr:`~padim.models.families.BackboneSpec.random_batchnorm`). For tests and demos only.
- a path: a ``state_dict`` saved with ``torch.save(model.state_dict(), path)`` for the same
  architecture, read with ``weights_only=True``; keys of blocks the detector does not use
  (the classifier's, and those past its deepest stage) are ignored, so a file may hold only the
  blocks up to it (docs/training.md: a weights file made from another framework's).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path, PurePath

import torch
import torchvision
from torch import nn

from padim.models.errors import WeightsError as WeightsError  # re-exported: raised here
from padim.models.families import BACKBONES, BackboneSpec

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class WeightsInfo:
    """Where a backbone's weights came from.

    Attributes:
        source: ``imagenet``, ``random`` or ``file``.
        detail: the torchvision weights name, the seed, or the file path.
        sha256: hash of the parameters and buffers the detector uses.
    """

    source: str
    detail: str
    sha256: str

    @property
    def label(self) -> str:
        """Human-readable origin; random weights say loudly that they are a demo."""
        if self.source == "random":
            return f"RANDOM weights (seed {self.detail}) - demo/test only, not for real inspection"
        return f"{self.source}: {self.detail}"

    @property
    def public_label(self) -> str:
        """:attr:`label` without server paths, for clients of the service: a weights file by its name and digest."""
        if self.source == "file":
            return f"file: {PurePath(self.detail).name} (parameters sha256 {self.sha256[:12]})"
        return self.label

    @property
    def stamp(self) -> str | None:
        """Text stamped on every heat map made with these weights (random ones only)."""
        return "RANDOM WEIGHTS - DEMO ONLY" if self.source == "random" else None

    def to_header(self) -> dict:
        return {"source": self.source, "detail": self.detail, "sha256": self.sha256}


def network(name: str) -> nn.Module:
    """torchvision's ``name`` with its own initialisation (no weights loaded), in eval mode, on the current default
    device (``with torch.device("meta")``: shapes only). The one place a backbone is constructed."""
    return torchvision.models.get_model(name, weights=None).eval()


def build_backbone(
    name: str, weights: str, seed: int = 0, layers: tuple[str, ...] | None = None
) -> tuple[nn.Module, WeightsInfo]:
    """A torchvision backbone in eval mode with the requested weights.

    Args:
        name: a key of ``BACKBONES``.
        weights: ``imagenet``, ``random`` or a state_dict path.
        seed: seed for ``random`` weights.
        layers: the stages a detector will use (default: the backbone's default stages): a state_dict file must
            hold the blocks up to these (and may lack the classifier and deeper blocks).

    Raises:
        WeightsError: weights unavailable (offline), unreadable, or of another architecture.
    """
    if name not in BACKBONES:
        raise WeightsError(f"unknown backbone {name!r}; choose one of: {', '.join(BACKBONES)}")
    spec = BACKBONES[name]
    if weights == "random":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = network(name)
            if spec.random_batchnorm:
                _batchnorm_from_noise(model)
        source, detail = "random", str(seed)
    elif weights == "imagenet":
        model = network(name)
        enum = torchvision.models.get_model_weights(name)[spec.imagenet_weights]
        model.load_state_dict(_imagenet_state_dict(name, enum))
        source, detail = "imagenet", f"torchvision {name} {enum.name}"
    else:
        model = network(name)
        _load_file(model, spec, Path(weights), layers or spec.default_stages)
        source, detail = "file", str(Path(weights).resolve())
    model.eval()
    return model, WeightsInfo(source, detail, "")


#: Seeded noise pictures whose activations set a random backbone's BatchNorm statistics: ``(N, 3, S, S)``.
NOISE_PICTURES = (16, 3, 96, 96)


def _batchnorm_from_noise(model: nn.Module) -> None:
    """Each BatchNorm's running mean and variance set to its input's over :data:`NOISE_PICTURES` of standard normal
    noise (the global generator's, seeded by the caller), every other module in eval mode (no dropout, no stochastic
    depth): each then normalises what it sees to unit scale."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a cumulative average: the one pass's statistics
        norm.train()
    with torch.no_grad():
        model(torch.randn(NOISE_PICTURES))
    for norm, momentum in zip(norms, momenta, strict=True):
        norm.momentum = momentum
    model.eval()


def weights_sha256(state: dict[str, torch.Tensor]) -> str:
    """Hash of a ``state_dict``'s names and values, in its order."""
    digest = hashlib.sha256()
    for key, tensor in state.items():
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _imagenet_state_dict(name: str, enum) -> dict[str, torch.Tensor]:
    filename = os.path.basename(enum.url)
    cached = Path(torch.hub.get_dir()) / "checkpoints" / filename
    try:
        return enum.get_state_dict(progress=True, check_hash=True)
    except Exception as error:  # network errors come in many types (URLError, OSError, ...)
        raise WeightsError(
            f"cannot get the ImageNet weights for {name} ({type(error).__name__}: {error}). "
            f"On a machine with internet, download {enum.url} and copy it to {cached} "
            f"(or set TORCH_HOME to a directory holding hub/checkpoints/{filename}), "
            f"or pass --weights /path/to/{name}_state_dict.pth. "
            "Use --weights random only for demos."
        ) from None


def used_state(backbone: nn.Module, spec: BackboneSpec, layers: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Detached copies of the parameters and buffers a detector on ``layers`` uses."""
    state = backbone.state_dict()
    return {k: state[k].detach().clone().contiguous() for k in spec.used_keys(state, layers)}


def _load_file(model: nn.Module, spec: BackboneSpec, path: Path, layers: tuple[str, ...]) -> None:
    name = spec.name
    if not path.is_file():
        raise WeightsError(f"--weights {path}: no such file (use imagenet, random, or the path of a state_dict)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise WeightsError(
            f"--weights {path}: not a torch state_dict file readable with weights_only=True "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        ) from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"--weights {path}: expected a dict of tensors (model.state_dict())")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    expected = model.state_dict()
    needed = spec.used_keys(expected, layers)
    missing = [k for k in needed if k not in state]
    foreign = [k for k in spec.used_keys(state, layers) if k not in expected]
    if missing or foreign:
        detail = f"missing {missing[:3]}" if missing else f"unknown keys {foreign[:3]}"
        raise WeightsError(f"--weights {path}: not a {name} state_dict ({detail})")
    wrong = [k for k in needed if state[k].shape != expected[k].shape]
    if wrong:
        k = wrong[0]
        raise WeightsError(
            f"--weights {path}: not a {name} state_dict ({k} has shape {tuple(state[k].shape)}, "
            f"{name} needs {tuple(expected[k].shape)})"
        )
    model.load_state_dict({k: state[k] for k in needed}, strict=False)
