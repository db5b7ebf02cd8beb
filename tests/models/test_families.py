"""Every backbone of every family states its stages truthfully: checked against torchvision's own network."""

import pytest
import torch
import torchvision
from torchvision.models.feature_extraction import create_feature_extractor

from padim.models.families import BACKBONES, FAMILIES
from padim.models.features.backbones import network


@pytest.mark.parametrize("name", list(BACKBONES))
def test_the_stages_are_the_networks_and_a_detector_uses_the_keys_up_to_its_deepest(name):
    spec = BACKBONES[name]
    with torch.device("meta"):  # shapes only: no weights, no compute
        model = network(name)
        every = create_feature_extractor(model, return_nodes={s: s for s in spec.stages})
        outputs = every(torch.empty(1, 3, 224, 224))
        for stage, channels, stride in zip(spec.stages, spec.channels, spec.strides, strict=True):
            assert tuple(outputs[stage].shape) == (1, channels, 224 // stride, 224 // stride), stage
        # the keys torch.fx keeps for the default stages (the graph holds what it runs) are those the spec names
        cut = create_feature_extractor(model, return_nodes={s: s for s in spec.default_stages})
    assert sorted(spec.used_keys(model.state_dict(), spec.default_stages)) == sorted(cut.state_dict())
    assert not any(k.startswith(tuple(f"{h}." for h in spec.head)) for k in cut.state_dict())
    if spec.family != "resnet":  # each stage is the last node at its stride: the next `features` module halves it
        sizes = []
        x = torch.empty(1, 3, 224, 224, device="meta")
        for module in model.features:
            x = module(x)
            sizes.append(x.shape[-1])
        for stage in spec.stages:
            index = int(stage.split(".")[1])
            assert index + 1 == len(sizes) or sizes[index + 1] < sizes[index] or index + 2 == len(sizes), stage


@pytest.mark.parametrize("name", list(BACKBONES))
def test_every_backbone_has_its_imagenet_weights_and_a_default_within_its_channels(name):
    spec = BACKBONES[name]
    enum = torchvision.models.get_model_weights(name)[spec.imagenet_weights]
    assert enum.url.endswith(".pth")
    assert spec.default_stages == spec.stages[:3] and spec.strides[:3] == (4, 8, 16)
    assert 1 <= spec.default_embedding_dim <= sum(spec.channels_of(spec.default_stages))


def test_the_families_hold_every_backbone_once():
    members = [name for family in FAMILIES.values() for name in family.members]
    assert sorted(members) == sorted(BACKBONES) and len(members) == len(set(members))
    assert {BACKBONES[name].family for family in FAMILIES.values() for name in family.members} == set(FAMILIES)
    assert all(BACKBONES[name].family == family.name for family in FAMILIES.values() for name in family.members)


def test_the_paper_dimensions():
    assert sum(BACKBONES["resnet18"].channels[:3]) == 448 and BACKBONES["resnet18"].default_embedding_dim == 100
    assert sum(BACKBONES["wide_resnet50_2"].channels[:3]) == 1792
    assert BACKBONES["wide_resnet50_2"].default_embedding_dim == 550
    # the plain recipe's VGG16 stages (the script): features 15, 22 and 29 at strides 4, 8 and 16
    assert BACKBONES["vgg16"].default_stages == ("features.15", "features.22", "features.29")
    assert BACKBONES["mobilenet_v3_small"].default_embedding_dim == 88  # all its 16 + 24 + 48 channels
