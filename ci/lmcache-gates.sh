#!/usr/bin/env bash
# The LMCache gates of the CPU e2e (v0.32.0; the decode instance runs a MultiConnector of
# NIXL and LMCacheMP, in both child orders, with its own tool-started `lmcache server`):
#   1. the correctness scenario with the patched vLLM and the patched lmcache, in both
#      orders ([LMCacheMP, NIXL] and vllm#42524's [NIXL, LMCacheMP]): every output equals
#      the single instance's, the decode instance takes its local prefix hit and
#      LMCache serves it a hit (request L2); [LMCacheMP, NIXL] with Qwen3.5's
#      single-module MTP drafting 3 tokens on both instances (and the reference), the
#      configuration Qwen3.5 is deployed with (the tiny model's MTP module: drafts
#      accepted at a rate of 0.2..0.8, or the run fails);
#   2. the correctness gate on a mutant of the patched vLLM build that resumes without
#      the Mamba state (ci/mutant-correctness.sh) goes red on [LMCacheMP, NIXL] (without
#      MTP: with it, request C's divergence does not arise), the order where the
#      series' decode-side decision runs on LMCache's loads too;
#   --full also runs the rest of the MTP matrix: 1 and 3 speculative tokens for nixl,
#   nixl+lmcache and lmcache+nixl (each output checked as in 1.);
#   3.-5. with --full only (each of those lmcache patches has its red->green patch test in
#      every CI run, `hybridpd --series patches/lmcache test`; these runs show the same bugs
#      in a served PD pair, and only change outcome with the LMCache pin or its series):
#   3. [NIXL, LMCacheMP] with lmcache built without cpu-shm-kv-cache-allocation (and
#      cpu-hybrid-transfer-mode, which builds on it; the run names the LMCache-driven
#      transfer mode that patch picks, LMCACHE_MP_TRANSFER_MODE) must go red:
#      LMCache's CPU registration moves the KV cache NIXL registered first, and every
#      remote prefill decodes garbage (request A, the first one);
#   4. the same lmcache in [LMCacheMP, NIXL] (NIXL registers after LMCache) must go
#      red too: the registration leaves vLLM's Mamba tensors on their private storage
#      and moves the rest into shared memory, so the KV cache is split over two
#      storages, NIXL counts two memory regions where the prefill instance has one,
#      and the decode instance dies at the first remote prefill
#      (`assert len(nixl_agent_meta.kv_caches_base_addr) == len(local_regions)`);
#   5. lmcache built without null-recurrent-slot-not-stored and
#      cpu-shm-exited-worker-segments (one run, each check fails on its own) must go red
#      twice: on request N2 (LMCache serves it a chunk whose Mamba state is vLLM's null
#      block), and on the decode worker's shared-memory segments, which its lmcache
#      server leaves in /dev/shm when it stops after vLLM (checked before hybridpd
#      removes them; patched, the server removes them);
#   6. `apply --installed` of the LMCache series on the index's lmcache 0.5.6 wheel (in a
#      hard-linked copy of the e2e venv): patched (the allocation patch's class imports),
#      then reverted byte for byte (pip's RECORD hashes check every file).
#
# Usage: ci/lmcache-gates.sh [--full] HYBRIDPD OUT_DIR
set -euo pipefail

full=0
if [ "${1:-}" = --full ]; then full=1; shift; fi
[ $# = 2 ] || { echo "usage: ci/lmcache-gates.sh [--full] HYBRIDPD OUT_DIR" >&2; exit 2; }
hpd="$1"
out="$2"
mkdir -p "$out"
e2e=(e2e --pin 0.32.0 --device cpu --tiny --scenario correctness
     --role kv_producer/kv_consumer --max-model-len 1024 --expect-patched-hit)

mtp() { echo "{\"method\":\"mtp\",\"num_speculative_tokens\":$1}"; }
"$hpd" "${e2e[@]}" --connector lmcache+nixl --speculative-config "$(mtp 3)" --out "$out/patched"
"$hpd" "${e2e[@]}" --connector nixl+lmcache --out "$out/patched-nixl-first"
# While the e2e venv holds the patched lmcache (the runs below rebuild it without patches).
# Without MTP: with it, request C's hit (A's prefix + 1 token) drops its last matched
# block for the draft, NIXL loads the state from there, and the mutant resumes right
# (measured: C equal, local hit 384 + NIXL 128); the mutant needs another request then.
bash "$(dirname "$0")/mutant-correctness.sh" "$hpd" "$out/mutant" lmcache+nixl
if [ "$full" = 1 ]; then
  for n in 1 3; do
    for connector in nixl nixl+lmcache lmcache+nixl; do
      [ "$connector/$n" = lmcache+nixl/3 ] && continue  # the gate above
      "$hpd" "${e2e[@]}" --connector "$connector" --speculative-config "$(mtp "$n")" \
        --out "$out/mtp$n-$connector"
    done
  done
fi

must_fail() {  # must_fail CONNECTOR WITHOUT FILE TEXT...: red, and FILE holds each TEXT
               # (FILE: "stderr", the command's, or a path under the run's --out);
               # WITHOUT: the LMCache patches left out, comma-separated
  local connector="$1" file="$3" dir="$out/without-${2//,/+}"
  local texts=("${@:4}")
  local without=()
  IFS=, read -ra ids <<<"$2"
  for id in "${ids[@]}"; do without+=(--lmcache-without "$id"); done
  set +e
  "$hpd" "${e2e[@]}" --connector "$connector" "${without[@]}" --out "$dir" 2>"$dir.stderr"
  local rc=$?
  set -e
  cat "$dir.stderr" >&2
  [ "$file" = stderr ] && file="$dir.stderr" || file="$dir/$file"
  local text missing=""
  for text in "${texts[@]}"; do
    grep -qF -- "$text" "$file" || missing="$text"
  done
  if [ "$rc" = 1 ] && [ -z "$missing" ]; then
    echo "lmcache gates: $connector red without $2, as it must be (${texts[*]})"
  else
    echo "lmcache gates: $connector without $2 did not go red as expected (exit $rc${missing:+; not found: $missing})" >&2
    exit 1
  fi
}
if [ "$full" = 1 ]; then
# cpu-hybrid-transfer-mode builds on cpu-shm-kv-cache-allocation (resolve_transfer_mode):
# a run without the allocation patch leaves it out too, and names the mode it picks.
LMCACHE_MP_TRANSFER_MODE=lmcache_driven \
must_fail nixl+lmcache cpu-shm-kv-cache-allocation,cpu-hybrid-transfer-mode stderr \
  "FAILED: patched / nixl+lmcache: A "
LMCACHE_MP_TRANSFER_MODE=lmcache_driven \
must_fail lmcache+nixl cpu-shm-kv-cache-allocation,cpu-hybrid-transfer-mode \
  "patched-lmcache+nixl/decode.log" \
  "assert len(nixl_agent_meta.kv_caches_base_addr) == len(local_regions)"
# One run for two patches (each check fails on its own; no run more for CI's budget).
must_fail lmcache+nixl null-recurrent-slot-not-stored,cpu-shm-exited-worker-segments stderr \
  "FAILED: patched / lmcache+nixl: N2 " \
  "FAILED: patched / lmcache+nixl: the lmcache server left the stopped decode instance's shared-memory segments behind"
fi

# 6. apply --installed on the released lmcache wheel.
cache="${HYBRIDPD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hybridpd}"
venv="$out/installed-venv"
rm -rf "$venv"
cp -al "$cache/e2e/0.32.0-cpu-patched+lmcache/venv" "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --force-reinstall --no-deps lmcache==0.5.6
probe='import lmcache.v1.platform.devices.cpu.shm as s; print(hasattr(s, "ShmAllocationMode"))'
"$hpd" --series patches/lmcache apply --installed --python "$py"
[ "$("$py" -c "$probe" 2>/dev/null | tail -1)" = True ] \
  || { echo "lmcache gates: apply --installed did not patch lmcache" >&2; exit 1; }
"$hpd" --series patches/lmcache apply --installed --revert --python "$py"
[ "$("$py" -c "$probe" 2>/dev/null | tail -1)" = False ] \
  || { echo "lmcache gates: apply --installed --revert left lmcache patched" >&2; exit 1; }
"$py" - <<'PY'
import base64, hashlib, sys
from importlib.metadata import distribution
dist = distribution("lmcache")
bad = []
for f in dist.files:
    if f.hash is None or not str(f).startswith("lmcache/"):
        continue
    data = f.locate().read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.new(f.hash.mode, data).digest()).rstrip(b"=").decode()
    if digest != f.hash.value:
        bad.append(str(f))
if bad:
    sys.exit(f"lmcache gates: after --revert {len(bad)} file(s) differ from the wheel's RECORD: {bad[:3]}")
print("lmcache gates: apply --installed patched lmcache 0.5.6 and --revert restored every file")
PY
rm -rf "$venv"
