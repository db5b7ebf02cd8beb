#!/usr/bin/env bash
# Offline quick start, end to end: generate a small textured data set with synthetic defects,
# fit a detector with RANDOM (seeded, demo-only) backbone weights, start the HTTP service,
# score one good and one defective image over HTTP, print both answers, stop the service.
# Everything lands in ./demo/ (or the folder given as $1). Real use: --weights imagenet (docs/training.md).
set -euo pipefail
out=${1:-demo}
port=${PADIM_DEMO_PORT:-8765}
mkdir -p "$out"
echo "1/4 generating demo data in $out/data ..."
padim -q synth "$out/data" --categories weave --train 40 --test-good 8 --test-defect 4 --size 256 > /dev/null
echo "2/4 training on $out/data/weave/train/good (RANDOM weights: demo only) ..."
padim -q train "$out/data/weave/train/good" --output "$out/weave.padim" --config demo > /dev/null
echo "3/4 starting padim serve on 127.0.0.1:$port ..."
padim serve "$out/weave.padim" --port "$port" --log-level warning 2> "$out/server.log" &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  padim health --url "http://127.0.0.1:$port/health/ready" 2> /dev/null && break
  kill -0 $server 2> /dev/null || { echo "the server stopped; see $out/server.log"; exit 1; }
  sleep 0.5
done
echo "4/4 scoring one good and one defective image over HTTP:"
python3 - "$out" "$port" <<'PY'
import json, sys, urllib.request
out, port = sys.argv[1], sys.argv[2]
for label, path in (("good", f"{out}/data/weave/test/good/000.png"), ("defective (hole)", f"{out}/data/weave/test/hole/000.png")):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/score", data=open(path, "rb").read(),
                                     headers={"Content-Type": "image/png"}, method="POST")
    answer = json.load(urllib.request.urlopen(request))
    verdict = "ANOMALY" if answer["is_anomaly"] else "ok"
    print(f"  {label:17s} {path}: score {answer['score']:.3f} (raw {answer['raw_score']:.2f}), "
          f"{verdict}, anomalous area {answer['anomalous_area']:.1%}, {answer['latency_ms']:.0f} ms")
print(f"  model: {answer['model']['name']}, {answer['model']['weights']}")
PY
