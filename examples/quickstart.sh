#!/usr/bin/env bash
# Offline quick start: generate a small textured data set with synthetic defects, fit a
# detector with RANDOM (seeded, demo-only) backbone weights, score the test images and
# evaluate. Everything lands in ./demo/. Real use: --weights imagenet (see README).
set -euo pipefail
out=${1:-demo}
mkdir -p "$out"
padim -q synth "$out/data" --categories weave --train 40 --test-good 8 --test-defect 4 --size 256
padim -q train "$out/data/weave/train/good" --output "$out/weave.padim" --config configs/demo.yaml
padim -q predict "$out/weave.padim" "$out/data/weave/test" --output "$out/predictions"
padim -q evaluate "$out/weave.padim" "$out/data/weave" --output "$out/evaluation.json" > /dev/null
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/predictions/results.jsonl")]
ev = json.load(open(f"{out}/evaluation.json"))
print(f"DEMO with {rows[0]['weights']}")
for r in rows[:1] + [r for r in rows if "/good/" not in r["path"]][:1]:
    print(f"  {r['path']}: score {r['score']:.3f} (raw {r['raw_score']:.2f}), anomaly={r['is_anomaly']}")
print(f"  {len(rows)} test images: image AUROC {ev['image_auroc']:.3f}, pixel AUROC {ev['pixel_auroc']:.3f}, "
      f"PRO {ev['pro_0.3']:.3f}, F1 at threshold {ev['f1_at_threshold']:.3f}")
print(f"  heat maps: {out}/predictions/heatmaps/, metrics: {out}/evaluation.json")
PY
