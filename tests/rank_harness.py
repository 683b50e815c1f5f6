"""What the collective-sync tests share (trainer ranks in processes, or in Ray actors): the
trainer's weights after each step, and an FSDP2 model's local shards set from them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def join_group(rank: int, world: int, ports: Any) -> None:
    """Start the default gloo group of ``world`` spawned processes: rank 0's store binds a
    free port itself and tells the other ranks through ``ports`` (a spawn context's
    ``Queue``), so no port is picked and then raced for."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    if rank == 0:
        store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        for _ in range(world - 1):
            ports.put(store.port)
    else:
        port = ports.get(timeout=120)
        store = TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def new_weights(full: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """The trainer's weights after ``step`` (the same on every rank): a few percent of each
    tensor's elements move; names of one tensor (tied) stay one tensor."""
    gen = torch.Generator().manual_seed(100 + step)
    out: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}
    for name, tensor in full.items():
        if id(tensor) not in made:
            picked = torch.rand(tensor.shape, generator=gen) < 0.03
            made[id(tensor)] = tensor + picked * torch.randn(tensor.shape, generator=gen) * 0.05
        out[name] = made[id(tensor)]
    return out


def set_shards(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Each DTensor parameter's local shard from ``full`` (FSDP2 splits dim 0 in chunks)."""
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for name, param in model.state_dict(keep_vars=True).items():
            if isinstance(param, DTensor):
                local = param.to_local()
                chunk = -(-full[name].shape[0] // world)
                local.copy_(full[name][rank * chunk : rank * chunk + local.shape[0]])
            else:
                param.copy_(full[name])


def fsdp2_model(path: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The checkpoint at ``path`` sharded by FSDP2 over the default group (on CPU), and its
    full weights as loaded (tied names share one copy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    copies: dict[int, torch.Tensor] = {}
    full = {
        n: copies.setdefault(t.data_ptr(), t.detach().clone())
        for n, t in model.state_dict().items()
    }
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, full
