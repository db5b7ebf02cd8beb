"""The three weight sources of every family's backbones (the stages themselves: tests/models/test_families.py)."""

import pytest
import torch
import torchvision

from padim.models.features import backbones
from padim.models.features.backbones import WeightsError, build_backbone, weights_sha256


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
    with pytest.raises(WeightsError, match="choose one of: resnet18.*vgg16.*efficientnet_b0.*mobilenet_v3_small"):
        backbones.build_backbone("alexnet", "random")


def test_random_weights_are_torchvisions_own_under_the_seed():
    """``random`` is the architecture's constructor after ``torch.manual_seed`` (what benchmarks/timing.py draws and
    what every model file with random weights before the families holds); for EfficientNet and MobileNetV3 the same
    parameters, with the BatchNorms' statistics of noise pictures, so that their features keep unit scale."""
    torch.manual_seed(5)
    expected = torchvision.models.resnet18().state_dict()
    model, _ = build_backbone("resnet18", "random", seed=5)
    assert weights_sha256(model.state_dict()) == weights_sha256(expected)
    torch.manual_seed(5)
    plain = torchvision.models.mobilenet_v3_small().eval()
    model, _ = build_backbone("mobilenet_v3_small", "random", seed=5)
    statistics = ("running_mean", "running_var", "num_batches_tracked")
    for key, value in plain.state_dict().items():
        if key.endswith(statistics):
            assert not torch.equal(model.state_dict()[key], value) or key.endswith("num_batches_tracked"), key
        else:
            assert torch.equal(model.state_dict()[key], value), key
    again, _ = build_backbone("mobilenet_v3_small", "random", seed=5)
    assert weights_sha256(again.state_dict()) == weights_sha256(model.state_dict())  # seeded, noise included
    pictures = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        deep, vanishing = model.features[:9](pictures), plain.features[:9](pictures)  # the stride-16 stage
    assert 0.3 < float(deep.std()) < 3 and float(vanishing.std()) < 1e-3


def features_of(name: str) -> torch.nn.Module:
    """A VGG with values in its ``features`` only: constructed on the meta device, then filled (torchvision's
    initialisation of its 100-million-weight classifier takes seconds, and a file of it half a gigabyte)."""
    with torch.device("meta"):
        model = torchvision.models.get_model(name)
    model.classifier = torch.nn.Identity()
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return model


def test_a_file_of_another_family_holds_its_features_up_to_the_deepest_stage(tmp_path):
    """A VGG file may hold only ``features`` (a conversion from another framework's weights has no classifier):
    enough for every stage up to those it holds; the keys a stage needs are named when missing."""
    source = features_of("vgg11")
    features = {k: v for k, v in source.state_dict().items() if k.startswith("features.")}
    torch.save(features, tmp_path / "vgg11-features.pth")
    loaded, info = build_backbone("vgg11", str(tmp_path / "vgg11-features.pth"))
    assert info.source == "file" and torch.equal(loaded.features[0].weight, source.features[0].weight)
    short = {k: v for k, v in features.items() if int(k.split(".")[1]) < 16}  # up to stride 8
    torch.save(short, tmp_path / "vgg11-short.pth")
    build_backbone("vgg11", str(tmp_path / "vgg11-short.pth"), layers=("features.9", "features.14"))
    with pytest.raises(WeightsError, match=r"not a vgg11 state_dict \(missing \['features.16"):
        build_backbone("vgg11", str(tmp_path / "vgg11-short.pth"))  # the default stages reach features.19
    torch.save(features_of("vgg11_bn").state_dict(), tmp_path / "vgg11_bn.pth")
    with pytest.raises(WeightsError, match="not a vgg11 state_dict"):
        build_backbone("vgg11", str(tmp_path / "vgg11_bn.pth"))
