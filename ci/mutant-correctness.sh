#!/usr/bin/env bash
# The e2e correctness gate must be able to fail: run it on a mutant of the patched
# v0.32.0 build whose scheduler neither caps a divergent hybrid hit below NIXL's load
# target nor reconciles it when nothing is loaded, so a request whose local attention
# hit has no Mamba state behind it (request C: a cached block-aligned prefix + 1 token;
# patched, NIXL pulls the last block and the state) resumes from a missing state.
# Passes only if the gate goes red on request C. `--fail-fast` ends the run there (the
# concurrent requests and the teacher-forced scoring after it cannot turn it green).
#
# Usage: ci/mutant-correctness.sh HYBRIDPD OUT_DIR [CONNECTOR [SPECULATIVE_CONFIG]] (after
# a correctness run of CONNECTOR, default nixl, which prepared the patched environment;
# for an LMCache set, run it while that environment holds the patched lmcache:
# ci/lmcache-gates.sh does). SPECULATIVE_CONFIG: vLLM's --speculative-config for both
# instances. With MTP, request C's hit drops its last matched block and NIXL loads the
# state from there, so this mutant answers right (measured, N = 3): not a gate there.
set -euo pipefail

hpd="$1"
out="$2"
connector="${3:-nixl}"
speculative=()
[ -z "${4:-}" ] || speculative=(--speculative-config "$4")
case "$connector" in *lmcache*) env=0.32.0-cpu-patched+lmcache ;; *) env=0.32.0-cpu-patched ;; esac
mkdir -p "$(dirname "$out")"
cache="${HYBRIDPD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hybridpd}"
patched="$cache/e2e/$env/venv"
mutant="$cache/e2e/${env/patched/mutant}/venv"
[ -x "$patched/bin/python" ] || { echo "mutant: no patched environment at $patched" >&2; exit 1; }

rm -rf "$(dirname "$mutant")"
mkdir -p "$(dirname "$mutant")"
trap 'rm -rf "$(dirname "$mutant")"' EXIT
cp -al "$patched" "$mutant"  # hard links: the edit below replaces one file only
sched=$(echo "$mutant"/lib/python3.*/site-packages/vllm/v1/core/sched/scheduler.py)
mutate() {  # mutate WHAT LINE: prefix the condition of LINE (exact) with "False and"
  local what="$1" line="$2"
  grep -qxF "$line" "$sched" || { echo "mutant: $what not found in $sched" >&2; exit 1; }
  sed -i "s/^$line\$/${line/if /if False and }/" "$sched"
}
mutate "the cap below the load target" '        if hit_diverged and num_local >= resume_point:'
mutate "the reconciliation" '                        if hit_diverged and not ('

set +e
"$hpd" e2e --pin 0.32.0 --device cpu --tiny --scenario correctness \
  --role kv_producer/kv_consumer --connector "$connector" --max-model-len 1024 \
  --patched-venv "$mutant" --expect-patched-hit --fail-fast "${speculative[@]}" \
  --out "$out" 2>"$out.stderr"
rc=$?
set -e
cat "$out.stderr" >&2
expected="FAILED: patched / $connector: C A's prefix + 1 token differs from the single-instance reference"
if [ "$rc" = 1 ] && grep -qF "$expected" "$out.stderr"; then
  echo "mutant: the correctness gate is red on the mutant, as it must be"
else
  echo "mutant: the correctness gate did not catch a resume without the Mamba state (exit $rc)" >&2
  exit 1
fi
