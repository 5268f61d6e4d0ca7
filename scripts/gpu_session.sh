#!/usr/bin/env bash
# Everything a GPU session needs in one device call: judge and time the given solutions on every workload (traces
# land in traces/ and are copied to $OUT with the logs), then run the GPU-only tests (timing, cheats, deployment form).
#   bash scripts/gpu_session.sh --solution torch_v1 --solution triton_v1
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m harness.run --device cuda "$@" 2>&1 | tee "$OUT/run.log"
status=$?
cp -r traces "$OUT/" 2>/dev/null
python3 -m pytest -q -p no:cacheprovider tests/test_timing.py tests/test_deployment.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
exit $status
