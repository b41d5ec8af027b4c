#!/usr/bin/env bash
# The device returns at most 8 files from $OUT, two folders down at most (its README, Limits): a call
# that writes more loses the rest. This packs everything under OUTDIR into OUTDIR/results.tar.gz (bench
# JSON stripped of per-request arrays first) when there are more than 8 files or any deeper than that;
# unpack here with `tar -xzf results.tar.gz -C DIR`.
# Usage: benchmarks/gpu/pack.sh OUTDIR
set -u
out=${1:?usage: pack.sh OUTDIR}
here=$(cd "$(dirname "$0")" && pwd)
cd "$out" || exit 1
count=$(find . -type f | wc -l)
deep=$(find . -mindepth 4 -type f | wc -l)
[ "$count" -le 8 ] && [ "$deep" -eq 0 ] && exit 0
find . -name "*.json" -size +64k -exec python3 "$here/strip_results.py" {} + >/dev/null 2>&1
files=$(find . -type f ! -name results.tar.gz)
tar -czf results.tar.gz $files && rm -f $files && find . -mindepth 1 -type d -empty -delete
echo "packed $count files into $out/results.tar.gz ($(du -h results.tar.gz | cut -f1))"
