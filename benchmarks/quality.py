"""Quantization quality on the embedded SmolLM2-135M: perplexity of tests/data/perplexity.txt (~1,900
tokens of plain prose written for this project) under each scheme and dtype, and the change against the
unquantized model in the same dtype. Prints JSON.
INT4 is a compressed-tensors W4A16 checkpoint (group 64, zero points, round-to-nearest) that this script
makes from the embedded model with the compressed-tensors library (tokenmill/bench/quant_checkpoints.py).
fp8-kv is the unquantized model with an FP8 KV cache. int4-gptq (not in the default list: about four
minutes on two CPU cores, half of it writing the calibration text) is a GPTQ-format checkpoint, group 128,
zero points, desc_act false: AWQ input scaling, then GPTQ with act-order over static groups whose ranges
come from a clipping search, calibrated on ~18,000 tokens the model writes itself. Each checkpoint is
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


CALIBRATION_TOPICS = (
    "the history of bridges", "how bees make honey", "a walk in autumn", "the first computers",
    "cooking rice", "sailing ships", "the water cycle", "learning a language", "a village baker",
    "the moon landing", "growing tomatoes", "an old lighthouse", "trains in the nineteenth century",
    "how clocks work", "a winter storm", "the life of a river", "medieval castles", "a small bookshop",
    "volcanoes", "the printing press", "a family farm", "mountain climbing", "the ocean floor",
    "a market town", "birds that migrate", "the invention of paper", "a carpenter's workshop",
    "rain forests", "a fishing village", "the roman roads", "a letter from a soldier", "windmills",
)  # fmt: skip
CALIBRATION_STYLES = ("Write a few paragraphs about {}.", "Tell a short story about {}.")


def calibration_ids(num_sequences: int = 64, max_tokens: int = 256) -> list[list[int]]:
    """GPTQ's calibration set: text the embedded model writes itself (never the scored text), one chat
    per topic and style, sampled at temperature 0.9: 64 sequences of ~290 tokens (~18,000 tokens, more
    than ten times the widest layer input, 1,536) as token ids with their chat prompts."""
    from tokenmill import SamplingParams

    prompts = [style.format(topic) for style in CALIBRATION_STYLES for topic in CALIBRATION_TOPICS]
    chats = [[{"role": "user", "content": prompt}] for prompt in prompts[:num_sequences]]
    blocks = num_sequences * (max_tokens + 64) // 16 + 64  # the prompts are ~40 tokens; blocks of 16
    llm = LLM("default", max_model_len=4096, num_kv_blocks=blocks, dtype="float32")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=0)
    outputs = llm.chat(chats, params, use_tqdm=False)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--schemes", default="none,fp8,fp8-kv,int4")
    args = parser.parse_args()
    rows = []
    token_ids = None
    checkpoints: dict[str, str] = {}
    for dtype in args.dtypes.split(","):
        baseline = None
        for scheme in args.schemes.split(","):
            quantization = None if scheme in ("none", "int4", "int4-gptq", "fp8-kv") else scheme
            options = dict(max_model_len=4096, num_kv_blocks=300, dtype=dtype, quantization=quantization)
            if scheme == "fp8-kv":
                options["kv_cache_dtype"] = "fp8"
            if scheme == "int4":  # a checkpoint of its own, scored on the token ids of the first scheme
                from tokenmill.bench.quant_checkpoints import int4_smollm2

                if scheme not in checkpoints:
                    checkpoints[scheme] = int4_smollm2(tempfile.mkdtemp(prefix="smollm2-w4a16-"))
                llm = LLM(checkpoints[scheme], skip_tokenizer_init=True, **options)
            elif scheme == "int4-gptq":
                from tokenmill.bench.quant_checkpoints import gptq_smollm2

                if scheme not in checkpoints:
                    start = time.perf_counter()
                    path = gptq_smollm2(tempfile.mkdtemp(prefix="smollm2-gptq-"), calibration_ids())
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
