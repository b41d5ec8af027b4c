"""Where the step loop's host time goes, per step: the engine's phases timed in place (schedule, the
host half of the next step, the wait for a grammar step's masks and the queueing of its sampling, the
launch, the wait for the oldest step's tokens, taking them in, the outputs), once unconstrained and once
with every request under the `structured` stage's JSON schema, in the same process. The mask fill runs
beside the loop on a helper thread; its own time is reported apart. What the phases do not cover is the
loop's remaining Python ("other").

    python benchmarks/gpu/profile_host_loop.py --tokenizer DIR [--shape qwen3-0.6b] [--batch 64]
        [--requests 256] [--input-len 256] [--output-len 128] [--runs none,12x64,none,12x64]
        [--config-overrides JSON] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grammar_masks import SCHEMA, unbounded  # noqa: E402  (the structured stage's schemas)
from shapes import shape_dir  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.kernels import host_wait  # noqa: E402
from tokenmill.sampling_params import StructuredOutputsParams  # noqa: E402
from tokenmill.structured_outputs import MASK_THREADS, MAX_FAMILIES  # noqa: E402
from tokenmill.worker import sampler as sampler_module  # noqa: E402
from tokenmill.worker.sampler import Sampler  # noqa: E402
from tokenmill.worker.step_output import AwaitingGrammar, PendingRunnerOutput  # noqa: E402


class PhaseSeconds:
    """Seconds spent in each phase: wall time, and the loop thread's CPU time. A phase slower in wall
    time alone waited (for the GIL, or the device); one slower in CPU time too ran slower (a busier host:
    shared cores, lower clocks)."""

    def __init__(self) -> None:
        self.wall: dict = defaultdict(float)
        self.cpu: dict = defaultdict(float)

    def clear(self) -> None:
        self.wall.clear()
        self.cpu.clear()


def _timed(owner, name: str, phase: str, seconds: PhaseSeconds) -> None:
    """Replace owner.name by a wrapper adding its wall and CPU time to seconds' `phase`."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds.wall[phase] += time.perf_counter() - start
            seconds.cpu[phase] += time.thread_time() - cpu

    setattr(owner, name, wrapper)


def instrument(llm: LLM) -> PhaseSeconds:
    seconds = PhaseSeconds()
    engine, core = llm.engine, llm.engine.core
    _timed(core.scheduler, "schedule", "schedule", seconds)
    _timed(core.executor, "prepare", "prepare (host half)", seconds)
    _timed(core, "_launch_filled", "masks wait + sampling queued", seconds)
    _timed(core.executor, "launch", "launch", seconds)
    _timed(core.scheduler, "update_from_output", "take in tokens", seconds)
    _timed(engine.output_processor, "process", "outputs", seconds)
    _timed(engine, "step", "loop total", seconds)
    # Parts of the phases above (or of "other", the grammar step's work outside them), for where the
    # constrained step's extra host time goes.
    runner = core.executor
    _timed(core, "_fill", "fill submitted: its Python half, the helper started (in other)", seconds)
    _timed(AwaitingGrammar, "with_grammar", "masked sampling queued (in other)", seconds)
    if hasattr(runner, "grammar_masks"):
        _timed(runner.grammar_masks, "apply", "masks applied (in masked sampling queued)", seconds)
        _timed(runner, "_for_sampling", "sampling batch built (in launch)", seconds)
    _timed(Sampler, "__call__", "sampler (in launch or sampling queued)", seconds)
    _timed(PendingRunnerOutput, "__init__", "tokens' copy queued (in launch or sampling queued)", seconds)
    return seconds


def schedule_marks(core, marks: list) -> None:
    """(time, whether it is decode alone) at each step the scheduler hands out: the loop's period between
    two decode-only steps, apart from the prompt chunks' (each wave of requests starts with steps of
    several thousand prompt tokens, whose device time every run shares)."""
    inner = core.scheduler.schedule

    def schedule():
        out = inner()
        if not out.is_empty:
            decode = out.total_num_scheduled_tokens == len(out.num_scheduled_tokens)
            marks.append((time.perf_counter(), decode))
        return out

    core.scheduler.schedule = schedule


def decode_period_ms(marks: list) -> float | None:
    """Median ms between consecutive decode-only steps' scheduling."""
    gaps = [b[0] - a[0] for a, b in zip(marks, marks[1:]) if a[1] and b[1]]
    return round(float(np.median(gaps)) * 1e3, 3) if gaps else None


def device_mask_events(runner, events: list) -> None:
    """CUDA events around each masking kernel (which waits for the host's masks, then applies them)."""
    inner = runner.grammar_masks.apply

    def apply(logits, index, bitmask):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        inner(logits, index, bitmask)
        after.record()
        events.append((before, after))

    runner.grammar_masks.apply = apply


def run(llm: LLM, seconds: PhaseSeconds, prompts, params, marks: list) -> dict:
    core = llm.engine.core
    seconds.clear()
    marks.clear()
    steps0, tokens0 = core.num_steps, core.seconds_on_tokens
    scheduler = core.scheduler
    fill0, fills0 = scheduler.grammar_mask_seconds, scheduler.grammar_mask_steps
    start = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    steps = core.num_steps - steps0
    per_step = {phase: round(s / steps * 1e3, 3) for phase, s in seconds.wall.items()}
    cpu_per_step = {phase: round(s / steps * 1e3, 3) for phase, s in seconds.cpu.items()}
    tokens_wait = core.seconds_on_tokens - tokens0
    per_step["tokens wait, then read back"] = round(tokens_wait / steps * 1e3, 3)
    total = seconds.wall["loop total"]
    # Phases named "... (in X)" are parts of phase X, not beside it.
    covered = tokens_wait + sum(
        s for phase, s in seconds.wall.items() if phase != "loop total" and "(in " not in phase
    )
    per_step["other"] = round((total - covered) / steps * 1e3, 3)
    fills = scheduler.grammar_mask_steps - fills0
    return {
        "steps": steps,
        "elapsed_s": round(elapsed, 3),
        "ms_per_step": round(elapsed / steps * 1e3, 3),
        "decode_step_ms_median": decode_period_ms(marks),
        "phases_ms_per_step": per_step,
        "phases_cpu_ms_per_step": cpu_per_step,
        "fill_ms_per_masked_step": (
            round((scheduler.grammar_mask_seconds - fill0) / fills * 1e3, 3) if fills else None
        ),
    }


def device_waits(events: list) -> float | None:
    """Mean ms the device spent in the masking kernel (waiting for the masks, then applying them)."""
    if not events:
        return None
    events[-1][1].synchronize()
    return round(sum(b.elapsed_time(a) for b, a in events) / len(events), 3)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", required=True, help="directory with tokenizer.json (vocab 49,152)")
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--config-overrides", default="{}", help="JSON over the config (CPU smoke)")
    parser.add_argument(
        "--runs", default=f"none,{MASK_THREADS}x{MAX_FAMILIES},none,{MASK_THREADS}x{MAX_FAMILIES}",
        help="comma-separated runs in order: none (unconstrained) or THREADSxFAMILIES (under the schema), "
        "THREADSxFAMILIES:siN with the GIL's switch interval N us instead of the engine's 100; :torch after "
        "either samples by the sampler's torch form instead of the one-launch kernel (kernels/sample.py); "
        ":unbounded takes the schema without its strings' maxLength; :unstaged reads the masks over the bus "
        "a block at a time (host_wait.STAGED_MASKS off); :pin runs the loop on CPU 0 and the mask threads "
        "off the CPUs in $PIN_EXCLUDE (default 0)",
    )  # fmt: skip
    parser.add_argument("--out")
    args = parser.parse_args()
    overrides = json.loads(args.config_overrides)
    model = shape_dir(args.shape, vocab_size=49152, bos_token_id=1, eos_token_id=2, **overrides)
    for name in os.listdir(args.tokenizer):
        shutil.copy(os.path.join(args.tokenizer, name), model)
    llm = LLM(model=model, load_format="dummy", max_num_seqs=args.batch, max_model_len=4096)
    seconds = instrument(llm)
    rng = np.random.default_rng(0)
    report = {"shape": args.shape, "batch": args.batch, "requests": args.requests, "runs": {}}
    structured = llm.engine.core.scheduler.structured
    events: list = []
    marks: list = []
    schedule_marks(llm.engine.core, marks)
    if torch.cuda.is_available():
        device_mask_events(llm.engine.core.executor, events)
    runs = []
    for run_spec in args.runs.split(","):
        run_spec, *options = run_spec.split(":")
        interval = next((o[2:] for o in options if o.startswith("si")), "")
        torch_form = "torch" in options
        schema = unbounded(SCHEMA) if "unbounded" in options else SCHEMA
        threads, families = run_spec.split("x") if run_spec != "none" else (None, None)
        label = "none" if threads is None else f"json threads={threads} families={families}"
        label += f" switch={interval}us" if interval else ""
        label += " torch-sampler" if torch_form else ""
        label += " unbounded" if schema is not SCHEMA else ""
        label += " unstaged" if "unstaged" in options else ""
        label += " pinned" if "pin" in options else ""
        label += f" #{sum(r[0].rsplit(' #', 1)[0] == label for r in runs) + 1}"
        threads, families = threads and int(threads), families and int(families)
        unstaged, pin = "unstaged" in options, "pin" in options
        runs.append((label, threads, families, interval, torch_form, schema, unstaged, pin))
    all_cpus = os.sched_getaffinity(0)
    exclude = {int(c) for c in os.environ.get("PIN_EXCLUDE", "0").split(",") if c}
    for label, threads, families, interval, torch_form, schema, unstaged, pin in runs:
        sampler_module.ONE_LAUNCH_SAMPLING = not torch_form
        host_wait.STAGED_MASKS = not unstaged
        constraint = None
        # The engine's first fill lowers the switch interval to 100 us (and never raises it).
        sys.setswitchinterval(int(interval) * 1e-6 if interval else 0.0001)
        if threads is not None:
            constraint = StructuredOutputsParams(json=schema)
            # A fresh compilation cache and llguidance executor for this many threads and families.
            structured.__init__(structured.load_tokenizer, structured.vocab_size, threads, families)
            if pin:  # llguidance's threads start with the executor, on the CPUs its creator may use
                os.sched_setaffinity(0, all_cpus - exclude)
                structured.ll_tokenizer  # noqa: B018 (builds the executor now)
        os.sched_setaffinity(0, {min(exclude)} if pin else all_cpus)
        # Fresh random prompts for each run and its warm-up: nothing comes from the prefix cache.
        prompts = rng.integers(100, 40000, (args.requests + args.batch, args.input_len)).tolist()
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, structured_outputs=constraint)
        warm = SamplingParams(max_tokens=8, ignore_eos=True, structured_outputs=constraint)
        llm.generate(prompt_token_ids=prompts[args.requests :], sampling_params=warm, use_tqdm=False)
        events.clear()
        report["runs"][label] = run(llm, seconds, prompts[: args.requests], params, marks)
        report["runs"][label]["device_masking_ms_per_masked_step"] = device_waits(events)
        print(f"{label}: {json.dumps(report['runs'][label])}", file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
