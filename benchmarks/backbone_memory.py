"""The backbone's activation memory in a fit, per family: what the memory plan's ``activation_factor`` is.

For each backbone (default: one of each family), in a process of its own: the feature extractor of its default
stages as a fit builds it (BatchNorms folded, channels_last, inference mode), one warm-up batch of 1, then the
resident memory's growth over one batch of ``--batch-size`` pictures of ``--image-size`` pixels. Printed per input
pixel and as a factor over the bytes of the family's stem and stages outputs (the plan's formula,
padim.models.fit.memory_plan), beside the factor the table (padim.models.families) declares.

    python benchmarks/backbone_memory.py                       # resnet18 wide_resnet50_2 vgg16 efficientnet_b0 ...
    python benchmarks/backbone_memory.py vgg19_bn efficientnet_b5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

DEFAULT = ("resnet18", "wide_resnet50_2", "vgg16", "efficientnet_b0", "efficientnet_b5", "mobilenet_v3_large",
           "convnext_tiny")  # fmt: skip

CHILD = """
import json, resource, sys
import psutil, torch
from padim.models.families import BACKBONES
from padim.models.features.backbones import build_backbone
from padim.models.features.embedding import FeatureExtractor
name, size, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
spec = BACKBONES[name]
torch.set_num_threads(2)
extractor = FeatureExtractor(build_backbone(name, "random")[0], spec.default_stages)
images = torch.randn(batch, 3, size, size)
extractor(images[:1])
before = psutil.Process().memory_info().rss
extractor(images)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"grown": peak - before}))
"""


def formula(name: str) -> float:
    """Bytes per input pixel of the stem's and the stages' outputs up to the deepest default stage (float32)."""
    from padim.models.families import BACKBONES

    spec = BACKBONES[name]
    deepest = max(spec.stages.index(s) for s in spec.default_stages)
    outputs = [*spec.stem, *zip(spec.channels[: deepest + 1], spec.strides, strict=False)]
    return 4 * sum(c / s**2 for c, s in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("backbones", nargs="*", default=DEFAULT)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="processes per backbone (the median is printed)")
    args = parser.parse_args()
    from padim.models.families import BACKBONES

    rows = []
    for name in args.backbones:
        grown = sorted(
            json.loads(
                subprocess.run(
                    [sys.executable, "-c", CHILD, name, str(args.image_size), str(args.batch_size)],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )["grown"]
            for _ in range(args.repeats)
        )[args.repeats // 2]
        per_pixel = grown / (args.batch_size * args.image_size**2)
        row = {
            "backbone": name,
            "bytes_per_input_pixel": round(per_pixel, 1),
            "outputs_bytes_per_input_pixel": round(formula(name), 1),
            "measured_factor": round(per_pixel / formula(name), 2),
            "declared_factor": BACKBONES[name].activation_factor,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
