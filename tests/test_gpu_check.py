"""The CPU-runnable parts of `make test-gpu` (tools/gpu_check.py): argument parsing, the wheel
budget, the JSON/table report, the benchmark harness and its profiler counts at tiny sizes, the
verl-style vectorised baseline against the reference, the offline stand-ins and the model with a
resized vocabulary."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))
import gpu_bench  # noqa: E402
import gpu_check  # noqa: E402
from bench_common import RoundInputs  # noqa: E402
from gpu_baselines import VectorisedSelector  # noqa: E402

from lze_kernels import LZEConfig, LZESelector  # noqa: E402
from lze_kernels import layout as L  # noqa: E402

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- arguments


def test_run_arguments():
    args = gpu_check.parse_args(["run", "--stages", "bench,trainer", "--batches", "256,65536"])
    assert args.stages == ["bench", "trainer"] and args.batches == [256, 65536]
    assert gpu_check.parse_args(["run"]).stages == list(gpu_check.STAGES)


@pytest.mark.parametrize("argv", [["run", "--stages", "kernels,vllm"], ["run", "--stages", ","],
                                  ["run", "--batches", "256,x"], ["run", "--batches", "0"]])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(argv)
    assert exc.value.code == 2
    assert argv[1] in capsys.readouterr().err


# ----------------------------------------------------------------------------- wheels


def test_wheel_budget(tmp_path):
    (tmp_path / "a.whl").write_bytes(b"x" * 3 * 2**20)
    (tmp_path / "b.tar.gz").write_bytes(b"x" * 2**20)
    report = gpu_check.wheel_budget(tmp_path, budget_mib=4)
    assert report["total_bytes"] == 4 * 2**20 and report["within_budget"]
    assert list(report["files"]) == ["a.whl", "b.tar.gz"]  # largest first
    over = gpu_check.wheel_budget(tmp_path, budget_mib=3.9)
    assert not over["within_budget"] and "OVER" in gpu_check.format_budget(over)


def test_wheel_pins_match_the_cuda_set():
    """Every wheel brought is the version the CUDA pinned set resolves to (where it has it)."""
    pins = {}
    for line in (ROOT / "requirements" / "constraints-cuda.txt").read_text().splitlines():
        req = line.split("#")[0].strip()
        if "==" in req:
            name, version = req.split("==")
            pins[name.lower()] = version
    checked = 0
    for req, how in gpu_check.WHEELS:
        assert how in ("binary", "built"), req
        name, version = req.split("==")
        if name.lower() in pins:
            assert pins[name.lower()] == version, req
            checked += 1
    assert checked >= len(gpu_check.WHEELS) - 2  # wheel is not in the set


# ----------------------------------------------------------------------------- report


def _results():
    rows = gpu_bench.with_ratios([
        {"B": 256, "G": 16, "variant": "fused_cuda", "seconds": 2e-5, "launches": 2, "syncs": 0},
        {"B": 256, "G": 16, "variant": "verl_vectorised", "seconds": 1e-3, "launches": 40,
         "syncs": 3}])
    return {"machine": {"device": "NVIDIA H100", "torch": "2.11.0", "triton": "3.6.0"},
            "stages": {"kernels": {"status": "passed", "tests": 30, "failures": 0, "skipped": 0,
                                   "backends": ["torch", "cuda", "triton"], "seconds": 40.0},
                       "bench": {"status": "passed", "device": "cuda", "rows": rows},
                       "trainer": {"status": "failed", "error": "RuntimeError: boom",
                                   "peak_memory_gib": {"rollout": 5.25, "update": 3.5}}}}


def test_report_json_and_table(tmp_path):
    json_path, table = gpu_check.write_report(_results(), tmp_path)
    assert json.loads(json_path.read_text()) == _results()
    assert (tmp_path / "gpu_check.md").read_text() == table + "\n"
    assert "| kernels | passed | 40.0 | 30 tests, 0 failed, 0 skipped; backends torch,cuda,triton |" \
        in table
    assert "| 256 | 1.00x (2, 0) | 50.00x (40, 3) |" in table
    assert "| rollout | 5.25 |" in table and "RuntimeError: boom" in table


def test_junit_counts(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite tests="5" failures="1" errors="0" skipped="2">'
                   '</testsuite></testsuites>')
    assert gpu_check.junit_counts(xml) == {"tests": 5, "failures": 1, "errors": 0, "skipped": 2}


# ----------------------------------------------------------------------------- benchmark harness


def test_benchmark_harness_on_cpu():
    variants = ["fused_cpu", "torch_eager", "verl_vectorised"]
    assert gpu_bench.variants_for(CPU, include_compile=False) == variants
    rows = gpu_bench.run(CPU, batches=[64, 128], group=4, rounds=2, variants=variants,
                         log=lambda _: None)
    assert [(r["B"], r["variant"]) for r in rows] == [(b, v) for b in (64, 128) for v in variants]
    for row in rows:
        assert row["seconds"] > 0 and row["launches"] == 0  # no device events on a CPU
    by = {(r["B"], r["variant"]): r for r in rows}
    assert by[64, "fused_cpu"]["ratio_to_fused"] == 1.0
    # The selector's step never reads the device; the verl-style step does, three times per step.
    assert by[64, "fused_cpu"]["syncs"] == by[64, "torch_eager"]["syncs"] == 0
    assert by[64, "verl_vectorised"]["syncs"] == 3


def test_sync_count_sees_each_host_read():
    def step(rewards, prompt_ids):
        total = rewards.sum()
        float(total)  # one .item()
        return rewards[rewards > 0]  # boolean mask: a nonzero

    counts = gpu_bench.profile_step(step, RoundInputs(8, 4, CPU), CPU)
    assert counts == {"launches": 0, "syncs": 2}


def test_unknown_variant_is_named():
    with pytest.raises(ValueError, match="variant: expected one of"):
        gpu_bench.build_step("magic", 8, CPU)


# ----------------------------------------------------------------------------- verl baseline


@pytest.mark.parametrize("group, noise_scale", [(8, 0.05), (8, 0.0), (3, 0.05)])
def test_vectorised_baseline_matches_reference(group, noise_scale):
    num_prompts, batch = 96, 48
    config = LZEConfig(noise_scale=noise_scale)
    ours = VectorisedSelector(num_prompts, config)
    ref = LZESelector(num_prompts, config=config, backend="torch")
    g = torch.Generator().manual_seed(group)
    for _ in range(6):
        p_correct = torch.rand(batch, 1, generator=g)
        p_correct[::3] = 1.0  # some prompts solved twice: streaks and pruning
        rewards = (torch.rand(batch, group, generator=g) < p_correct).float()
        ids = torch.randperm(num_prompts, generator=g)[:batch]
        got, want = ours.step(rewards, ids), ref.step(rewards, ids)
        torch.testing.assert_close(got.advantages, want.advantages, rtol=1e-5, atol=1e-6)
        assert torch.equal(got.pass_rate, want.pass_rate)
        assert torch.equal(got.energy, want.energy)
        assert torch.equal(got.momentum, want.momentum)
        assert got.num_kept == int(want.num_kept)
        kept = want.kept_indices[: got.num_kept]
        # topk may break exact ties differently: the kept energies are the same multiset
        assert torch.equal(want.energy[got.kept_indices].sort().values,
                           want.energy[kept].sort().values) or noise_scale > 0
        if noise_scale > 0:
            assert torch.equal(got.kept_indices.sort().values, kept.sort().values)
    torch.testing.assert_close(ours.ema[:num_prompts], ref.state.fstate[:num_prompts, L.EMA])
    assert torch.equal(ours.seen, ref.state.istate[:num_prompts, L.SEEN].long())
    assert torch.equal(ours.pruned, (ref.state.istate[:num_prompts, L.FLAGS]
                                     & L.FLAG_PRUNED) != 0)
    assert ours.pruned.any()


# ----------------------------------------------------------------------------- trainer stage


def _stand_in(name):
    spec = importlib.util.spec_from_file_location(name, gpu_check.STAND_INS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_datasets_stand_in_loads_jsonl_like_datasets(tmp_path, monkeypatch):
    from lze_trainer.data import load_prompts

    data = gpu_check.write_arithmetic_jsonl(tmp_path / "train.jsonl", 12)
    real = load_prompts(str(data), limit=10).to_list()
    monkeypatch.setitem(sys.modules, "datasets", _stand_in("datasets"))
    assert load_prompts(str(data), limit=10).to_list() == real
    assert real[3]["messages"][0]["content"].startswith("Calculate ")


def test_stand_ins_only_where_the_package_is_missing(monkeypatch):
    monkeypatch.delitem(sys.modules, "datasets", raising=False)  # find_spec reads it first
    monkeypatch.syspath_prepend(str(gpu_check.STAND_INS))  # ahead of the venv's packages here
    assert gpu_check.stand_ins_used() == ["datasets"]
    monkeypatch.undo()
    assert gpu_check.stand_ins_used() == []  # the venv has the real package


def test_model_with_real_size_vocabulary(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    texts = gpu_check._texts(gpu_check.write_arithmetic_jsonl(tmp_path / "t.jsonl", 32))
    folder = gpu_check.build_model(tmp_path / "m", texts, vocab=1000,
                                   spec="tiny:qwen2?hidden=32&layers=1&heads=1&kv_heads=1&vocab=300")
    config = AutoConfig.from_pretrained(folder)
    assert config.vocab_size == 1000 and config.tie_word_embeddings
    assert len(AutoTokenizer.from_pretrained(folder)) < 1000


def test_phase_memory_is_a_no_op_without_cuda():
    from lze_trainer import metrics

    record = {}
    before = metrics.Timer.__call__
    with gpu_check.phase_memory(record):
        timer = metrics.Timer()
        with timer("rollout"):
            pass
    assert record == {} and metrics.Timer.__call__ is before and "rollout" in timer.seconds
