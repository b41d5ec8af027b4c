"""A stream that waits for the host (kernels/host_wait.py): work queued behind the wait does not run until
the host publishes, then reads what the host wrote after queueing it. And the engine's grammar steps that
use it (their masked sampling queued with the forward pass, the masks filled later) write exactly the
tokens of the path that queues the sampling only once the masks are in."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TOKENIZER = Path(__file__).resolve().parents[2] / ".gpu_assets" / "tokenizer"


def test_the_stream_runs_what_follows_the_wait_once_the_host_publishes() -> None:
    from tokenmill.kernels.host_wait import wait_for_host

    counter = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    host = torch.zeros(3, 1001, dtype=torch.int32, pin_memory=True)
    # Allocated before the wait is queued: a cudaMalloc behind a pending wait blocks until it ends.
    on_device, doubled = torch.empty_like(host, device="cuda"), torch.empty_like(host, device="cuda")
    done = torch.cuda.Event()
    # Every kernel loaded before a wait is pending: CUDA loads a module at its first launch (lazy
    # loading), and loading waits for the device, so it would wait for the wait (here: until it gives up).
    wait_for_host(counter, 0)
    on_device.copy_(host, non_blocking=True)
    torch.mul(on_device, 2, out=doubled)
    torch.cuda.synchronize()
    for target in (5, 9):  # the counter only grows: the second wait is for a later value
        wait_for_host(counter, target)
        on_device.copy_(host, non_blocking=True)
        torch.mul(on_device, 2, out=doubled)
        done.record()
        time.sleep(0.05)
        assert not done.query(), (target, counter.tolist())  # the stream is held at the wait
        expected = torch.randint(-(2**30), 2**30, host.shape, dtype=torch.int32)
        host.copy_(expected)  # written after the copy was queued
        counter[0] = target
        done.synchronize()
        assert torch.equal(doubled.cpu(), expected * 2)
    assert counter[1] == 0


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_masking_kernel_waits_then_reads_each_steps_masks_from_host_memory(dtype, staged) -> None:
    """apply_bitmask_from_host against the torch masking: logits a slice of wider rows (as the LM head's
    padded vocabulary leaves them) and wider than the mask's words (the tokens past them are forbidden),
    rows picked out of order, masks written into the same pinned buffer step after step (a stale read of
    an earlier step's words would show), each after the kernel was queued and published from another
    thread."""
    from tokenmill.kernels.host_wait import apply_bitmask_from_host
    from tokenmill.structured_outputs import apply_bitmask

    gen = torch.Generator().manual_seed(0)
    vocab, words = 1030, 32  # 1030 tokens, masks for 1024
    counter = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    host = torch.zeros(5, words, dtype=torch.int32, pin_memory=True)
    rows = torch.tensor([6, 0, 3, 7, 2], device="cuda")
    wide = torch.randn(8, 1040, generator=gen).to(dtype).cuda()
    staging = torch.empty(host.shape, dtype=torch.int32, device="cuda") if staged else None
    apply_bitmask_from_host(wide[:, :vocab], rows, host, counter, 0, staging)  # compiled, loaded, no wait
    torch.cuda.synchronize()
    for step in range(1, 6):
        wide = torch.randn(8, 1040, generator=gen).to(dtype).cuda()
        logits = wide[:, :vocab]
        expected = logits.cpu()
        apply_bitmask_from_host(logits, rows, host, counter, step, staging)
        done = torch.cuda.Event()
        done.record()
        masks = torch.randint(-(2**31), 2**31 - 1, (5, words), generator=gen, dtype=torch.int64)
        masks = masks.to(torch.int32)

        def publish(masks=masks, step=step) -> None:
            time.sleep(0.02)
            host.copy_(masks)
            counter.numpy()[0] = step

        threading.Thread(target=publish).start()
        done.synchronize()
        apply_bitmask(expected, rows.cpu(), masks)
        assert torch.equal(logits.cpu(), expected), step
        assert torch.equal(wide[:, vocab:].cpu().isinf().any(), torch.tensor(False))  # nothing past the slice
    assert counter[1] == 0


def test_a_wait_published_from_another_thread_while_this_one_blocks() -> None:
    from tokenmill.kernels.host_wait import wait_for_host

    counter = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    wait_for_host(counter, 7)
    threading.Timer(0.05, lambda: counter.numpy().__setitem__(0, 7)).start()
    big = torch.ones(1 << 28, dtype=torch.int8, device="cuda")  # a cudaMalloc: returns after the publish
    torch.cuda.synchronize()
    assert big[-1].item() == 1 and counter[1] == 0


def test_a_wait_never_published_gives_up_and_says_so() -> None:
    from tokenmill.kernels.host_wait import _wait_kernel

    counter = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    _wait_kernel[(1,)](counter, 1, 10**6, num_warps=1)  # compiled and warm
    torch.cuda.synchronize()
    counter[1] = 0
    start = time.perf_counter()
    _wait_kernel[(1,)](counter, 1, 50 * 10**6, num_warps=1)
    torch.cuda.synchronize()
    assert counter.tolist() == [0, 1] and 0.045 < time.perf_counter() - start < 1.0


@pytest.mark.skipif(not TOKENIZER.is_dir(), reason="needs the tokenizer of benchmarks/gpu/prepare.sh")
def test_grammar_steps_queued_before_their_masks_write_what_the_waiting_loop_writes(
    tmp_path, monkeypatch
) -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.worker.step_output import AwaitingGrammar

    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    for f in TOKENIZER.iterdir():
        shutil.copy(f, tmp_path / f.name)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer"}}, "required": ["name", "age"]}  # fmt: skip
    params = [
        SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": schema}),
        SamplingParams(
            max_tokens=24, temperature=0.9, seed=4, structured_outputs={"regex": "[a-z]{3,9}@x\\.org"}
        ),
        SamplingParams(max_tokens=6, temperature=0, structured_outputs={"choice": ["red", "green", "blue"]}),
        SamplingParams(max_tokens=30, temperature=0),
    ] * 6  # fmt: skip
    prompts = [f"request {i}: write it." for i in range(len(params))]

    def run() -> list[list[int]]:
        options = dict(max_model_len=512, max_num_seqs=16, seed=0, gpu_memory_utilization=0.2)
        llm = LLM(str(tmp_path), load_format="dummy", **options)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for o, p in zip(outputs, params):
            text = o.outputs[0].text
            if p.structured_outputs is not None and o.outputs[0].finish_reason == "stop":
                so = p.structured_outputs
                if so.regex is not None:
                    assert re.fullmatch(so.regex, text)
                elif so.choice is not None:
                    assert text in so.choice
                else:
                    assert set(json.loads(text)) == {"name", "age"}
        del llm
        return [list(o.outputs[0].token_ids) for o in outputs]

    deferred = run()
    monkeypatch.setattr(AwaitingGrammar, "host_masks", lambda self, words: None)
    assert run() == deferred
