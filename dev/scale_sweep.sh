#!/usr/bin/env bash
# A sweep for a machine with many cores: the benchmark's scaling tables and the
# instruments in dev/ that explain them, each part's output kept in a folder.
#
#   bash dev/scale_sweep.sh [part ...]        (no part named: t1 t2 idle probe)
#
# Run it from the repository root with shmvec built (python setup.py build_ext
# --inplace, or an install of this checkout) and the `bench` extra installed;
# the `atari` extra for the Pong workloads and EnvPool, PufferLib and torch for
# the parts that compare with them (the benchmark skips what is not installed).
#
# Parts:
#   t1       shmvec-bench: cpu100us, cartpole, pong at 16, 64, 256 envs; shmvec's
#            sync, step-in-main and async modes, gymnasium Async, EnvPool, one env
#   t2       shmvec-bench: the same workloads at 60 and 240 envs against PufferLib, EnvPool
#   idle     tests/test_idle.py: idle workers and main use no CPU
#   probe    dev/scale_probe.py: busy, CPU and run-queue time per round; the all-core ceiling
#   trace    dev/round_trace.py: where a sync round's time goes, from timestamps
#   turn     dev/main_turn.py: main's own turn per sync round, in parts
#   leases   dev/ab.py: lent observations against copies and copy=False views
#   oversub  dev/ab.py: 2x and 4x as many unpinned workers as CPUs, Pong x64 and cpu100us x64
#   handoff  shmvec-bench --workloads handoff --device cuda: the GPU hand-off per step
#   torch    tests/test_torch.py
#   ppo      examples/ppo_atari.py, 64 envs, 8 iterations: shmvec against gymnasium
#            Async and EnvPool, then --async-envs
#
# Writes <part>.log (and <part>.csv for the benchmark's parts) and machine.txt
# (lscpu, and nvidia-smi -L where there is a GPU) to $OUT, by default ./scale-out.
# SECONDS_PER sets the benchmark's timed window per measurement (default 1.0).
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-scale-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
B="$PY -m shmvec_bench --seconds ${SECONDS_PER:-1.0} --warmup 0.5 --timeout 60"
ALE_BANNER="A.L.E\|Stella"  # ale-py's start-up banner, one per env
lscpu > "$OUT/machine.txt" 2>&1
command -v nvidia-smi > /dev/null && nvidia-smi -L >> "$OUT/machine.txt" 2>&1
bench() {  # name, time limit (s), benchmark arguments...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" $B "$@" --out "$OUT/$name" 2>&1 | tee "$OUT/$name.log"
  cp "$OUT/$name/results.csv" "$OUT/$name.csv" 2> /dev/null
  cp "$OUT/$name/handoff.csv" "$OUT/$name.csv" 2> /dev/null
}
quiet() {  # name, time limit (s), command...: the command's output less ale-py's banners
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" 2>&1 | grep -v "$ALE_BANNER" | tee "$OUT/$name.log"
}
for part in "${@:-t1 t2 idle probe}"; do
  for t in $part; do
    case $t in
      t1) bench t1 330 --workloads cpu100us cartpole pong --num-envs 16 64 256 \
            --backends shmvec shmvec-main shmvec-async async envpool envpool-async single ;;
      t2) bench t2 200 --workloads cpu100us cartpole pong --num-envs 60 240 \
            --backends shmvec shmvec-main shmvec-async pufferlib envpool single ;;
      idle) quiet idle 120 "$PY" -m pytest -q tests/test_idle.py ;;
      probe) quiet probe 200 "$PY" dev/scale_probe.py ;;
      trace) quiet trace 200 "$PY" dev/round_trace.py ;;
      turn) quiet turn 100 "$PY" dev/main_turn.py ;;
      leases) quiet leases 240 "$PY" dev/ab.py --variants default copied views \
                --cases pong-64 pong-64-async largeobs-16 largeobs-16-async ;;
      oversub) quiet oversub 240 "$PY" dev/ab.py --variants default workers2x workers4x \
                 --cases pong-64 cpu100us-64 ;;
      handoff) bench handoff 150 --workloads handoff --device cuda ;;
      torch) quiet torch 150 "$PY" -m pytest -q tests/test_torch.py ;;
      ppo)
        P=("$PY" examples/ppo_atari.py --num-envs 64 --total-timesteps 65536)
        quiet ppo 250 bash -c "timeout 150 ${P[*]} --vector shmvec,gymnasium-async,envpool; \
          timeout 100 ${P[*]} --async-envs --vector shmvec,envpool" ;;
      *) echo "unknown part '$t' (parts: t1 t2 idle probe trace turn leases oversub handoff torch ppo)" >&2
         exit 2 ;;
    esac
  done
done
