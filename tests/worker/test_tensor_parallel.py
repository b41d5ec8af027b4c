"""Tensor parallelism on the CPU (gloo, one process per rank): greedy and seeded-sampling tokens of
TP=2 equal one process's for every dense architecture whose heads split, with KV heads that split
(llama, qwen3) and that are replicated (mistral: one KV head; at TP=4 too in the slow set), and for the
MoE models (experts sliced along their width, or held whole, a share per rank, with expert
parallelism: partial sums all-reduced, or each pick dispatched to its expert's rank by all-to-all), with
synchronous and asynchronous scheduling, with speculative decoding (a draft model, layer skip); a shape
that does not split is a ValueError naming it, before any rank starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig

PROMPTS = [[5, 17, 33, 2, 9, 11, 400], [7, 8], list(range(3, 60))]
PARAMS = [
    SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=11, ignore_eos=True),
]

# Rank 0 in a fresh process: the tensor-parallel group is per process.
RUN = """
import json, sys
from tokenmill import LLM, SamplingParams
runs = []
for path, tp, overlap, *extra in json.loads(sys.argv[1]):
    ep, spec = (extra + [False, None][len(extra):])[:2]
    dispatch = {"expert_dispatch": ep} if isinstance(ep, str) else {}  # an EP run's dispatch, by name
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              tensor_parallel_size=tp, async_scheduling=overlap, enable_expert_parallel=bool(ep),
              speculative_config=spec, **dispatch)
    params = [SamplingParams(**p) for p in json.loads(sys.argv[2])]
    outs = llm.generate(prompt_token_ids=json.loads(sys.argv[3]), sampling_params=params, use_tqdm=False)
    runs.append([o.outputs[0].token_ids for o in outs])
    llm.engine.core.executor.shutdown()
print(json.dumps(runs))
"""


PARAMS_JSON = json.dumps(
    [{"max_tokens": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k, "seed": p.seed,
      "ignore_eos": True} for p in PARAMS]
)  # fmt: skip


def python(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """The script in a fresh interpreter at the repository's root (rank 0's group is per process)."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip


def start_script(script: str, *args: str) -> subprocess.Popen:
    """The script started as python() runs it, without waiting for it (two that fail at start-up run
    side by side)."""
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip


def run_script(script: str, *args: str) -> object:
    """What a script that succeeds prints last, as JSON."""
    done = python(script, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_parallel(runs: list[tuple]) -> list[list[list[int]]]:
    return run_script(RUN, json.dumps(runs), PARAMS_JSON, json.dumps(PROMPTS))


def one_process(path: str, speculative_config: dict | None = None) -> list[list[int]]:
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              speculative_config=speculative_config)  # fmt: skip
    return [
        o.outputs[0].token_ids
        for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, use_tqdm=False)
    ]


def assert_equal_one_process(runs: list[tuple]) -> None:
    got = run_parallel(runs)
    assert len(got) == len(runs)
    for (path, tp, overlap, *extra), tokens in zip(runs, got):
        # A speculating run against one that speculates alike (sampled draws differ from plain decoding's).
        spec = extra[1] if len(extra) > 1 else None
        assert tokens == one_process(path, spec), (path, tp, overlap, extra)


def test_tp2_equal_one_process(hf_model_dirs) -> None:
    """KV heads that split (Llama); experts sliced (Qwen3-MoE), and held whole (expert parallelism: 2 of
    Mixtral's 4 experts a rank), each pick sent to its expert's rank and back. (Replicated KV heads and
    expert parallelism's all-reduced partial sums in the slow test below: each run starts a rank process,
    ~7 s of the suite's two cores.)"""
    runs: list[tuple] = [(hf_model_dirs[arch][0], 2, False) for arch in ("llama", "qwen3_moe")]
    runs += [(hf_model_dirs["mixtral_ep"][0], 2, False, "all_to_all")]
    assert_equal_one_process(runs)


@pytest.mark.slow
def test_more_architectures_schedules_and_drafters_equal_one_process(hf_model_dirs) -> None:
    """Qwen3 and Mixtral at TP=2, Mistral's replicated KV head at TP=2 and TP=4 (one query head a rank);
    expert parallelism with its partial sums all-reduced (TP=2);
    asynchronous scheduling; expert parallelism by all-to-all at TP=4 (one expert a rank, and steps of
    fewer tokens than ranks: some ranks route none); speculative decoding, whose drafts come from rank
    0's drafter while a draft model's or the target's own layers' (layer skip) forward passes run on
    every rank, in step."""
    runs: list[tuple] = [(hf_model_dirs[arch][0], 2, False) for arch in ("qwen3", "mixtral", "mistral")]
    runs += [(hf_model_dirs["mistral"][0], 4, False), (hf_model_dirs["mixtral_ep"][0], 2, False, True)]
    runs += [(hf_model_dirs["qwen3"][0], 2, True), (hf_model_dirs["mixtral_ep"][0], 4, False, "all_to_all")]
    draft_model = {"method": "draft_model", "num_speculative_tokens": 3, "model": hf_model_dirs["mistral"][0]}
    layer_skip = {"method": "layer_skip", "num_speculative_tokens": 3, "draft_layers": 1}
    runs += [(hf_model_dirs["llama"][0], 2, False, False, spec) for spec in (draft_model, layer_skip)]
    assert_equal_one_process(runs)


def test_shapes_that_do_not_split_and_unsupported_combinations_are_refused(hf_model_dirs) -> None:
    heads = start_script(RUN, json.dumps([(hf_model_dirs["qwen2"][0], 2, False)]), "[]", "[]")
    experts = start_script(RUN, json.dumps([(hf_model_dirs["qwen3_moe"][0], 2, False, True)]), "[]", "[]")
    _, stderr = heads.communicate(timeout=300)
    assert heads.returncode != 0 and "num_heads (5) is not divisible by tp_size (2)" in stderr
    assert "[rank1]" not in stderr  # refused before any other rank started
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    _, stderr = experts.communicate(timeout=300)
    assert experts.returncode != 0 and "num_experts (7) is not divisible by tp_size (2)" in stderr
    with pytest.raises(ValueError, match="kv_role does not work with tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=2, kv_role="decode")
    with pytest.raises(ValueError, match="distributed_executor_backend must be mp or ray"):
        EngineConfig(distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="expert_dispatch must be allreduce or all_to_all"):
        EngineConfig(enable_expert_parallel=True, expert_dispatch="deepep")
    with pytest.raises(ValueError, match="needs enable_expert_parallel"):
        EngineConfig(expert_dispatch="all_to_all")


RAY_RUN = """
import json, sys
import ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
from tokenmill import LLM, SamplingParams
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256,
          tensor_parallel_size=2, distributed_executor_backend="ray")
params = [SamplingParams(**p) for p in json.loads(sys.argv[2])]
outs = llm.generate(prompt_token_ids=json.loads(sys.argv[3]), sampling_params=params, use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outs]))
llm.engine.core.executor.shutdown()
ray.shutdown()
"""


@pytest.mark.slow  # a local Ray cluster's start-up: `make test-all` or -m slow
def test_ranks_as_ray_actors_equal_one_process(hf_model_dirs) -> None:
    """--distributed-executor-backend ray: the other rank is a Ray actor in a placement group on a local
    Ray cluster (as on a multi-node one), fed the same orders."""
    pytest.importorskip("ray")
    path = hf_model_dirs["qwen3"][0]
    assert run_script(RAY_RUN, path, PARAMS_JSON, json.dumps(PROMPTS)) == one_process(path)


OFFLOAD_RUN = """
import json, tempfile
from tokenmill import LLM
from tests.serving.test_kv_offload import run
# The CPU tier and its disk tier: each rank keeps its KV heads' share of the blocks evicted from a
# too-small pool, on a host tier of about one conversation, and spills the rest to its own file.
llm = LLM("default", dtype="float32", max_model_len=512, num_kv_blocks=40, kv_offload_gib=0.0055,
          kv_offload_disk=tempfile.mkdtemp(), kv_offload_disk_gib=0.05, tensor_parallel_size=3)
texts = run(llm)
kv = llm.engine.scheduler.kv
print(json.dumps({"texts": texts, "offload_hits": kv.offload_hits, "disk_hits": kv.disk_hits}))
llm.engine.core.executor.shutdown()
"""

POOLING_RUN = """
import json, sys
from tokenmill import LLM
# The pooling runner: the hidden states every rank holds after the last all-reduce.
llm = LLM(sys.argv[1], skip_tokenizer_init=True, dtype="float32", runner="pooling", tensor_parallel_size=2)
outputs = llm.embed(prompt_token_ids=json.loads(sys.argv[2]), use_tqdm=False)
print(json.dumps([o.outputs.embedding for o in outputs]))
llm.engine.core.executor.shutdown()
"""


@pytest.mark.slow  # ~17 s: its own rank processes; TP's numerics are the tests above, pooling's tests/models
def test_the_pooling_runner_under_tensor_parallelism(hf_model_dirs) -> None:
    import torch

    path = hf_model_dirs["qwen3"][0]
    got = run_script(POOLING_RUN, path, json.dumps(PROMPTS))
    alone = LLM(path, skip_tokenizer_init=True, dtype="float32", runner="pooling")
    want = [o.outputs.embedding for o in alone.embed(prompt_token_ids=PROMPTS, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # three ranks of the embedded model through eight chats on a small CPU
def test_the_cpu_and_disk_tiers_under_tensor_parallelism() -> None:
    from tests.serving.test_kv_offload import run

    got = run_script(OFFLOAD_RUN)
    assert got["texts"] == run(LLM("default", dtype="float32", max_model_len=512, num_kv_blocks=200))
    assert got["offload_hits"] >= got["disk_hits"] > 0  # every CPU-tier hit may have come through disk


DEAD_RANK_RUN = """
import os, sys
from pathlib import Path
import torch.distributed
from tokenmill import LLM, SamplingParams
from tokenmill.worker.tp_executor import RankDiedError

def ranks_alive():
    mine = str(os.getpid())
    return [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and (p / "stat").exists()
            and (p / "stat").read_text().rsplit(")", 1)[-1].split()[1] == mine]

# Refused as every rank builds its layers (GPTQ groups of 64 over o_proj's 32 columns a rank): the
# ranks and the group go with it.
try:
    LLM(sys.argv[2], skip_tokenizer_init=True, dtype="float32", max_model_len=256, tensor_parallel_size=2)
except ValueError as exc:
    print("start refused:", exc)
print("left behind:", torch.distributed.is_initialized(), ranks_alive())
llm = LLM(sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256, tensor_parallel_size=2)
(process,) = llm.engine.core.executor.ranks.processes
process.kill()
process.wait()
try:
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=4), use_tqdm=False)
except RankDiedError as exc:
    print("refused:", exc)
"""


def test_a_dead_rank_fails_the_next_step_instead_of_hanging(hf_model_dirs, tmp_path) -> None:
    """And first a start refused after its ranks started: nothing is left behind (the ranks, the process
    group; both were, and the next engine of the process could not start), and the next engine starts."""
    from tests.layers import test_gptq_awq

    test_gptq_awq.make_checkpoint("llama", "gptq", 64, tmp_path)
    done = python(DEAD_RANK_RUN, hf_model_dirs["llama"][0], str(tmp_path), timeout=120)
    refused = "start refused: quantization_config.group_size 64 does not divide"
    assert refused in done.stdout, done.stderr[-2000:]
    assert "left behind: False []" in done.stdout, done.stdout
    assert "refused: tensor-parallel rank 1 exited (code -9)." in done.stdout, done.stderr[-2000:]


GRAMMAR_RUN = """
import json
from tokenmill import LLM
from tests.worker.test_tensor_parallel import grammar_chat
llm = LLM("default", dtype="float32", max_model_len=512, tensor_parallel_size=3, async_scheduling=True)
print(json.dumps(grammar_chat(llm)))
llm.engine.core.executor.shutdown()
"""


def grammar_chat(llm) -> list[str]:
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}},
        "required": ["name"],
    }
    params = [
        SamplingParams(max_tokens=20, temperature=0, structured_outputs={"regex": "[a-z ]{3,15}"}),
        SamplingParams(max_tokens=30, temperature=0.8, seed=4, structured_outputs={"json": person}),
        SamplingParams(max_tokens=10, temperature=0),
    ]
    messages = [[{"role": "user", "content": "Name a fruit."}]] * 3
    return [o.outputs[0].text for o in llm.chat(messages, params, use_tqdm=False)]


@pytest.mark.slow  # three ranks of the embedded model on a small CPU
def test_structured_outputs_under_tensor_parallelism() -> None:
    """Rank 0's grammar masks reach every rank before it samples: constrained and free requests in one
    batch, async scheduling, write what one process writes."""
    got = run_script(GRAMMAR_RUN)
    assert got == grammar_chat(LLM("default", dtype="float32", max_model_len=512))


@pytest.mark.slow  # three checkpoints' ranks on a small CPU, ~40 s: `make test-all` or -m slow
def test_quantized_experts_equal_one_process(tmp_path) -> None:
    """Experts kept quantized (layers/quantization/moe_experts.py): FP8 per channel sliced along their
    width at TP=2 (down's columns: its scales are per row, whole), GPTQ 8-bit's int8 groups sliced with
    their groups' scales and zero points, INT4 with zero points held whole under expert parallelism (2
    of Mixtral's 4 experts a rank)."""
    pytest.importorskip("compressed_tensors")
    from tests.layers.test_moe_quantized import make_checkpoint

    runs: list[tuple] = []
    for arch, scheme, ep in (
        ("qwen3-moe", "ct-fp8-weight-only", False),
        ("mixtral", "gptq-8bit", False),
        ("mixtral", "ct-w4a16-zero-points", True),
    ):
        path = tmp_path / scheme
        path.mkdir()
        make_checkpoint(arch, scheme, path)
        runs.append((str(path), 2, False, ep))
    assert_runs_equal_one_process(runs)


def assert_runs_equal_one_process(runs: list[tuple]) -> None:
    """Each run (checkpoint path, tensor-parallel size, ...: RUN's arguments) in one script gives the
    greedy and seeded tokens of the checkpoint in one process, on prompts of a vocabulary of 256."""
    prompts = [[5, 17, 33, 2, 9, 11, 200], [7, 8], list(range(3, 60))]
    got = run_script(RUN, json.dumps(runs), PARAMS_JSON, json.dumps(prompts))
    for (path, *_), tokens in zip(runs, got, strict=True):
        llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=256)
        want = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
        assert tokens == [o.outputs[0].token_ids for o in want], path


@pytest.mark.slow  # six checkpoints' ranks on a small CPU, ~55 s: `make test-all` or -m slow
def test_block_scaled_fp8_and_gptq_awq_equal_one_process(tmp_path) -> None:
    """Fine-grained FP8 (weight_block_size, and compressed-tensors' FP8_BLOCK) at TP=2: each rank takes
    its rows' block scales (the k and v parts are 16 rows a rank, finer than the blocks of 32) and the
    row-parallel layers their columns'. Both had loaded the whole scale tensor, refused as the wrong
    shape. GPTQ and AWQ: the row-parallel layers take their columns' slice of the packed weight and whole
    groups of scales and zero points (refused at TP > 1 before). INT8 as the comment below says."""
    pytest.importorskip("compressed_tensors")
    from tests.layers import test_compressed_tensors, test_fp8_block, test_gptq_awq

    names = ("fine", "ct", "gptq", "awq", "int8", "gptq8")
    for name in names:
        (tmp_path / name).mkdir()
    test_fp8_block.make_checkpoint("llama", tmp_path / "fine")
    test_compressed_tensors.make_checkpoint("llama", "fp8-block", tmp_path / "ct")
    test_gptq_awq.make_checkpoint("llama", "gptq", 32, tmp_path / "gptq")
    test_gptq_awq.make_checkpoint("llama", "awq", 32, tmp_path / "awq")
    # INT8 (W8A8 with a static input scale): row-parallel layers take their columns of the int8 weight
    # (an 8-bit packed one is unpacked whole first: the same slicing), every rank all of the row scales.
    # (Dynamic per-token scales differ by design: a row-parallel rank scales the input columns it holds.)
    test_compressed_tensors.make_checkpoint("llama", "int8-tensor-static", tmp_path / "int8")
    test_gptq_awq.make_checkpoint("llama", "gptq", 32, tmp_path / "gptq8", bits=8)  # GPTQ's 8-bit groups
    assert_runs_equal_one_process([(str(tmp_path / name), 2, False) for name in names])
