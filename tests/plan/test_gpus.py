"""The GPU catalogue holds the cited dense datasheet figures; ceilings resolve per compute dtype."""

from __future__ import annotations

import pytest

from tokenmill.plan.gpus import GPUS, MIB, ceilings_for, compute_dtype, custom_gpu, resolve_gpu


@pytest.mark.parametrize(
    ("name", "tb_s", "gb", "bf16_tflops", "fp8_tflops", "int8_tops", "driver_mib"),
    [
        ("H200", 4.8, 141, 989, 1979, 1979, 143771),
        ("H100 SXM", 3.35, 80, 989, 1979, 1979, 81559),
        ("B200", 8.0, 180, 2250, 4500, 4500, 183359),
        ("A100 80GB", 2.039, 80, 312, None, 624, 81920),
        ("L40S", 0.864, 48, 362.05, 733, 733, 46068),
        ("RTX 4090", 1.008, 24, 165.2, 330.3, 660.6, 24564),
    ],
)
def test_datasheet_figures(name, tb_s, gb, bf16_tflops, fp8_tflops, int8_tops, driver_mib):
    gpu = GPUS[name]
    assert gpu.bandwidth_bytes_s == pytest.approx(tb_s * 1e12)
    assert gpu.datasheet_memory_gb == gb
    assert gpu.memory_bytes == driver_mib * MIB
    assert gpu.flops["bf16"] == pytest.approx(bf16_tflops * 1e12)
    assert gpu.flops.get("fp8") == (None if fp8_tflops is None else pytest.approx(fp8_tflops * 1e12))
    assert gpu.flops["int8"] == pytest.approx(int8_tops * 1e12)


def test_h200_ridge_point():
    assert ceilings_for(GPUS["H200"], "bf16", measured=False).ops_per_byte == pytest.approx(989 / 4.8)


@pytest.mark.parametrize(
    ("typed", "name"),
    [
        ("h200", "H200"),
        ("NVIDIA H200", "H200"),
        ("H100", "H100 SXM"),
        ("h100-sxm", "H100 SXM"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("a100", "A100 80GB"),
        ("4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ],
)
def test_names_forgive_case_and_punctuation(typed, name):
    assert resolve_gpu(typed).name == name


def test_unknown_gpu_lists_the_choices():
    with pytest.raises(ValueError, match="unknown GPU 'tpu-v5'; choose one of: H100 SXM, H200, B200"):
        resolve_gpu("tpu-v5")
    with pytest.raises(ValueError, match="unknown GPU 'NVIDIA H100 PCIe'"):  # 2 TB/s, not the SXM's 3.35
        resolve_gpu("NVIDIA H100 PCIe")


def test_compute_dtype_follows_the_weights_and_the_card():
    assert compute_dtype(GPUS["H200"], "fp8") == "fp8"
    assert compute_dtype(GPUS["H200"], "int8") == "int8"
    assert compute_dtype(GPUS["H200"], "int4") == "bf16"  # W4A16: dequantised into bf16 matmuls
    assert compute_dtype(GPUS["A100 80GB"], "fp8") == "bf16"  # no FP8 tensor cores: weight-only fp8


def test_measured_ceilings_for_h200():
    measured = ceilings_for(GPUS["H200"], "bf16", measured=True)
    assert (measured.bandwidth_bytes_s, measured.flops) == (4.25e12, 788e12)
    fp8 = ceilings_for(GPUS["H200"], "fp8", measured=True)
    assert (fp8.bandwidth_bytes_s, fp8.flops) == (4.25e12, 1979e12)
    assert "fp8 compute from the datasheet" in fp8.source
    with pytest.raises(ValueError, match="no measured ceilings for L40S"):
        ceilings_for(GPUS["L40S"], "bf16", measured=True)


def test_custom_gpu():
    gpu = custom_gpu(memory_gb=64, bandwidth_tb_s=2.0, tflops=400)
    assert (gpu.memory_bytes, gpu.bandwidth_bytes_s, gpu.flops["fp8"]) == (64e9, 2e12, 400e12)
    with pytest.raises(ValueError, match="--gpu custom needs --bandwidth-tbs, --tflops"):
        custom_gpu(memory_gb=64, bandwidth_tb_s=None, tflops=None)
    with pytest.raises(ValueError, match="--memory-gb must be positive, got -1"):
        custom_gpu(memory_gb=-1, bandwidth_tb_s=2.0, tflops=400)
