"""backend='auto' chooses a compiled module only after a probe launch on the device succeeded:
the CUDA module links cudart statically and imports under a driver too old for it (every launch
then returns error 35). The GPU side is simulated: the probe result, or the module's status."""

import warnings

import pytest
import torch

from lze_kernels import dispatch, native

CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu_auto(monkeypatch):
    """``auto`` on a (simulated) cuda:0 with both GPU backends importable; returns the list of
    devices the CUDA probe was asked about."""
    probed = []
    monkeypatch.delenv("LZE_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "_warned_probes", set())
    monkeypatch.setattr(dispatch, "_warned_fallbacks", set())
    for name in ("cuda", "triton"):
        monkeypatch.setattr(dispatch.BACKENDS[name], "available", lambda: True)
    return probed


def _probe_result(monkeypatch, probed, error):
    def launch_error(device):
        probed.append(device)
        return error
    monkeypatch.setattr(dispatch.BACKENDS["cuda"], "launch_error", launch_error)


def test_auto_chooses_cuda_when_its_probe_launch_runs(gpu_auto, monkeypatch):
    _probe_result(monkeypatch, gpu_auto, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.resolve("auto", CUDA) is dispatch.BACKENDS["cuda"]
    assert gpu_auto == [CUDA]


def test_auto_falls_back_to_triton_when_the_probe_launch_fails(gpu_auto, monkeypatch):
    _probe_result(monkeypatch, gpu_auto, "lze_kernels: topk (cuda) failed with error code 35")
    with pytest.warns(RuntimeWarning, match=r"skips 'cuda' on cuda:0.*error code 35.*driver") as rec:
        assert dispatch.resolve("auto", CUDA) is dispatch.BACKENDS["triton"]
    assert len(rec) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once
        assert dispatch.resolve("auto", CUDA) is dispatch.BACKENDS["triton"]


def test_failed_probe_without_triton_falls_back_to_torch_naming_the_probe(gpu_auto, monkeypatch):
    monkeypatch.setattr(dispatch.BACKENDS["triton"], "available", lambda: False)
    monkeypatch.setattr(native.CUDA, "_module", object())
    monkeypatch.setattr(native.CUDA, "_launch_errors", {"cuda:0": "error code 35"})
    with pytest.warns(RuntimeWarning) as rec:
        assert dispatch.resolve("auto", CUDA) is dispatch.BACKENDS["torch"]
    messages = " | ".join(str(w.message) for w in rec)
    assert "skips 'cuda'" in messages
    assert "_lze_cuda cannot launch (cuda:0: error code 35)" in messages


class _StatusModule:
    """A compiled module whose launches return ``status`` (35: cudaErrorInsufficientDriver)."""

    def __init__(self, status):
        self.status, self.calls = status, 0

    def topk(self, *args):
        self.calls += 1
        return self.status


@pytest.mark.parametrize("status, expected", [(0, None), (35, "error code 35")])
def test_probe_is_one_launch_per_device_and_reads_its_status(monkeypatch, status, expected):
    """The real probe, through the custom op, on a NativeBackend whose module is replaced (the
    emulated-CUDA backend: its op runs on CPU tensors)."""
    module = _StatusModule(status)
    backend = native.CUDA_EMULATED
    monkeypatch.setattr(backend, "_module", module)
    monkeypatch.setattr(backend, "_launch_errors", {})
    cpu = torch.device("cpu")
    for _ in range(3):
        error = backend.launch_error(cpu)
        assert error is None if expected is None else expected in error
    assert module.calls == 1


@pytest.mark.skipif(not native.CUDA_EMULATED.available(), reason="_lze_cuda_emu not built")
def test_probe_of_a_working_module_launches_cleanly(monkeypatch):
    monkeypatch.setattr(native.CUDA_EMULATED, "_launch_errors", {})
    assert native.CUDA_EMULATED.launch_error(torch.device("cpu")) is None


def test_the_kernel_package_has_no_import_circle():
    """No module of lze_kernels (the integrations aside) imports, at any depth, one that
    imports it back; dispatch once imported dots, which imports dispatch (a lazy import kept the
    circle from failing)."""
    import ast
    from pathlib import Path

    root = Path(dispatch.__file__).parent
    modules = {path: "lze_kernels." + ".".join(path.relative_to(root).with_suffix("").parts)
               for path in [*root.glob("*.py"), *root.glob("triton_kernels/*.py")]}
    names = {name.removesuffix(".__init__") for name in modules.values()}
    edges = {}
    for path, name in modules.items():
        package = name.rsplit(".", 1)[0] if not name.endswith("__init__") else name[:-9]
        name = name.removesuffix(".__init__")
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    targets.add(candidate if candidate in names else base)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        edges[name] = {t for t in targets if t in names and t != name}

    def reaches(start, goal, seen):
        return any(t == goal or (t not in seen and reaches(t, goal, seen | {t}))
                   for t in edges.get(start, ()))

    circles = sorted(name for name in edges if reaches(name, name, {name}))
    assert circles == [], circles
