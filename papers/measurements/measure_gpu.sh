#!/usr/bin/env bash
# Measure mhanum's attention, jax.nn.dot_product_attention (xla, cudnn) and the tensor-core probes
# on the GPU of this machine; write the records to the folder given as $1 (default: here).
# Run from the repository root on a machine with a CUDA build of JAX: bash papers/measurements/measure_gpu.sh OUT
set -euo pipefail
out=${1:-papers/measurements}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu-nvidia-smi.csv"
python3 -m mhanum.cli measure --grid gpu --backend gpu --workers "$(nproc)" --out "$out/h100-records.jsonl"
python3 -m mhanum.cli check "$out/h100-records.jsonl" > "$out/h100-check.txt" || true
python3 - "$out" <<'PY'
import json, sys
import jax
jax.config.update("jax_enable_x64", True)
from mhanum import tensorcore
results = tensorcore.run_probes("gpu")
device = jax.devices("gpu")[0]
doc = {
    "device_kind": device.device_kind,
    "jax": jax.__version__,
    "matching_models": tensorcore.matching_models(results),
    "probes": results,
}
with open(f"{sys.argv[1]}/h100-probes.json", "w") as f:
    json.dump(doc, f, indent=1, default=str)
print("probes:", len(results), "matching models:", doc["matching_models"])
PY
