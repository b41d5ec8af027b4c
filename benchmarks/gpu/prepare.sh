#!/usr/bin/env bash
# What a GPU call carries that the device image lacks, made here on the CPU (no network there):
#   .whl/         wheels of the server's and structured outputs' packages, at constraints.txt's versions,
#                 for the image's Python 3.12 on x86-64, py-spy (kv_offload_serve.sh's PROFILE=1), and
#                 compressed-tensors with loguru and psutil (the quantized checkpoints' tests);
#   .gpu_assets/  the embedded SmolLM2's tokenizer (read from its GGUF), for real text on dummy weights.
# Usage: benchmarks/gpu/prepare.sh   (then `run` with carry [".whl", ".gpu_assets"], starting the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD; ). run_all.sh packs its results into
#   one tarball when they are more than the device returns (8 files); a call that runs other scripts
#   should end with `benchmarks/gpu/pack.sh $OUT`.
set -eu
cd "$(dirname "$0")/../.."
py=${PYTHON:-.venv/bin/python}
packages="fastapi starlette pydantic pydantic_core annotated-types typing-inspection typing_extensions
  opentelemetry-api importlib-metadata uvicorn httptools pyzmq msgspec gguf llguidance py-spy
  compressed-tensors loguru psutil"
mkdir -p .whl
for name in $packages; do
  # constraints.txt's version where it pins one (importlib-metadata, opentelemetry-api's need, it does not)
  pin=$(grep -i "^${name//[-_]/[-_]}==" constraints.txt || echo "$name")
  ls .whl | grep -qi "^${name//[-_]/_}-" && continue
  $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$pin"
done
if [ ! -f .gpu_assets/tokenizer/tokenizer.json ]; then
  $py - <<'PY'
from pathlib import Path

from transformers import AutoTokenizer

from tokenmill.loader.default_model import default_model_path

path = Path(default_model_path())
AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(".gpu_assets/tokenizer")
PY
fi
du -sh .whl .gpu_assets
