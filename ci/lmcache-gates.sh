#!/usr/bin/env bash
# The LMCache gates of the CPU e2e (v0.32.0; the decode instance runs
# MultiConnector[LMCacheMP, NIXL] with its own tool-started `lmcache server`):
#   1. the correctness scenario with the patched vLLM and the patched lmcache: every
#      output equals the single instance's, the decode instance takes its local prefix
#      hit and LMCache serves it a hit (request L2);
#   2. lmcache built without cpu-shm-vllm-state-binding must go red. Without it the
#      registration leaves vLLM's Mamba tensors on their private storage and moves the
#      rest into shared memory: the KV cache is split over two storages, NIXL
#      (registered after LMCache) counts two memory regions where the prefill instance
#      has one, and the decode instance dies at the first remote prefill
#      (`assert len(nixl_agent_meta.kv_caches_base_addr) == len(local_regions)`);
#   3. lmcache built without null-recurrent-slot-not-stored must go red on request N2:
#      LMCache serves it a chunk whose Mamba state is vLLM's null block.
# Not [NIXL, LMCacheMP] on CPU yet: LMCache's CPU registration moves the KV cache that
# NIXL registered first, so every remote prefill decodes garbage (a known issue,
# tests/lmcache_patches/test_registered_memory.py; README).
#
# Usage: ci/lmcache-gates.sh HYBRIDPD OUT_DIR
set -euo pipefail

hpd="$1"
out="$2"
mkdir -p "$out"
e2e=(e2e --pin 0.32.0 --device cpu --tiny --scenario correctness
     --role kv_producer/kv_consumer --max-model-len 1024 --expect-patched-hit)

"$hpd" "${e2e[@]}" --connector lmcache+nixl --out "$out/patched"

must_fail() {  # must_fail PATCH_ID FILE TEXT: red, and FILE holds TEXT (FILE: "stderr",
               # the command's, or a path under the run's --out)
  local without="$1" file="$2" text="$3" dir="$out/without-$1"
  set +e
  "$hpd" "${e2e[@]}" --connector lmcache+nixl --lmcache-without "$without" \
    --out "$dir" 2>"$dir.stderr"
  local rc=$?
  set -e
  cat "$dir.stderr" >&2
  [ "$file" = stderr ] && file="$dir.stderr" || file="$dir/$file"
  if [ "$rc" = 1 ] && grep -qF -- "$text" "$file"; then
    echo "lmcache gates: red without $without, as it must be ($text)"
  else
    echo "lmcache gates: without $without the gate did not go red as expected (exit $rc)" >&2
    exit 1
  fi
}
must_fail cpu-shm-vllm-state-binding "patched-lmcache+nixl/decode.log" \
  "assert len(nixl_agent_meta.kv_caches_base_addr) == len(local_regions)"
must_fail null-recurrent-slot-not-stored stderr "FAILED: patched / lmcache+nixl: N2 "
