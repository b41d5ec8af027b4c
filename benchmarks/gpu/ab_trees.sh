#!/usr/bin/env bash
# Same-call A/B across commits on the device: host-bound figures move 15-20% between machines and runs,
# so commits are compared in one call. On this machine, `ab_trees.sh COMMIT...` writes each commit's
# tree (without docs/ and tests/) to ab/<commit>/ (git-ignored: pass carry ["ab", ...] to the device
# tool); on the device, `ab_trees.sh --run OUTDIR COMMIT...` runs serve_vs_offline.sh's server half
# (PROFILE=cpu) from each tree and from the working tree ("HEAD"), and prints one line each. API_SERVERS
# (one count, default 1) is passed on; trees older than --api-server-count support only 1.
set -u
cd "$(dirname "$0")/../.."
if [ "${1:-}" != "--run" ]; then
  for commit in "$@"; do
    rm -rf "ab/$commit" && mkdir -p "ab/$commit"
    git archive "$commit" | tar -x -C "ab/$commit" && rm -rf "ab/$commit/docs" "ab/$commit/tests"
  done
  grep -qx "/ab/" .git/info/exclude 2>/dev/null || echo "/ab/" >> .git/info/exclude
  exit 0
fi
out=${2:?usage: ab_trees.sh --run OUTDIR COMMIT...}
shift 2
port=8400
for commit in HEAD "$@"; do
  port=$((port + 1))
  mkdir -p "$out/$commit"
  script=benchmarks/gpu/serve_vs_offline.sh
  if [ "$commit" != HEAD ]; then
    cp -r .gpu_assets "ab/$commit/"
    script="ab/$commit/benchmarks/gpu/serve_vs_offline.sh"
  fi
  PROFILE=cpu PORT=$port API_SERVERS=${API_SERVERS:-1} timeout 150 "$script" "$out/$commit" >/dev/null 2>&1
  python3 - "$out/$commit" "$commit" <<'PY'
import glob, json, sys
(path,) = glob.glob(f"{sys.argv[1]}/serve*.json")[:1]  # serve_asc<N>.json, serve.json in old trees
d = json.load(open(path))
print(sys.argv[2], round(d["output_throughput"]), "tok/s", "tpot", round(d["median_tpot_ms"], 2),
      "itl med/p90/p99", round(d["median_itl_ms"], 1), round(d["p90_itl_ms"], 1), round(d["p99_itl_ms"], 1))
PY
done
