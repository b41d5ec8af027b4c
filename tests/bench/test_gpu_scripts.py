"""The GPU calls prepared on the CPU (benchmarks/gpu/run_all.sh, pending.sh) hold together before a device
runs them: device minutes are few, and a call that dies on a typo or a patch gone stale costs one. The
forty-sixth session's call applied three of a stale patch's four hunks and timed a broken kernel."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "benchmarks" / "gpu"


def stages_of_run_all() -> set[str]:
    """The stages run_all.sh's case statement knows."""
    text = (GPU / "run_all.sh").read_text()
    body = text[text.index("case $stage in") :]
    return set(re.findall(r"^\s{4}([a-z0-9][a-z0-9-]*)\)", body, re.MULTILINE))


@pytest.mark.parametrize("script", ["run_all.sh", "pending.sh"])
def test_the_scripts_parse(script: str) -> None:
    done = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_stage_named_in_the_header_and_the_calls_exists() -> None:
    stages = stages_of_run_all()
    header = (GPU / "run_all.sh").read_text().split("\nset -u", 1)[0]
    listed = set(re.findall(r"[a-z0-9][a-z0-9-]+", header.split("# Stages:", 1)[1].split("(default", 1)[0]))
    assert listed == stages, (listed - stages, "named but not a stage", stages - listed, "not named")
    # pending.sh's calls: `run_all.sh "$out[/dir]" STAGE ...` (a call may go on past a backslash)
    calls = (GPU / "pending.sh").read_text().replace("\\\n", " ")
    named = [
        rest.split("2>&1")[0].split() for rest in re.findall(r'run_all\.sh "\$out[^"]*"([^;|\n]*)', calls)
    ]
    assert named, "no run_all.sh call found in pending.sh"
    for words in named:
        assert words and set(words) <= stages, set(words) - stages


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_prepared_patches_apply_to_this_tree() -> None:
    text = (GPU / "pending.sh").read_text()
    patches = set(re.findall(r"docs/results/[\w./-]+\.patch", text))
    if not patches:
        pytest.skip("pending.sh applies no patch now")
    for patch in sorted(patches):
        assert (REPO / patch).is_file(), patch
        done = subprocess.run(["git", "apply", "--check", patch], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, (patch, done.stderr)
