"""Quantization quality on the embedded SmolLM2-135M: perplexity of tests/data/perplexity.txt (~1,900
tokens of plain prose written for this project) under each scheme and dtype, and the change against the
unquantized model in the same dtype. Prints JSON.
INT4 is a compressed-tensors W4A16 checkpoint (group 64, zero points, round-to-nearest) that this script
makes from the embedded model with the compressed-tensors library (tokenmill/bench/quant_checkpoints.py).
fp8-kv is the unquantized model with an FP8 KV cache; int4-online is `--quantization int4` (symmetric
groups of 128 made at load, no calibration). int4-gptq (not in the default list: about 13
minutes on two AVX2 cores, 2-3 of them writing the calibration text) is a GPTQ-format checkpoint, group 128,
zero points, desc_act false: AWQ input scaling, then true-sequential GPTQ (each sublayer calibrated on
inputs through the ones before it quantized) with act-order over static groups whose ranges come from a
clipping search, its scales refit to the codes and refined in rounds (quant_checkpoints.REFINE_ROUNDS),
calibrated on ~18,000 tokens the model writes itself. Each checkpoint is
made once and scored in every dtype.
Usage: python benchmarks/quality.py [--dtypes float32,bfloat16] [--schemes none,fp8,fp8-kv,int4]"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tokenmill import LLM
from tokenmill.bench.perplexity import perplexity

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "perplexity.txt"
SCHEMES = ("none", "fp8", "fp8-kv", "int4", "int4-online", "int4-gptq")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--schemes", default="none,fp8,fp8-kv,int4")
    args = parser.parse_args()
    unknown = sorted(set(args.schemes.split(",")) - set(SCHEMES))
    if unknown:
        parser.error(f"--schemes: unknown {', '.join(unknown)}; choose from {', '.join(SCHEMES)}")
    rows = []
    token_ids = None
    checkpoints: dict[str, str] = {}
    for dtype in args.dtypes.split(","):
        baseline = None
        for scheme in args.schemes.split(","):
            quantization = {"fp8": "fp8", "int4-online": "int4"}.get(scheme)
            options = dict(max_model_len=4096, num_kv_blocks=300, dtype=dtype, quantization=quantization)
            if scheme == "fp8-kv":
                options["kv_cache_dtype"] = "fp8"
            if scheme == "int4":  # a checkpoint of its own, scored on the token ids of the first scheme
                from tokenmill.bench.quant_checkpoints import int4_smollm2

                if scheme not in checkpoints:
                    checkpoints[scheme] = int4_smollm2(tempfile.mkdtemp(prefix="smollm2-w4a16-"))
                llm = LLM(checkpoints[scheme], skip_tokenizer_init=True, **options)
            elif scheme == "int4-gptq":
                from tokenmill.bench.quant_checkpoints import gptq_calibration_ids, gptq_smollm2

                if scheme not in checkpoints:
                    start = time.perf_counter()
                    path = gptq_smollm2(tempfile.mkdtemp(prefix="smollm2-gptq-"), gptq_calibration_ids())
                    checkpoints[scheme] = path
                    print(json.dumps({"int4-gptq checkpoint seconds": round(time.perf_counter() - start)}))
                llm = LLM(checkpoints[scheme], skip_tokenizer_init=True, **options)
            else:
                llm = LLM("default", **options)
            if token_ids is None:
                token_ids = llm.engine.input_processor.tokenizer.encode(TEXT.read_text())
            start = time.perf_counter()
            value = perplexity(llm, token_ids)
            baseline = value if scheme == "none" else baseline
            row = {
                "dtype": dtype,
                "scheme": scheme,
                "perplexity": round(value, 4),
                "seconds": round(time.perf_counter() - start, 2),
            }
            if baseline is not None:
                row["change_vs_unquantized"] = f"{(value / baseline - 1) * 100:+.2f}%"
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"tokens": len(token_ids or []), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
