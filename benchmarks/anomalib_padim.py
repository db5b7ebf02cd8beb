"""anomalib's PaDiM torch model on the same data, weights and channels as padim's benchmark.

Run with the interpreter of a virtual environment that has anomalib (never imported by padim):

    /path/to/anomalib-venv/bin/python benchmarks/anomalib_padim.py --data DIR --weights W.pth \
        --channel-index idx.json

Prints one JSON line: throughput at batch 1 and the given batch size, fit time, image AUROC.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def to_input(paths, size):
    arrays = [np.asarray(Image.open(p).convert("RGB").resize((size, size), Image.BILINEAR), dtype=np.float32) for p in paths]
    batch = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) / 255.0
    return ((batch - MEAN) / STD).contiguous()


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--channel-index", type=Path, required=True)
    parser.add_argument("--train-list", type=Path, help="JSON list of training images (default: all of train/good)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    import anomalib
    from anomalib.models.image.padim.torch_model import PadimModel
    from sklearn.metrics import roc_auc_score

    model = PadimModel(backbone="resnet18", layers=["layer1", "layer2", "layer3"], pre_trained=False, n_features=100)
    state = torch.load(args.weights, map_location="cpu", weights_only=True)
    model.feature_extractor.feature_extractor.load_state_dict(state, strict=False)
    model.idx = torch.tensor(json.loads(args.channel_index.read_text()))
    model = model.to(args.device)

    train = (json.loads(args.train_list.read_text()) if args.train_list
             else sorted((args.data / "train" / "good").glob("*.png")))
    start = time.perf_counter()
    model.train()
    model.feature_extractor.eval()
    for i in range(0, len(train), args.batch_size):
        model(to_input(train[i : i + args.batch_size], args.image_size).to(args.device))
    model.fit()
    fit_seconds = time.perf_counter() - start
    model.eval()

    test = sorted(p for p in (args.data / "test").rglob("*.png"))
    labels = np.array([p.parent.name != "good" for p in test])
    scores = []
    with torch.no_grad():
        for i in range(0, len(test), args.batch_size):
            scores.append(model(to_input(test[i : i + args.batch_size], args.image_size).to(args.device)).pred_score.cpu())
        batch = to_input((test * args.batch_size)[: args.batch_size], args.image_size).to(args.device)
        total = timed(lambda: model(batch), args.repeats)
        single = timed(lambda: model(batch[:1]), args.repeats)
    print(json.dumps({
        "version": anomalib.__version__,
        "images_per_second_batch": args.batch_size / total,
        "images_per_second_batch1": 1 / single,
        "seconds_per_batch": total,
        "image_auroc": float(roc_auc_score(labels, torch.cat(scores).flatten().numpy())),
        "fit_seconds": fit_seconds,
    }))


if __name__ == "__main__":
    main()
