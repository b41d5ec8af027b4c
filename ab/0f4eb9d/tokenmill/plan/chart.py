"""The roofline chart: attainable FLOP/s against arithmetic intensity, with the planned steps on it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenmill.plan.gpus import RooflineCeilings
from tokenmill.plan.roofline import RooflinePoint


def point_label(point: RooflinePoint) -> str:
    if point.phase == "prefill":
        return f"prefill {point.tokens} tok"
    return f"decode batch {point.batch}, ctx {point.context_len}"


def write_roofline_chart(
    path: Path,
    roofs: Sequence[RooflineCeilings],
    points: Sequence[RooflinePoint],
    title: str,
    measured: Sequence[tuple[str, float, float]] = (),
) -> Path:
    """Draw each roof (datasheet, and measured where known), the planned points at the FLOP/s their floor
    gives, and any measured points as (label, arithmetic intensity, achieved FLOP/s)."""
    import matplotlib  # imported here so that the planner's text output never pays for it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    intensities = [p.arithmetic_intensity for p in points] + [r.ops_per_byte for r in roofs]
    low = min(min(intensities) / 4, 0.5)
    high = max(max(intensities) * 4, 1e4)
    x = np.logspace(np.log10(low), np.log10(high), 400)

    figure, axes = plt.subplots(figsize=(8, 5.5), dpi=120)
    for roof, style in zip(roofs, ("-", "--"), strict=False):
        attainable = np.minimum(roof.flops, roof.bandwidth_bytes_s * x) / 1e12
        axes.plot(
            x,
            attainable,
            style,
            color="black",
            label=f"{roof.source.split(':')[0]} roof: {roof.bandwidth_bytes_s / 1e12:.2f} TB/s, "
            f"{roof.flops / 1e12:.0f} {roof.compute_dtype} TFLOP/s (ridge {roof.ops_per_byte:.0f} FLOP/B)",
        )
    markers = {"decode": "o", "prefill": "s"}
    for point in points:
        achieved = point.flops / point.floor_s / 1e12
        axes.scatter(point.arithmetic_intensity, achieved, marker=markers[point.phase], s=50, zorder=3)
        axes.annotate(
            f"{point_label(point)}\n{point.bound}-bound",
            (point.arithmetic_intensity, achieved),
            textcoords="offset points",
            # Prefill sits under the flat roof at the right edge: label it to the left, below the roofs.
            xytext=(-8, -40) if point.phase == "prefill" else (6, -14),
            ha="right" if point.phase == "prefill" else "left",
            fontsize=8,
        )
    for label, intensity, achieved_flops in measured:
        axes.scatter(intensity, achieved_flops / 1e12, marker="x", s=60, color="red", zorder=3)
        axes.annotate(
            label,
            (intensity, achieved_flops / 1e12),
            textcoords="offset points",
            xytext=(6, 4),
            fontsize=8,
            color="red",
        )
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    axes.set_ylabel("attainable TFLOP/s per GPU")
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
