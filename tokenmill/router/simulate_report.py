"""What `router simulate` shows of its results: the table, the JSON object and the plot."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.plan.memory import Deployment
    from tokenmill.router.simulate import FleetConfig, PolicyResult


def format_results(results: list[PolicyResult]) -> str:
    header = (
        f"{'policy':<12}{'hit rate':>9}{'router est':>11}{'TTFT P50':>10}{'TTFT P99':>10}{'TTFT mean':>10}"
        f"{'out tok/s':>11}{'busy max/mean':>14}{'req max/mean':>13}{'load CV':>9}{'sim s':>8}{'wall s':>8}"
    )
    rows = [
        f"{r.policy:<12}{r.hit_rate:>9.1%}{r.estimated_hit_rate:>11.1%}{_ms(r.ttft_p50_s):>10}"
        f"{_ms(r.ttft_p99_s):>10}{_ms(r.ttft_mean_s):>10}{r.output_tok_s:>11,.0f}{r.busy_max_over_mean:>14.2f}"
        f"{r.requests_max_over_mean:>13.2f}{r.load_cv:>9.2f}{r.duration_s:>8.1f}{r.wall_s:>8.1f}"
        for r in results
    ]
    return "\n".join([header, *rows])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms"


def results_json(
    args: argparse.Namespace,
    config: FleetConfig,
    deployment: Deployment,
    tp: int,
    results: list[PolicyResult],
) -> dict[str, Any]:
    from tokenmill.router.simulate import add_simulate_arguments

    # Only simulate's own options: the namespace also holds the `router` command's (--port, --policy ...).
    own = argparse.ArgumentParser()
    add_simulate_arguments(own)
    names = vars(own.parse_args([]))
    options = {
        name: str(value) if isinstance(value, Path) else value
        for name, value in vars(args).items()
        if name in names
    }
    return {
        "options": options,
        "fleet": {
            "replicas": config.num_replicas,
            "model": deployment.shape.name,
            "gpu": deployment.gpu.name,
            "tp": tp,
            "kv_blocks_per_replica": config.capacity_blocks,
            "block_size": config.block_size,
        },
        "results": [
            {
                **result._asdict(),
                "hit_rate": result.hit_rate,
                "estimated_hit_rate": result.estimated_hit_rate,
                "output_tok_s": result.output_tok_s,
            }
            for result in results
        ],
    }


def plot_results(path: Path, results: list[PolicyResult]) -> bool:
    """Hit rate (true and as the router estimated it) and TTFT P99 by policy; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [result.policy for result in results]
    positions = range(len(names))
    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    hits.bar([p - 0.2 for p in positions], [100 * r.hit_rate for r in results], 0.4, label="true")
    hits.bar(
        [p + 0.2 for p in positions],
        [100 * r.estimated_hit_rate for r in results],
        0.4,
        label="router's estimate",
    )
    hits.set(ylabel="prefix hit rate (% of prompt tokens)", xticks=list(positions), xticklabels=names)
    hits.legend()
    ttft.bar(list(positions), [r.ttft_p99_s * 1e3 for r in results], 0.6, color="tab:red")
    ttft.set(ylabel="TTFT P99 (ms)", xticks=list(positions), xticklabels=names)
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except OSError as exc:
        raise ValueError(f"--plot {path}: cannot write it ({exc.strerror or exc})") from exc
    finally:
        plt.close(figure)
    return True
