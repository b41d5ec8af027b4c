"""The Triton kernels build for the H100/H200 (sm_90) without spilling, checked on a machine without a
GPU: CI has none, and a kernel that only fails to compile on the GPU would otherwise go unseen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the kernels themselves")
def test_every_launch_builds_for_sm90_without_spills() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_build"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    builds = [json.loads(line) for line in result.stdout.splitlines()]
    assert {build["kernel"] for build in builds} == {
        "_paged_attention_kernel",
        "_reduce_splits_kernel",
        "w4a16_gemv_kernel",
        "w4a16_gemv_f16x2_kernel",
        "w4a16_dot_kernel",
        "w8a16_gemv_kernel",
        "w8a16_dot_kernel",
        "w8a16_group_dequant_kernel",
        "_w4a16_mma_kernel",
        "_dequantize_kernel",
        "_write_kv_cache_kernel",
        "_rms_norm_kernel",
        "_rotary_kernel",
        "_silu_and_mul_kernel",
        "_silu_and_mul_quant_kernel",
        "_quantize_rows_kernel",
        "_wait_then_mask_kernel",
        "_quant_grouped_gemm",
    }
    # One known spill: the many short FP8 decodes' 64-key, two-warp tile read value by value (the engine's
    # default there since the twentieth session, ~12-40 bytes as the kernel changed); read as pairs it has
    # none (attention.FP8_PAIR_LOADS).
    # And one of the quantized experts' GEMMs: INT4 with zero points at the prefill tile (256 x 64 over
    # 128 rows; 8 bytes while its tiles were unpacked to int32, none since the PTX unpacking).
    spills = [build for build in builds if build["spill_bytes"]]
    assert all(
        (
            build["kernel"] == "_paged_attention_kernel"
            and build["constants"]["BLOCK_N"] == 64
            and build["constants"]["DOT_FP16"]
            and not build["constants"]["FP8_PAIRS"]
            or build["kernel"] == "_quant_grouped_gemm"
            and build["constants"]["HAS_ZERO"]
            and build["constants"]["BLOCK_M"] == 128
        )
        and build["spill_bytes"] <= 16
        for build in spills
    ), spills
    moe_builds = [build for build in builds if build["kernel"] == "_quant_grouped_gemm"]
    # five formats (FP8 per row and in groups, INT4 with and without zero points, INT8), 3 rows, 2 GEMMs
    assert len(moe_builds) == 30 and all(build["uses_tensor_cores"] for build in moe_builds)
    attention_builds = [build for build in builds if build["kernel"] == "_paged_attention_kernel"]
    # 12, 6 decodes that rotate and store the step's key themselves, 6 that merge their splits in their
    # launch, 3 over an FP8 cache without, 3 of each of those with their tiles read as pairs, and many
    # short FP8 decodes with and without
    assert len(attention_builds) == 35
    assert sum(bool(build["constants"].get("MERGE")) for build in attention_builds) == 6
    pairs = [build for build in attention_builds if build["constants"].get("FP8_PAIRS")]
    # (48-dim heads asked for pairs keep the value reads: their last word would straddle the padding)
    assert len(pairs) == 5 and all(build["constants"]["HEAD_DIM"] in (64, 128) for build in pairs)
    assert all(build["uses_tensor_cores"] for build in attention_builds)
    # Hopper allows 227 KB of shared memory per block.
    assert max(build["shared_bytes"] for build in builds) <= 227 * 1024
