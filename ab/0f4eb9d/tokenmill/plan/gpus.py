"""The GPU catalogue: dense (non-sparse) datasheet ceilings per compute dtype, the memory the driver reports,
and the ceilings measured on our own cards where we have them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

MIB = 1 << 20


@dataclass(frozen=True)
class GpuSpec:
    name: str
    datasheet_memory_gb: float  # the capacity the datasheet quotes
    memory_bytes: int  # the total the driver reports (nvidia-smi); capacity planning starts from this
    bandwidth_bytes_s: float
    flops: dict[str, float]  # dense tensor-core FLOP/s (int8: OP/s) by compute dtype
    source: str


class MeasuredCeilings(NamedTuple):
    bandwidth_bytes_s: float
    flops: dict[str, float]
    source: str


@dataclass(frozen=True)
class RooflineCeilings:
    gpu: str
    bandwidth_bytes_s: float
    flops: float
    compute_dtype: str
    source: str  # where the two figures come from

    @property
    def ops_per_byte(self) -> float:
        """The ridge point: a kernel below this arithmetic intensity cannot saturate the tensor cores."""
        return self.flops / self.bandwidth_bytes_s


GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec(
            name="H100 SXM",
            datasheet_memory_gb=80,
            memory_bytes=81559 * MIB,
            bandwidth_bytes_s=3.35e12,
            flops={"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12},
            source="NVIDIA H100 Tensor Core GPU datasheet, SXM column (sparse figures halved)",
        ),
        GpuSpec(
            name="H200",
            datasheet_memory_gb=141,
            memory_bytes=143771 * MIB,
            bandwidth_bytes_s=4.8e12,
            flops={"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12},
            source="NVIDIA H200 Tensor Core GPU datasheet, SXM column (sparse figures halved)",
        ),
        GpuSpec(
            name="B200",
            datasheet_memory_gb=180,
            memory_bytes=183359 * MIB,
            bandwidth_bytes_s=8.0e12,
            flops={"bf16": 2250e12, "fp8": 4500e12, "int8": 4500e12},
            source="NVIDIA DGX B200 datasheet (1,440 GB, 64 TB/s for 8 GPUs); HGX B200 dense tensor figures",
        ),
        GpuSpec(
            name="A100 80GB",
            datasheet_memory_gb=80,
            memory_bytes=81920 * MIB,
            bandwidth_bytes_s=2.039e12,
            flops={"bf16": 312e12, "int8": 624e12},
            source="NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column (no FP8 tensor cores)",
        ),
        GpuSpec(
            name="L40S",
            datasheet_memory_gb=48,
            memory_bytes=46068 * MIB,
            bandwidth_bytes_s=0.864e12,
            flops={"bf16": 362.05e12, "fp8": 733e12, "int8": 733e12},
            source="NVIDIA L40S datasheet (GDDR6 with ECC on)",
        ),
        GpuSpec(
            name="RTX 4090",
            datasheet_memory_gb=24,
            memory_bytes=24564 * MIB,
            bandwidth_bytes_s=1.008e12,
            flops={"bf16": 165.2e12, "fp8": 330.3e12, "int8": 660.6e12},
            source="NVIDIA Ada Lovelace architecture whitepaper, RTX 4090 (FP32 accumulate)",
        ),
    )
}

# Ceilings measured on our own cards; GPU_FACTS.md in the shared notes records how.
MEASURED: dict[str, MeasuredCeilings] = {
    "H200": MeasuredCeilings(
        4.25e12, {"bf16": 788e12}, "measured: device copy 4.25 TB/s, bf16 8192^3 matmul 788 TFLOP/s"
    ),
}


# Short names people type and the names nvidia-smi prints (without "NVIDIA"), compared after dropping
# case, spaces and punctuation. PCIe variants are left out on purpose: their bandwidth differs.
ALIASES = {
    "h100": "H100 SXM",
    "h100sxm": "H100 SXM",
    "h10080gbhbm3": "H100 SXM",
    "h200": "H200",
    "h200sxm": "H200",
    "b200": "B200",
    "a100": "A100 80GB",
    "a10080gb": "A100 80GB",
    "a100sxm480gb": "A100 80GB",
    "l40s": "L40S",
    "4090": "RTX 4090",
    "rtx4090": "RTX 4090",
    "geforcertx4090": "RTX 4090",
}


def resolve_gpu(name: str) -> GpuSpec:
    """Look a card up by name, forgiving case, spaces and dashes (`h100-sxm`, `A100 80GB`, `rtx4090`)."""
    key = "".join(ch for ch in name.lower() if ch.isalnum()).removeprefix("nvidia")
    if key in ALIASES:
        return GPUS[ALIASES[key]]
    raise ValueError(f"unknown GPU {name!r}; choose one of: {', '.join(GPUS)}, custom")


def custom_gpu(memory_gb: float | None, bandwidth_tb_s: float | None, tflops: float | None) -> GpuSpec:
    """A card described on the command line; one TFLOP/s figure serves every compute dtype."""
    given = {"--memory-gb": memory_gb, "--bandwidth-tbs": bandwidth_tb_s, "--tflops": tflops}
    missing = [flag for flag, value in given.items() if value is None]
    if missing:
        raise ValueError(f"--gpu custom needs {', '.join(missing)}")
    for flag, value in given.items():
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    assert memory_gb is not None and bandwidth_tb_s is not None and tflops is not None
    peak = tflops * 1e12
    return GpuSpec(
        name="custom",
        datasheet_memory_gb=memory_gb,
        memory_bytes=int(memory_gb * 1e9),
        bandwidth_bytes_s=bandwidth_tb_s * 1e12,
        flops={"bf16": peak, "fp8": peak, "int8": peak},
        source="given on the command line",
    )


def compute_dtype(gpu: GpuSpec, weight_dtype: str) -> str:
    """The tensor-core dtype the matmuls run in: fp8 and int8 weights run W8A8 where the card has those
    units; int4 runs W4A16 (dequantised to bf16 in the kernel), as does fp8 on a card without FP8."""
    if weight_dtype in ("fp8", "int8") and weight_dtype in gpu.flops:
        return weight_dtype
    return "bf16"


def ceilings_for(gpu: GpuSpec, weight_dtype: str, measured: bool) -> RooflineCeilings:
    dtype = compute_dtype(gpu, weight_dtype)
    if not measured:
        return RooflineCeilings(gpu.name, gpu.bandwidth_bytes_s, gpu.flops[dtype], dtype, "datasheet")
    if gpu.name not in MEASURED:
        raise ValueError(
            f"no measured ceilings for {gpu.name}; measured figures exist for: {', '.join(MEASURED)}. "
            "Drop --measured to use the datasheet."
        )
    bandwidth, measured_flops, source = MEASURED[gpu.name]
    if dtype not in measured_flops:
        # No measured matmul in this dtype: keep the measured bandwidth, take the datasheet compute.
        return RooflineCeilings(
            gpu.name, bandwidth, gpu.flops[dtype], dtype, f"{source}; {dtype} compute from the datasheet"
        )
    return RooflineCeilings(gpu.name, bandwidth, measured_flops[dtype], dtype, source)
