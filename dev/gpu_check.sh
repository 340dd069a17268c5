#!/usr/bin/env bash
# The checks that need a GPU machine, in one run sized to a short loan: the torch and CUDA
# tests, the GPU hand-off benchmark, Atari PPO against gymnasium Async and EnvPool (then
# shmvec's sync loop A/B'd: pinning, workers, TorchVectorEnv), the many-core sweep against
# gymnasium Async, EnvPool and PufferLib, and last the bridge's copy ways alternated with
# dev/handoff_probe.py --ab. Parts run in that order, each under its own time limit and all
# before END_AT (seconds since the epoch; default: 500 s from now), so that a slow start
# costs the last part, not the run.
#
#   bash dev/gpu_check.sh                      (with the `bench`, `atari` and `torch` extras,
#                                               EnvPool and PufferLib 2.0.2 installed)
#
# Writes each part's log and CSV, machine.txt and everything together as all.tgz to $OUT
# (default ./gpu-out).
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-gpu-out}
W=$(mktemp -d)
mkdir -p "$OUT"
PY=${PYTHON:-python3}
deadline=$((SECONDS + ${END_AT:-$(($(date +%s) + 500))} - $(date +%s)))
B="$PY -m shmvec_bench --seconds 0.6 --warmup 0.3 --timeout 40"
ALE_BANNER="A.L.E\|Stella"
{ lscpu; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'; } \
  > "$W/machine.txt" 2>&1
part() {  # name, time limit (s), command...: runs under the smaller of the limit and what is left
  local name=$1 limit=$2 left=$((deadline - SECONDS))
  shift 2
  ((left < limit)) && limit=$left
  ((limit < 5)) && { echo "== $name: skipped, no time left" | tee -a "$W/parts.txt"; return; }
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep -v "$ALE_BANNER" > "$W/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s (limit $limit s)" | tee -a "$W/parts.txt"
  tail -n 25 "$W/$name.log"
}
part tests 75 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_torch.py tests/test_start_method.py \
  "tests/test_bench.py::test_handoff_on_the_cpu"
part handoff 70 $B --workloads handoff --device cuda --seconds 1 --warmup 0.5 --out "$W/handoff"
P=("$PY" examples/ppo_atari.py --num-envs 64 --total-timesteps 32768)
part ppo-sync 90 "${P[@]}" --vector shmvec,gymnasium-async,envpool
part ppo-async 50 "${P[@]}" --async-envs --vector shmvec,envpool
# Where a sync-mode PPO loop's time goes on shmvec: its default (on 16 cores, 16 pinned
# workers, one on main's core) against unpinned workers, 15 workers, and the loop copying
# numpy results itself (no TorchVectorEnv), alternated; compare steady_steps_per_s.
part ppo-ab 130 bash -c "for round in 1 2; do
  for way in '' --no-pin-workers '--num-workers 15' --no-torch-env; do
  echo \"== round \$round: \${way:-default}\"; ${P[*]} --vector shmvec \$way; done; done"
part sweep 120 $B --workloads cpu100us cartpole pong --num-envs 64 256 \
  --backends shmvec shmvec-async async envpool single --out "$W/sweep"
part sweep-pufferlib 100 $B --workloads cpu100us cartpole pong --num-envs 60 240 \
  --backends shmvec shmvec-async pufferlib single --out "$W/sweep-pufferlib"
part handoff-ab 120 "$PY" dev/handoff_probe.py --ab --seconds 0.3 --rounds 3
for d in handoff sweep sweep-pufferlib; do
  cp "$W/$d/results.csv" "$W/$d.csv" 2> /dev/null
  cp "$W/$d/handoff.csv" "$W/$d.csv" 2> /dev/null
done
tar czf "$OUT/all.tgz" -C "$W" .
cp "$W/parts.txt" "$W/machine.txt" "$OUT/"
cat "$W/parts.txt"
