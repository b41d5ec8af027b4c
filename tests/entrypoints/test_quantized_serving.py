"""A quantized checkpoint through `tokenmill serve`, as a vLLM user runs one: Model Optimizer FP8 (made by
nvidia-modelopt itself) with its KV cache scales, served with vLLM's flags to the official openai client;
and the checkpoints the engine refuses, each one error line naming the field and no traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams

from .openai.conftest import REPO, ServerProcess

pytest.importorskip("modelopt.torch.quantization")
from tests.layers.test_modelopt import as_hf_quant_config_only, make_checkpoint  # noqa: E402

PROMPT = [3, 17, 250, 9, 41, 77]
ENGINE_ARGS = [
    "--skip-tokenizer-init",
    "--dtype",
    "float32",
    "--max-model-len",
    "64",
    "--num-kv-blocks",
    "16",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("modelopt-fp8")
    make_checkpoint("llama", path, kv=True)
    return path


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # --quantization fp8 on an FP8 checkpoint, as vLLM users pass it: taken as the checkpoint's own.
    args = ["--model", str(checkpoint), "--quantization", "fp8", "--kv-cache-dtype", "fp8", *ENGINE_ARGS]
    process = ServerProcess(args, tmp_path_factory.mktemp("server") / "server.log")
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def test_completions_equal_the_offline_engine(server: ServerProcess, checkpoint: Path) -> None:
    client = server.client()
    (model,) = client.models.list().data
    assert model.id == str(checkpoint)
    reply = client.completions.create(model=model.id, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    served = [int(token.removeprefix("token_id:")) for token in reply.choices[0].logprobs.tokens]
    llm = LLM(
        str(checkpoint), skip_tokenizer_init=True, dtype="float32", max_model_len=64, kv_cache_dtype="fp8"
    )
    (want,) = llm.generate(
        prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=6, temperature=0), use_tqdm=False
    )
    assert served == want.outputs[0].token_ids
    assert "fp8 KV cache with the checkpoint's per-layer K and V scales" in server.log_text()
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'num_gpu_blocks="16"' in metrics


def refused_checkpoints(checkpoint: Path, root: Path) -> dict[str, tuple[list[str], str]]:
    """{case: (serve arguments, the error line)} for checkpoints and flags the engine refuses."""
    nvfp4 = root / "nvfp4"  # the older form: hf_quant_config.json beside a config without quantization_config
    missing = root / "missing-scale"
    for path in (nvfp4, missing):
        path.mkdir()
        for name in ("config.json", "hf_quant_config.json", "model.safetensors"):
            (path / name).write_bytes((checkpoint / name).read_bytes())
    as_hf_quant_config_only(nvfp4, quant_algo="NVFP4")
    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.input_scale"]
    save_file(tensors, str(missing / "model.safetensors"))
    return {
        "mismatch": (
            ["--model", str(checkpoint), "--quantization", "gptq"],
            "error: quantization='gptq' does not match the checkpoint, which is quantized with "
            "quantization_config.quant_method 'modelopt'; drop --quantization.",
        ),
        "nvfp4": (
            ["--model", str(nvfp4)],
            "error: hf_quant_config.json quantization.quant_algo 'NVFP4' is not",
        ),
        "missing-scale": (
            ["--model", str(missing)],
            "error: checkpoint is missing 1 tensors, e.g. ['model.layers.1.mlp.down_proj.input_scale'].",
        ),
    }


# Each case is a server process of its own (~8 s of the suite's two cores): the one refused while its
# weights load in the default set, the two refused from the config under -m slow (their messages are
# tests/layers' in process).
@pytest.mark.parametrize(
    "refused",
    [pytest.param("mismatch", marks=pytest.mark.slow), pytest.param("nvfp4", marks=pytest.mark.slow),
     "missing-scale"],
)  # fmt: skip
def test_refused_checkpoints_are_one_error_line(refused: str, checkpoint: Path, tmp_path: Path) -> None:
    args, error = refused_checkpoints(checkpoint, tmp_path)[refused]
    serve = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--port", "0", *ENGINE_ARGS]
    done = subprocess.run(
        [*serve, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, timeout=120
    )
    output = done.stdout
    assert done.returncode == 2, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(error), output
    assert "Traceback" not in output, output
