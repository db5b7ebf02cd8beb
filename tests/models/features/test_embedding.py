import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.ndimage import uniform_filter

from padim.models.families import BACKBONES
from padim.models.features.backbones import build_backbone
from padim.models.features.embedding import Embedding, FeatureExtractor

LAYERS = ("layer1", "layer2", "layer3")


@pytest.fixture(scope="module")
def backbone():
    model, _ = build_backbone("resnet18", "random", seed=0)
    # give BatchNorm non-trivial statistics so that folding has something to fold
    g = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.copy_(torch.randn(module.num_features, generator=g) * 0.1)
            module.running_var.copy_(torch.rand(module.num_features, generator=g) + 0.5)
            module.weight.data.copy_(torch.rand(module.num_features, generator=g) + 0.5)
            module.bias.data.copy_(torch.randn(module.num_features, generator=g) * 0.1)
    return model.eval()


def test_batchnorm_folding_changes_outputs_by_less_than_1e_4(backbone):
    images = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    folded = FeatureExtractor(backbone, LAYERS, fold_batchnorm=True)
    plain = FeatureExtractor(backbone, LAYERS, fold_batchnorm=False)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in folded.modules())
    for a, b in zip(folded(images), plain(images), strict=True):
        assert (a - b).abs().max() < 1e-4


def naive_embedding(features, scales):
    """anomalib-style: upsample every layer fully, concatenate, then reduce."""
    upsampled = [
        F.interpolate(f, scale_factor=s, mode="nearest") if s > 1 else f for f, s in zip(features, scales, strict=True)
    ]
    return torch.cat(upsampled, dim=1)


def test_random_subset_equals_select_after_concatenation():
    spec = BACKBONES["resnet18"]
    emb = Embedding.create(spec, LAYERS, embedding_dim=100, reduction="random", seed=5)
    feats = [
        torch.randn(2, c, 16 // (s // 4), 16 // (s // 4))
        for c, s in zip(spec.channels[:3], spec.strides[:3], strict=True)
    ]
    full = naive_embedding(feats, emb.scales)
    assert full.shape[1] == 448
    torch.testing.assert_close(emb(feats), full.index_select(1, emb.channel_index))
    again = Embedding.create(spec, LAYERS, embedding_dim=100, reduction="random", seed=5)
    assert torch.equal(again.channel_index, emb.channel_index)


def test_semi_orthogonal_projection_equals_projection_after_concatenation():
    spec = BACKBONES["resnet18"]
    emb = Embedding.create(spec, LAYERS, embedding_dim=30, reduction="semi_orthogonal", seed=2)
    w = emb.projection
    torch.testing.assert_close(w.T @ w, torch.eye(30), atol=1e-5, rtol=0)
    feats = [
        torch.randn(2, c, 16 // (s // 4), 16 // (s // 4))
        for c, s in zip(spec.channels[:3], spec.strides[:3], strict=True)
    ]
    full = naive_embedding(feats, emb.scales)
    expected = torch.einsum("bchw,cd->bdhw", full, w)
    torch.testing.assert_close(emb(feats), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("reduction", ["random", "semi_orthogonal"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_the_embedding_with_its_channels_last_bit_for_bit(reduction, k, layout, dtype):
    """What the statistics read (``rows``: written straight into ``(B, H W, D)``) is the upsampled, joined embedding
    transposed, to the bit: the int8 backbone's maps come NCHW, the float32 backbone's channels last."""
    spec = BACKBONES["resnet18"]
    emb = Embedding.create(spec, LAYERS, embedding_dim=60, reduction=reduction, seed=3, neighbourhood=k)
    g = torch.Generator().manual_seed(7)
    feats = [
        torch.randn(3, c, 16 // (s // 4), 12 // (s // 4), generator=g).to(dtype)
        for c, s in zip(spec.channels[:3], spec.strides[:3], strict=True)
    ]
    if layout == "channels_last":
        feats = [f.contiguous(memory_format=torch.channels_last) for f in feats]
    expected = emb(feats).permute(0, 2, 3, 1).reshape(3, 16 * 12, 60)
    got = emb.rows(feats)
    assert got.shape == (3, 16 * 12, 60) and got.dtype == dtype
    assert got.is_contiguous() or reduction == "semi_orthogonal"  # a subset is written in place, one pass
    assert torch.equal(got, expected)
    # a layer that keeps none of its channels, and the deepest layer's 4x4 blocks: each channel of each block
    only = Embedding.for_layers(spec, LAYERS, channel_index=torch.tensor([64, 65, 200, 447]))
    rows = only.rows(feats).reshape(3, 16, 12, 4)
    assert torch.equal(rows[:, 5, 7, 3], feats[2][:, 255, 1, 1]) and torch.equal(rows[:, 3, 2, 0], feats[1][:, 0, 1, 1])


def neighbour_mean(x: np.ndarray, k: int) -> np.ndarray:
    """``(B, C, H, W)`` averaged over the ``k x k`` neighbours inside the grid (scipy, float64)."""
    window = (1, 1, k, k)
    total = uniform_filter(x, size=window, mode="constant", cval=0.0)
    inside = uniform_filter(np.ones_like(x), size=window, mode="constant", cval=0.0)
    return total / inside


@pytest.mark.parametrize("reduction", ["random", "semi_orthogonal"])
@pytest.mark.parametrize("k", [3, 5])
def test_neighbourhood_averages_each_layer_on_its_own_grid_then_reduces(reduction, k):
    spec = BACKBONES["resnet18"]
    emb = Embedding.create(spec, LAYERS, embedding_dim=40, reduction=reduction, seed=1, neighbourhood=k)
    assert emb.neighbourhood == k
    g = torch.Generator().manual_seed(4)
    feats = [
        torch.randn(2, c, 16 // (s // 4), 16 // (s // 4), generator=g, dtype=torch.float64)
        for c, s in zip(spec.channels[:3], spec.strides[:3], strict=True)
    ]
    # the reference: average every full layer (scipy), upsample, concatenate, then reduce
    averaged = [torch.from_numpy(neighbour_mean(f.numpy(), k)) for f in feats]
    full = naive_embedding(averaged, emb.scales)
    expected = (
        full.index_select(1, emb.channel_index)
        if reduction == "random"
        else torch.einsum("bchw,cd->bdhw", full, emb.projection.double())
    )
    got = emb([f.float() for f in feats]).double()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    plain = Embedding.create(spec, LAYERS, embedding_dim=40, reduction=reduction, seed=1)
    assert not torch.allclose(plain([f.float() for f in feats]), got.float(), atol=1e-3)
    assert not plain.same_reduction(emb) and emb.same_reduction(
        Embedding.create(spec, LAYERS, embedding_dim=40, reduction=reduction, seed=1, neighbourhood=k)
    )


@pytest.mark.parametrize("k", [0, 2, 4])
def test_neighbourhood_must_be_odd_and_positive(k):
    with pytest.raises(ValueError, match="odd number"):
        Embedding.create(BACKBONES["resnet18"], LAYERS, embedding_dim=10, reduction="random", seed=0, neighbourhood=k)


def test_a_backbone_is_traced_alone_while_batches_and_exports_share_the_lock():
    """torch.fx patches nn.Module.__call__ for the whole process while it traces: a forward on another thread then
    fails. Batches (and exports) hold TRACING shared, side by side; a trace waits for them and holds it alone, and
    a batch that comes while a trace waits goes after it."""
    import threading
    import time

    from padim.models.features.embedding import TRACING, SharedOrAlone

    lock, order, held = SharedOrAlone(), [], []

    def take(how, name: str) -> None:
        held.append(how)  # kept: a context manager collected unclosed would let go
        how.__enter__()
        order.append(name)

    first, second = lock.shared(), lock.shared()
    first.__enter__(), second.__enter__()  # two at once
    tracer = threading.Thread(target=take, args=(lock.alone(), "alone"))
    tracer.start()
    time.sleep(0.1)
    late = threading.Thread(target=take, args=(lock.shared(), "late batch"))
    late.start()
    time.sleep(0.1)
    assert order == []  # the trace waits for both holders, the late batch for the waiting trace
    first.__exit__(None, None, None), second.__exit__(None, None, None)
    tracer.join(5)
    time.sleep(0.1)
    assert order == ["alone"]  # and the late batch waits until it is done
    held[0].__exit__(None, None, None)
    late.join(5)
    assert order == ["alone", "late batch"]

    # the real thing: traces of a backbone on one thread, batches of another extractor on two others
    backbone, _ = build_backbone("resnet18", "random", seed=0)
    scoring = FeatureExtractor(build_backbone("resnet18", "random", seed=1)[0], ("layer1",))
    errors, stop = [], threading.Event()

    def batches():
        while not stop.is_set():
            try:
                with TRACING.shared():
                    scoring(torch.zeros(1, 3, 32, 32))
            except Exception as error:  # noqa: BLE001 - what a scoring thread would have answered 500 for
                errors.append(error)

    threads = [threading.Thread(target=batches) for _ in range(2)]
    for thread in threads:
        thread.start()
    for _ in range(6):
        FeatureExtractor(backbone, ("layer1", "layer2"))
    stop.set()
    for thread in threads:
        thread.join(10)
    assert errors == []
