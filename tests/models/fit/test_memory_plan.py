"""The memory plan said before a fit: its parts, and what is offered when it does not fit."""

import dataclasses

import pytest

from padim.models import PadimConfig
from padim.models.fit.memory_plan import (
    DoesNotFit,
    FitFacts,
    check,
    free_memory,
    plan_fit,
    ran_out,
    spool_in_memory,
)

WIDE = PadimConfig(backbone="wide_resnet50_2", weights="random")


def test_statistics_are_the_packed_float64_comoment_and_the_means():
    plan = plan_fit(WIDE, FitFacts(40, True), device="cpu")
    pixels, dim = 56 * 56, 550
    assert plan.statistics == pixels * dim * (dim + 1) // 2 * 8 + 2 * pixels * dim * 8  # 3.8 GB, not 7.6
    # each picture's embeddings and its changed copy's wait on disk (the default expects the line's changes)
    assert plan.spool == 40 * 2 * pixels * dim * 4 and plan.factors == pixels * dim * (dim + 1) // 2 * 4
    assert plan_fit(WIDE.replace(expect="stable"), FitFacts(40, True), device="cpu").spool == 40 * pixels * dim * 4
    assert plan.total == plan.statistics + plan.finish + plan.backbone + plan.process
    assert 4.5e9 < plan.total < 6e9  # the target for this fit: at most 6 GB (measured: 5.3 GB)


def test_slim_drops_the_comoment_only_when_the_embeddings_are_spooled():
    kept = plan_fit(WIDE, FitFacts(40, True), device="cpu")
    slim = plan_fit(WIDE, FitFacts(40, True, with_statistics=False), device="cpu")
    streamed = plan_fit(WIDE, FitFacts(40, False, with_statistics=False), device="cpu")
    assert slim.statistics < kept.statistics / 100
    assert streamed.statistics == kept.statistics  # without a spool the statistics are streamed into memory
    assert plan_fit(WIDE, FitFacts(40, True, with_statistics=False, resume=True)).statistics == kept.statistics


def test_the_plan_grows_with_images_only_by_their_distances():
    few, many = (plan_fit(PadimConfig(weights="random"), FitFacts(n, True), device="cpu") for n in (100, 800))
    # (N, P) float32 out-of-fold distances of the pictures and of their changed copies: 17.6 MB
    assert many.total - few.total == 700 * 2 * 56 * 56 * 4
    few, many = (
        plan_fit(PadimConfig(weights="random", expect="stable"), FitFacts(n, True), device="cpu") for n in (100, 800)
    )
    assert many.total - few.total == 700 * 56 * 56 * 4  # without copies: 8.8 MB


def test_a_plan_over_the_free_memory_names_what_would_fit():
    plan = plan_fit(WIDE, FitFacts(40, True), device="cpu")
    check(WIDE, plan, plan.total, FitFacts(40, True, True, False))  # fits exactly: nothing said
    with pytest.raises(DoesNotFit) as info:
        check(WIDE, plan, 4 * 2**30, FitFacts(40, True, True, False))
    message = str(info.value)
    assert "needs about 5.9 GB" in message and "of 4.3 GB free" in message
    assert "--image-size 176" in message and "--embedding-dim 412" in message and "--slim" in message


def test_free_memory_of_this_machine_is_known():
    assert free_memory("cpu") > 2**28


def test_a_gpu_that_ran_out_mid_fit_is_told_options_well_under_its_plan(monkeypatch):
    monkeypatch.setattr("padim.models.fit.memory_plan.free_memory", lambda device: 64 * 2**30)  # the host's
    config = PadimConfig(backbone="wide_resnet50_2", weights="random", device="cuda", batch_size=16)
    plan = plan_fit(config, FitFacts(200, True), device="cuda")
    error = ran_out(config, plan, 8 * 10**9, FitFacts(200, spool=True, with_statistics=True, resume=False))
    message = str(error)
    assert isinstance(error, DoesNotFit) and message.startswith("the GPU ran out of memory during the fit")
    assert "8.0 GB was free before it started" in message and "--batch-size 8" in message
    assert "--image-size " in message and "--slim" in message and "--device cpu" in message
    size = int(message.split("--image-size ")[1].split()[0])
    assert plan_fit(config.replace(image_size=size), FitFacts(200, True), device="cuda").total <= plan.total * 3 // 4


def test_the_spool_waits_in_gpu_memory_only_where_it_fits_beside_the_plan():
    config = PadimConfig(weights="random", device="cuda")
    plan = plan_fit(config, FitFacts(1000, True), device="cuda")
    assert plan.spool == 1000 * 2 * 56 * 56 * 100 * 4  # 2.5 GB: pictures and their changed copies
    assert spool_in_memory(plan, 80 * 10**9)  # an H100's
    assert not spool_in_memory(plan, plan.total + plan.spool)  # no room left beside it: on disk
    assert not spool_in_memory(plan_fit(config, FitFacts(1000, True), device="cpu"), 10**12)  # a CPU: disk
    assert not spool_in_memory(plan_fit(config, FitFacts(1000, False), device="cuda"), 10**12)  # no spool
    held = dataclasses.replace(plan, spool_held=True)
    assert held.total == plan.total + plan.spool
    assert "embeddings 2.5 GB" in held.describe(None) and "embeddings" not in plan.describe(None)


def test_on_a_gpu_the_plan_counts_a_batch_and_its_changed_copies_through_the_backbone_at_once():
    rough, stable = WIDE, WIDE.replace(expect="stable")
    facts = FitFacts(40, True)
    assert plan_fit(stable, facts, "cuda").backbone == plan_fit(stable, facts, "cpu").backbone
    on_gpu, on_cpu = plan_fit(rough, facts, "cuda").backbone, plan_fit(rough, facts, "cpu").backbone
    assert 0.5e9 < on_gpu - on_cpu < 0.7e9  # 16 more pictures' activations: 710 B/px at 224 px


@pytest.mark.parametrize("backbone", ["vgg16", "efficientnet_b0", "mobilenet_v3_large", "convnext_tiny"])
def test_every_family_is_planned_with_its_own_stages_and_weights(backbone):
    """The weights counted are the parameters of the blocks up to the deepest stage read (those torch.fx keeps), and
    the activations the family's factor over its stem's and stages' outputs (models/families.py)."""
    import torch
    from torchvision.models.feature_extraction import create_feature_extractor

    from padim.models.features.backbones import network
    from padim.models.fit.memory_plan import _weights_bytes

    config = PadimConfig(backbone=backbone, weights="random")
    with torch.device("meta"):
        kept = create_feature_extractor(network(backbone), {s: s for s in config.features.stages}).state_dict()
    assert _weights_bytes(config) == sum(t.numel() * 4 for t in kept.values())
    plan = plan_fit(config, FitFacts(40, True), device="cpu")
    spec, pixels = config.spec, 56 * 56
    assert plan.statistics == pixels * 100 * 101 // 2 * 8 + 2 * pixels * 100 * 8  # D 100 of each
    outputs = [*spec.stem, *zip(spec.channels[:3], spec.strides[:3], strict=True)]
    activations = int(spec.activation_factor * 4 * sum(c / s**2 for c, s in outputs) * 224**2 * 16)
    embeddings = 16 * pixels * 100 * 4 * 2  # a batch's embeddings and its copies' (rough), beside the spool
    assert plan.backbone == 2 * _weights_bytes(config) + activations + embeddings
    shallower = plan_fit(config.replace(layers=spec.stages[:2], embedding_dim=32), FitFacts(40, True), device="cpu")
    assert shallower.backbone < plan.backbone  # fewer blocks kept, fewer outputs


def test_a_fit_that_makes_the_int8_scorer_counts_its_onnx_runtime_sessions():
    """The int8 backbone's session, and on a CPU the float32 graph's that pass 1 runs: a batch's activations each
    (and that graph's weights), as the plain fit's backbone counts its own."""
    from padim.models.fit.memory_plan import _weights_bytes

    config = PadimConfig(weights="random")
    plain, scorer = FitFacts(200, True), FitFacts(200, True, int8_scorer=True)
    weights = _weights_bytes(config)
    for device, sessions in (("cpu", 2), ("cuda", 1)):
        before, after = plan_fit(config, plain, device), plan_fit(config, scorer, device)
        activations = before.backbone - 2 * weights - 16 * 56 * 56 * 100 * 4 * 2  # less the batch's embeddings
        if device == "cuda":  # on a GPU a batch and its copies go through the backbone in one call
            activations //= 2
        expected = sessions * activations + (weights if device == "cpu" else 0)
        assert after.backbone - before.backbone == pytest.approx(expected, rel=1e-6)
        assert after.total - before.total == after.backbone - before.backbone
    # a resume runs torch's float32 backbone (its model's graph comes without its float32 source): the int8 one's alone
    resumed = plan_fit(config, FitFacts(200, True, resume=True, int8_scorer=True), "cpu").backbone
    assert resumed - plan_fit(config, FitFacts(200, True, resume=True), "cpu").backbone == pytest.approx(
        activations, rel=1e-6
    )


def test_a_fit_over_the_free_memory_with_its_int8_scorer_is_told_it_fits_without():
    scorer = FitFacts(40, True, int8_scorer=True)
    without = plan_fit(WIDE, FitFacts(40, True), device="cpu").total
    with pytest.raises(DoesNotFit) as info:
        check(WIDE, plan_fit(WIDE, scorer, device="cpu"), without, scorer)
    assert f"--no-int8-scorer (no ONNX Runtime sessions beside the backbone; {without / 1e9:.1f} GB)" in str(info.value)
