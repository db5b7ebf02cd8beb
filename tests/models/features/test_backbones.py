"""Every supported backbone states its channels and strides truthfully; weights sources."""

import pytest
import torch
import torchvision

from padim.models.features import backbones
from padim.models.features.backbones import BACKBONES, WeightsError, build_backbone, weights_sha256
from padim.models.features.embedding import FeatureExtractor


@pytest.mark.parametrize("name", list(BACKBONES))
def test_feature_info_matches_the_network(name):
    spec = BACKBONES[name]
    with torch.device("meta"):  # shapes only: no weights, no compute
        model = getattr(torchvision.models, name)(weights=None).eval()
        extractor = FeatureExtractor(model, spec.layers, fold_batchnorm=False)
        outputs = extractor.body(torch.empty(1, 3, 224, 224))
    for layer, channels, stride in zip(spec.layers, spec.channels, spec.strides, strict=True):
        assert tuple(outputs[layer].shape) == (1, channels, 224 // stride, 224 // stride)


def test_paper_dimensions():
    assert sum(BACKBONES["resnet18"].channels[:3]) == 448
    assert sum(BACKBONES["wide_resnet50_2"].channels[:3]) == 1792
    assert BACKBONES["resnet18"].default_embedding_dim == 100
    assert BACKBONES["wide_resnet50_2"].default_embedding_dim == 550


def test_random_weights_are_seeded():
    a, info_a = build_backbone("resnet18", "random", seed=3)
    b, _ = build_backbone("resnet18", "random", seed=3)
    c, _ = build_backbone("resnet18", "random", seed=4)
    assert weights_sha256(a.state_dict()) == weights_sha256(b.state_dict())
    assert weights_sha256(a.state_dict()) != weights_sha256(c.state_dict())
    assert info_a.source == "random" and "demo" in info_a.label and not a.training


def test_state_dict_file_with_extra_keys(tmp_path):
    source, _ = build_backbone("resnet18", "random", seed=7)
    state = source.state_dict()
    state["fc.extra_head.weight"] = torch.zeros(3)  # heads and extras are ignored
    torch.save(state, tmp_path / "r18.pth")
    loaded, info = build_backbone("resnet18", str(tmp_path / "r18.pth"))
    assert info.source == "file"
    for key, value in source.state_dict().items():
        if not key.startswith(("fc.", "layer4.")):
            assert torch.equal(loaded.state_dict()[key], value)


def test_a_file_must_hold_every_stage_the_detector_uses(tmp_path):
    source, _ = build_backbone("resnet18", "random", seed=7)
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("layer4.")}
    torch.save(state, tmp_path / "r18-up-to-layer3.pth")
    build_backbone("resnet18", str(tmp_path / "r18-up-to-layer3.pth"))  # layers 1-3: enough
    with pytest.raises(WeightsError, match=r"missing \['layer4"):
        build_backbone("resnet18", str(tmp_path / "r18-up-to-layer3.pth"), layers=("layer1", "layer4"))


def test_state_dict_file_of_another_architecture(tmp_path):
    other, _ = build_backbone("resnet34", "random")
    torch.save(other.state_dict(), tmp_path / "r34.pth")
    with pytest.raises(WeightsError, match="not a resnet18 state_dict"):
        build_backbone("resnet18", str(tmp_path / "r34.pth"))
    with pytest.raises(WeightsError, match="no such file"):
        build_backbone("resnet18", str(tmp_path / "missing.pth"))
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match="weights_only=True"):
        build_backbone("resnet18", str(tmp_path / "junk.pth"))


def test_imagenet_offline_says_how_to_provide_the_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def offline(url, *args, **kwargs):
        raise OSError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", offline)
    with pytest.raises(WeightsError) as info:
        build_backbone("resnet18", "imagenet")
    message = str(info.value)
    assert "resnet18-f37072fd.pth" in message and str(tmp_path) in message and "--weights" in message


def test_imagenet_from_torch_cache(tmp_path, monkeypatch):
    # A file in torchvision's cache is used as is: the offline-node path of the docs.
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    fake, _ = build_backbone("resnet18", "random", seed=11)
    cache = tmp_path / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(fake.state_dict(), cache / "resnet18-f37072fd.pth")
    model, info = build_backbone("resnet18", "imagenet")
    assert info.source == "imagenet" and "IMAGENET1K_V1" in info.detail
    assert torch.equal(model.conv1.weight, fake.conv1.weight)


def test_unknown_backbone():
    with pytest.raises(WeightsError, match="choose one of: resnet18"):
        backbones.build_backbone("vgg16", "random")
