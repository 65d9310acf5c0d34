"""A CPU platform for verl 0.9.1, loaded through verl's own ``VERL_USE_EXTERNAL_MODULES``.

verl resolves its device through a platform registry and falls back to CUDA when no accelerator
is found (``plugin/platform/platform_manager.py``); this module registers a ``cpu`` platform and
selects it with ``VERL_PLATFORM=cpu``. verl imports it at ``import verl`` in every process
(the test, and each Ray worker through the runtime environment), before any engine module:

* device ``cpu``, a device-module shim (``torch.cpu`` lacks ``empty_cache``, the memory counters
  and the RNG state calls verl makes), no IPC, Ray's accelerator resource kept as ``GPU`` (the
  test gives Ray one logical GPU per worker, so verl's placement groups resolve unchanged);
* gloo for the process group: verl builds ``"cpu:gloo,<device>:<backend>"``, which torch refuses
  as ``"cpu:gloo,cpu:gloo"``, so the group is made with ``gloo`` alone;
* the reference model's CPU offload without pinned memory (``pin_memory`` needs an accelerator);
* the in-process HF rollout (:mod:`.hf_rollout`) registered as rollout ``hf``.

Environment (set by :func:`environment`): ``VERL_PLATFORM=cpu``, ``VERL_ENGINE_DEVICE=cuda``
(verl registers its FSDP engines for cuda and npu only; the engine code itself goes through the
platform layer).
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager

import torch

from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

MODULE = __name__


def environment(tests_dir: str) -> dict[str, str]:
    """Variables that make verl load this platform, in this process and in Ray workers."""
    return {"VERL_USE_EXTERNAL_MODULES": MODULE, "VERL_PLATFORM": "cpu",
            "VERL_ENGINE_DEVICE": "cuda", "PYTHONPATH": tests_dir,
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def activate() -> None:
    """Use this platform in the current process even if verl resolved another one before
    (a test process may have imported verl before this module)."""
    from verl.plugin.platform import platform_manager

    if not isinstance(platform_manager._current_platform, PlatformCPU):
        platform_manager.set_platform(PlatformCPU())


def _no_op(*args, **kwargs):
    return None


def _memory_info():
    """(free, total) bytes of host memory, for verl's ``mem_get_info`` calls."""
    pages, free = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
    size = os.sysconf("SC_PAGE_SIZE")
    return free * size, pages * size


def _device_module() -> types.ModuleType:
    """``torch.cpu`` with the calls verl makes on its device module and ``torch.cpu`` lacks."""
    module = types.ModuleType("verl_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(module, name, getattr(torch.cpu, name))
    for name in ("empty_cache", "ipc_collect", "set_per_process_memory_fraction",
                 "reset_peak_memory_stats", "manual_seed", "manual_seed_all"):
        setattr(module, name, _no_op)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated",
                 "max_memory_reserved"):
        setattr(module, name, lambda *args, **kwargs: 0)
    module.mem_get_info = lambda *args, **kwargs: _memory_info()
    module.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    module.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    module.get_device_name = lambda *args, **kwargs: "cpu"
    module.is_available = lambda: True
    return module


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on the host CPU (gloo, no IPC)."""

    _module = _device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return True

    def current_device(self):
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def _gloo_process_group() -> None:
    """verl's ``initialize_global_process_group_ray`` with ``gloo`` as the only backend."""
    from verl.utils import distributed

    original = distributed.initialize_global_process_group_ray

    def initialize(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend="gloo")

    distributed.initialize_global_process_group_ray = initialize


def _unpinned_cpu_offload() -> None:
    """FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` (verl's reference model) without pinning."""
    from verl.utils import fsdp_utils

    pinned = fsdp_utils.CPUOffloadPolicy

    class UnpinnedOffloadPolicy(pinned):
        def __init__(self, pin_memory: bool = True):
            super().__init__(pin_memory=False)

    fsdp_utils.CPUOffloadPolicy = UnpinnedOffloadPolicy


def _register_hf_rollout() -> None:
    """Rollout ``hf`` in verl's two registries: the worker-side adapter and the replica."""
    import importlib

    from verl.workers.rollout import base, replica

    package = __name__.rsplit(".", 1)[0]
    base._ROLLOUT_REGISTRY[("hf", "async")] = f"{package}.hf_rollout.HFServerAdapter"
    replica.RolloutReplicaRegistry.register(
        "hf", lambda: importlib.import_module(f"{package}.hf_rollout").HFReplica)


_gloo_process_group()
_unpinned_cpu_offload()
_register_hf_rollout()
