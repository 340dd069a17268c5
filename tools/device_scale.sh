#!/usr/bin/env bash
# The 16-core sweep of issue 13, for the device machine (see the README's "Figures"):
#   bash .benchkit/run.sh bash tools/device_scale.sh [part ...]
# Parts: t1, t2 (issue 13's two tables), idle (tests/test_idle.py), probe (tools/scale_probe.py),
# trace (tools/round_trace.py), turn (tools/main_turn.py: main's own turn per sync round, in
# parts), leases (tools/ab.py: lent observations against copies and views), oversub (tools/ab.py:
# 2x and 4x as many unpinned workers as CPUs against the default, Pong x64 and cpu100us x64),
# handoff (the CUDA hand-off bench), torch (tests/test_torch.py), ppo (examples/ppo_atari.py,
# 64 envs, 8 iterations, sync against gymnasium Async and EnvPool, then --async-envs).
# Writes $OUT/<part>.csv and $OUT/<part>.log (or ./device-out without $OUT), plus
# machine.txt. The device returns at most 8 files a call: t1, t2 and handoff write 2
# each, the other parts 1, so ask for few parts per call.
set -o pipefail
OUT=${OUT:-device-out}; mkdir -p "$OUT"
B="python3 -m shmvec_bench --seconds ${SECONDS_PER:-1.0} --warmup 0.5 --timeout 60"
lscpu > "$OUT/machine.txt" 2>&1; nvidia-smi -L >> "$OUT/machine.txt" 2>&1
run() {  # name, time limit (s), bench arguments...
  local name=$1 limit=$2; shift 2
  timeout "$limit" $B "$@" --out "/tmp/$name" 2>&1 | tee "$OUT/$name.log"
  cp "/tmp/$name/results.csv" "$OUT/$name.csv" 2>/dev/null
}
for t in ${@:-t1 t2 idle probe}; do
  case $t in
    t1) run t1 330 --workloads cpu100us cartpole pong --num-envs 16 64 256 \
          --backends shmvec shmvec-main shmvec-async async envpool envpool-async single ;;
    t2) run t2 200 --workloads cpu100us cartpole pong --num-envs 60 240 \
          --backends shmvec shmvec-main shmvec-async pufferlib envpool single ;;
    idle) timeout 120 python3 -m pytest -q tests/test_idle.py 2>&1 | tee "$OUT/idle.log" ;;
    probe) timeout 200 python3 tools/scale_probe.py 2>&1 | tee "$OUT/probe.log" ;;
    trace) timeout 200 python3 tools/round_trace.py 2>&1 | grep -v "A.L.E\|Stella" | tee "$OUT/trace.log" ;;
    turn) timeout 100 python3 tools/main_turn.py 2>&1 | grep -v "A.L.E\|Stella" | tee "$OUT/turn.log" ;;
    leases) timeout 240 python3 tools/ab.py --variants default copied views --cases pong-64 \
              pong-64-async largeobs-16 largeobs-16-async 2>&1 | grep -v "A.L.E\|Stella" \
              | tee "$OUT/leases.log" ;;
    oversub) timeout 240 python3 tools/ab.py --variants default workers2x workers4x --cases pong-64 \
               cpu100us-64 2>&1 | grep -v "A.L.E\|Stella" | tee "$OUT/oversub.log" ;;
    handoff) run handoff 150 --workloads handoff --device cuda ;;
    torch) timeout 150 python3 -m pytest -q tests/test_torch.py 2>&1 | tee "$OUT/torch.log" ;;
    ppo) P="python3 examples/ppo_atari.py --num-envs 64 --total-timesteps 65536"
         { timeout 150 $P --vector shmvec,gymnasium-async,envpool
           timeout 100 $P --async-envs --vector shmvec,envpool; } 2>&1 | grep -v Warning | tee "$OUT/ppo.log" ;;
  esac
done
