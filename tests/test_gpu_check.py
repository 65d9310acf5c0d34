"""The CPU-runnable parts of the GPU check (tools/gpu_check.py: `make test-gpu`, or
`bash tools/gpu_check.sh REPORT_DIR`, on a machine with one GPU): arguments, the install stage on
what is installed, the report after each stage, the benchmark harness and its floors, the
verl-style vectorised baseline, the memory arithmetic, the trainer stage's model, and one dry run
of the whole script shared by the tests at its end: from a read-only copy of the tree, the
report folder named, the CUDA stages skipped with the reason and the peer stage run shrunken
(tools/gpu_peer.py's trainers in their own processes). The offline path: tests/test_gpu_offline.py."""

import importlib.metadata as md
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))
import gpu_bench  # noqa: E402
import gpu_check  # noqa: E402
import gpu_offline  # noqa: E402
import gpu_peer  # noqa: E402
import gpu_report  # noqa: E402
import gpu_workload  # noqa: E402
from bench_common import RoundInputs  # noqa: E402
from torch_baselines import PlainTorchSelector, VectorisedSelector  # noqa: E402

from lze_kernels import LZEConfig, LZESelector  # noqa: E402
from lze_kernels import layout as L  # noqa: E402

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- arguments


def test_cap_scale(monkeypatch):
    monkeypatch.setenv("GPU_CHECK_CAP_SCALE", "2.5")
    assert gpu_check.stage_cap("install") == 2.5 * gpu_check.STAGE_CAP_S["install"]
    monkeypatch.setenv("GPU_CHECK_CAP_SCALE", "0")
    with pytest.raises(ValueError, match="GPU_CHECK_CAP_SCALE: expected a number > 0"):
        gpu_check.stage_cap("install")


def test_check_arguments():
    args = gpu_check.parse_args(["check", "--report", "r", "--stages", "bench,trainer",
                                 "--batches", "256,65536", "--peer-sizes", "qwen2.5-0.5b"])
    assert args.stages == ["bench", "trainer"] and args.batches == [256, 65536]
    assert args.peer_sizes == ["qwen2.5-0.5b"]
    default = gpu_check.parse_args(["check", "--report", "r"])
    assert default.stages == list(gpu_check.STAGES) and default.peer_sizes is None
    assert default.work == Path("/tmp/gpu_check") and default.report == Path("r")
    # what is installed, no budget: the offline path's wheels and budget are named when wanted
    assert default.wheels is None and default.budget is None
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["check"])  # the report folder is always named


def test_every_stage_has_a_cap_in_order():
    assert set(gpu_check.STAGE_CAP_S) == set(gpu_check.STAGES)
    assert list(gpu_check.STAGES)[:6] == ["preflight", "install", "hazards", "kernels", "trainer",
                                          "bench"]
    assert set(gpu_check.NEEDS_CUDA) < set(gpu_check.STAGES) and "peer" not in gpu_check.NEEDS_CUDA


@pytest.mark.parametrize("argv", [["check", "--stages", "kernels,vllm"],
                                  ["check", "--stages", ","], ["check", "--batches", "256,x"],
                                  ["check", "--batches", "0"], ["check", "--peer-sizes", "7b"]])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args([*argv, "--report", "r"])
    assert exc.value.code == 2
    assert argv[1] in capsys.readouterr().err


def test_preflight_expects_the_pinned_cuda_set():
    """What is installed is compared with requirements/constraints-cuda.txt (what `make
    setup-gpu` installs), on the offline path too."""
    expected = gpu_check.expected_versions()
    assert expected["torch"] == "2.13.0" and expected["trl"] == "1.16.0"
    assert set(expected) == set(gpu_check.COMPARED_PACKAGES)


def test_the_tree_commit_is_recorded(monkeypatch):
    commit = gpu_check.tree_commit()
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
    assert commit.rstrip("+") == head


# ----------------------------------------------------------------------------- report


def _results():
    """A small fake run: every stage, with goals met and missed."""
    case = [("fused_cuda", 8e-6, 4, 0), ("fused_triton", 3e-5, 7, 0),
            ("fused_cuda_default", 1.2e-5, 4, 0), ("fused_cuda_graph", 5e-6, 4, 0),
            ("lean_eager", 2e-4, 40, 0), ("lean_compile", 1e-5, 6, 0), ("lean_graph", 8e-6, 6, 0),
            ("parity_eager", 1e-3, 60, 0)]
    rows = []
    for batch in (256, 65536, 1048576):
        rows += gpu_bench.with_ratios([{"B": batch, "G": 16, "variant": v, "seconds": t,
                                        "launches": n, "syncs": k} for v, t, n, k in case])
    floors = {str(b): {"bytes": gpu_bench.step_bytes(b, 16), "launch_s": 5e-6, "hbm_s": 3e-6,
                       "graph_launch_s": 4e-6, "records_s": 4e-6}
              for b in (256, 65536, 1048576)}
    dots = {"n": 1 << 20, "k": 1024, "d": 384, "dtype": "bfloat16", "backend": "triton",
            "kernel_ms": 2.0, "reference_ms": 5.0, "speedup": 2.5, "max_abs_error": 1e-4,
            "tflops": 400.0, "peak_tflops": 790.0, "peak_fraction": 0.506}
    return {"schema": 1, "started_utc": "2026-12-01 10:00", "budget_s": 360, "elapsed_s": 290.5,
            "stages": {
                "preflight": {"status": "passed", "cuda_available": True, "mismatches": [],
                              "device": {"name": "NVIDIA H100 80GB HBM3", "driver": "580.159.04",
                                         "memory_mib": "81559"},
                              "versions": {"python": "3.12.3", "torch": "2.11.0", "triton": "3.6.0",
                                           "transformers": "5.17.0", "nvcc": "13.0"}},
                "install": {"status": "passed", "build_seconds": 31.0,
                            "imports": {"lze_kernels": "ok /tmp/gpu_check/site/lze_kernels"}},
                "kernels": {"status": "passed", "tests": 30, "failures": 0, "errors": 0,
                            "skipped": 0, "backends": ["torch", "cuda", "triton"], "seconds": 40.0},
                "trainer": {"status": "failed", "error": "RuntimeError: boom",
                            "peak_memory_gib": {"rollout": 5.25, "update": 3.5},
                            "steps": [{"step": 1, "timing_s/step": 1.5}]},
                "bench": {"status": "passed", "device": "NVIDIA H100", "rows": rows,
                          "floors": floors, "dots": dots},
                "sanitizer": {"status": "skipped", "reason": "compute-sanitizer ..."},
                "memory": {"status": "passed", "peak_gib": 60.0, "shape": "h1536",
                           "predicted_gib": {"model states": 20.0, "total": 50.0}},
                "peer": {"status": "passed", "trl_step_s": 2.0, "lze_step_s": 0.5, "ratio": 0.25,
                         "setting": "16 x 8 x 64"}}}


def test_report_rewritten_and_copied_after_each_stage(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir(), out.mkdir()
    (work / "install.log").write_text("x" * 100)
    (work / "site").mkdir()  # never copied: only the report files come back
    json_path = gpu_check.write_report(_results(), work, out)
    assert json.loads(json_path.read_text()) == _results()
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md",
                                                      "install.log"]
    assert (out / "gpu_check.md").read_text() == gpu_report.render(_results())


def test_long_logs_come_back_as_their_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "MAX_REPORT_BYTES", 10)
    (tmp_path / "console.log").write_text("head-" + "0123456789")
    gpu_check._copy_tail(tmp_path / "console.log", tmp_path / "copy.log")
    assert (tmp_path / "copy.log").read_text() == "0123456789"


def test_results_markdown_and_goals(tmp_path):
    """The report of a fake run: machine, every stage, every figure, each goal."""
    text = gpu_report.render(_results())
    assert "| device | NVIDIA H100 80GB HBM3 (81559 MiB) |" in text
    assert "| python / torch / triton | 3.12.3 / 2.11.0 / 3.6.0 |" in text
    assert "| trainer | failed |  | RuntimeError: boom |" in text
    assert "| 65,536 | 8.0 (4, 0) | 30.0 (7, 0) | 12.0 (4, 0) | 5.0 (4, 0) | 200.0 (40, 0) " \
           "| 10.0 (6, 0) | 8.0 (6, 0) | 1000.0 (60, 0) | 5.0 | 4.0 | 3.0 | 4.0 |" in text
    assert "50.6% of the bf16 matrix peak" in text and "| rollout | 5.25 |" in text
    goals = {g["goal"]: g for g in gpu_report.goals(_results())}
    met = {name: g["met"] for name, g in goals.items()}
    assert met["host syncs per fused step (off, default check, graph replay)"]
    assert met["kernel launches per fused step"]
    assert met["fused_cuda vs max(launch floor, random-record floor), every B"]  # 1.6x of 5 us
    assert met["the default call's cost over check_inputs=False (fused_cuda), every B"]  # 4 us
    assert met["captured step replays with the default check on, no host sync"]
    compiled = goals["fused_cuda speed-up over the lean PyTorch step under torch.compile "
                     "(lean_compile), every B"]
    assert not compiled["met"] and compiled["measured"] == "1.25x at worst (B = 256)"
    assert not met["fused_triton speed over fused_cuda's (CUDA time / Triton time), every B"]
    assert met["DOTS prediction (N = 1M, K = 1024, d = 384) vs chunked torch reference"]
    memory = [g for g in gpu_report.goals(_results()) if g["goal"].startswith("update-only")][0]
    assert memory["met"] is False and "+20%" in memory["measured"]  # 60 vs 50 GiB
    assert met["lze_trainer step / TRL GRPOTrainer step (hf generation, same GPU)"]
    out = tmp_path / "report.md"
    (tmp_path / "run.json").write_text(json.dumps(_results()))
    assert gpu_report.main([str(tmp_path / "run.json"), "-o", str(out)]) == 0
    assert out.read_text() == text


def test_runs_of_several_calls_merge_into_one_record(tmp_path):
    """A run whose peer stage ran out of time after its first size, and a second call that ran the
    other size: one record with both sizes, the passed stages of the first call, a line per call
    (tools/gpu_runs.py, what docs/gpu-results.md shows)."""
    import gpu_runs

    first = _results()
    first["stages"]["peer"] = {"status": "timeout", "sizes": [
        {"name": "tiny", "status": "passed", "ratio": 0.3, "lze_step_s": 0.3, "trl_step_s": 1.0,
         "setting": "16 x 8 x 64"}], "seconds": 100.0}
    second = {"schema": 1, "started_utc": "2026-12-01 10:20", "budget_s": 300, "elapsed_s": 200.0,
              "stages": {"preflight": {"status": "passed"}, "peer": {"status": "passed", "sizes": [
                  {"name": "qwen2.5-0.5b", "status": "passed", "ratio": 0.25, "lze_step_s": 3.0,
                   "trl_step_s": 12.0, "setting": "64 x 8 x 256"}], "seconds": 150.0}}}
    (tmp_path / "gpu_check.json").write_text(json.dumps(first))
    (tmp_path / "peer-0.5b.json").write_text(json.dumps(second))
    run = gpu_runs.GpuRun(tmp_path)
    peer = run.results["stages"]["peer"]
    assert peer["status"] == "passed" and [s["name"] for s in peer["sizes"]] == \
        list(gpu_report.PEER_SIZES) and peer["seconds"] == 250.0
    assert run.results["stages"]["trainer"] == first["stages"]["trainer"]
    assert [line.split(":")[0] for line in run.results["runs"]] == ["gpu_check.json",
                                                                   "peer-0.5b.json"]
    assert run.card == "an NVIDIA H100 80GB HBM3" and run.peers["qwen2.5-0.5b"].startswith("0.25x")
    goals = {g["goal"]: g["met"] for g in run.goals()}
    assert goals["lze_trainer step / TRL GRPOTrainer step, qwen2.5-0.5b (hf generation, same GPU)"]


def test_a_run_whose_bench_timed_the_lean_step_needs_no_separate_file(tmp_path):
    """Without lean-baseline.json the lean figures come from the check's own bench (its lean_*
    variants, host wall; device time the fused step's other timer), and the feature-parity ones
    from its parity_* variants. A lead inside the two timers' spread is a tie; a compiled
    baseline slower than its eager run is not quoted as a ratio."""
    import gpu_runs

    rows = [{"B": b, "G": 16, "variant": v, "seconds": t * 1e-6, "launches": 2, "syncs": 0}
            for b in (256, 65536) for v, t in (("fused_cuda", 100), ("lean_compile", 150),
                                              ("lean_eager", 400), ("parity_eager", 2000),
                                              ("fused_triton", 300))]
    rows[0]["device_s"] = 180e-6  # the fused step at 256: 1.8x apart by its two timers
    rows += [{"B": 256, "G": 16, "variant": "parity_compile", "seconds": 500e-6, "launches": 9,
              "syncs": 0}, {"B": 65536, "G": 16, "variant": "parity_compile",
                            "seconds": 3000e-6, "launches": 9, "syncs": 0}]
    (tmp_path / "gpu_check.json").write_text(json.dumps(
        {"schema": 1, "stages": {"bench": {"status": "passed", "rows": rows}}}))
    run = gpu_runs.GpuRun(tmp_path)
    assert run.timers == ("host wall", "device time") and run.ties() == "1 of 2"
    table = run.speedup_table()
    assert ("| 256 | 100 µs / 180 µs | 150 µs | tie: 1.50x, inside its timers' 1.80x | 300 µs "
            "(0.50x) | 20x / 5x |") in table
    assert ("| 65,536 | 100 µs / - | 150 µs | **1.50x** | 300 µs (0.50x) | 20x / slower than its "
            "eager (1.5x its time) |") in table
    assert run.triton_line().startswith("The fused Triton step (`auto`'s fallback") and \
        "slower than the lean step under `torch.compile` at 2 of 2 sizes (0.50x" in run.triton_line()


def test_a_goal_missed_at_some_sizes_is_not_met_and_named(tmp_path):
    """A goal measured at some sizes only is not met when one of them misses it (not "not
    measured"), and the run's line names each goal not met and not measured."""
    import gpu_runs

    lean = {256: (1.1e-4, 1e-4), 65536: (3e-4, 1e-4)}  # 1.1x and 3x at 2 of 3 sizes
    without_dots = _results()
    del without_dots["stages"]["bench"]["dots"]
    (tmp_path / "gpu_check.json").write_text(json.dumps(without_dots))
    results = _results()
    results["stages"]["bench"]["rows"] = [r for r in results["stages"]["bench"]["rows"]
                                          if r["variant"] != "lean_compile"]
    goals = {g["short"]: g for g in gpu_report.goals(results, lean)}
    assert goals["2x the lean step compiled"]["met"] is False
    assert goals["2x the lean step compiled"]["measured"] == \
        "1.10x at worst (B = 256) (measured at 2 of 3 sizes; missed at 1)"
    met_at_both = {256: (3e-4, 1e-4), 65536: (3e-4, 1e-4)}
    assert gpu_report.goals(results, met_at_both)[4]["met"] is None
    run = gpu_runs.GpuRun(tmp_path)
    assert run.goals_met() == (
        "7 of 12 goals met; 4 not met: 2x the lean step compiled, 2x the lean step's CUDA graph, "
        "Triton at 0.67x CUDA's speed, the update's memory against its arithmetic; 1 not "
        "measured: DOTS 1.5x its reference")


def test_the_peer_figures_carry_each_trainers_peak_memory(tmp_path):
    import gpu_runs

    results = _results()
    results["stages"]["peer"] = {"status": "passed", "sizes": [
        {"name": "tiny", "status": "passed", "ratio": 0.26, "lze_step_s": 3.147,
         "trl_step_s": 11.968, "setting": "64 x 8 x 256",
         "lze_peak_memory_gib": {"rollout": 10.5, "update": 41.63}, "trl_peak_memory_gib": 11.28}]}
    (tmp_path / "gpu_check.json").write_text(json.dumps(results))
    assert gpu_runs.GpuRun(tmp_path).peers["tiny"] == (
        "0.26x (3.15 s against 11.97 s a step at 64 x 8 x 256; peak memory 41.6 GiB "
        "(lze_trainer's update) against TRL's 11.3 GiB)")


def test_the_lean_scripts_names_are_the_benchs_variants():
    """tools/gpu_lean_baseline.py times through gpu_bench.build_step by lean-baseline.json's
    names (gpu_runs.LEAN_VARIANTS): each is one of the bench's variants."""
    import gpu_runs

    fused = {f"fused_{b}{kind}" for b in ("cuda", "triton") for kind in ("", "_default")}
    assert set(gpu_runs.LEAN_VARIANTS.values()) <= fused | set(gpu_bench.BASELINES)
    for variant in set(gpu_runs.LEAN_VARIANTS.values()) - fused - {"lean_compile"}:
        assert callable(gpu_bench.build_step(variant, 64, torch.device("cpu"), 16))


def test_goals_of_a_run_that_measured_nothing():
    goals = gpu_report.goals({"stages": {"preflight": {"status": "failed"}}})
    assert goals and all(g["met"] is None and g["measured"] == "not measured" for g in goals)
    assert "not measured" in gpu_report.render({"stages": {}})


def test_junit_counts(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite tests="5" failures="1" errors="0" skipped="2">'
                   '</testsuite></testsuites>')
    assert gpu_check.junit_counts(xml) == {"tests": 5, "failures": 1, "errors": 0, "skipped": 2}


# ----------------------------------------------------------------------------- benchmark harness


def test_benchmark_harness_on_cpu():
    variants = ["fused_cpu", "fused_cpu_default", "lean_eager", "torch_topk", "parity_eager"]
    assert gpu_bench.variants_for(CPU, include_compile=False) == variants
    rows = gpu_bench.run(CPU, batches=[64, 128], group=4, rounds=2, variants=variants,
                         log=lambda _: None)
    assert [(r["B"], r["variant"]) for r in rows] == [(b, v) for b in (64, 128) for v in variants]
    for row in rows:
        assert row["seconds"] > 0 and row["launches"] == 0  # no device events on a CPU
    by = {(r["B"], r["variant"]): r for r in rows}
    assert by[64, "fused_cpu"]["ratio_to_fused"] == 1.0
    assert by[64, "fused_cpu"]["vs"] == "lean_eager"  # the strongest baseline that ran
    # No variant reads a tensor back: the default check reads the step's host word.
    assert all(r["syncs"] == 0 for r in rows)


def test_plain_torch_baseline_selects_what_the_reference_selects():
    """Without noise the plain PyTorch step is the spec: same energies, selection and state
    (valid masks, rows without rollouts, the tie rule), step after step."""
    config = LZEConfig(noise_scale=0.0)
    plain, selector = PlainTorchSelector(400, config), LZESelector(400, config, backend="torch")
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randperm(400, generator=gen)[:100]
        rewards = (torch.rand(100, 8, generator=gen) < torch.rand(100, 1, generator=gen)).float()
        valid = torch.arange(8)[None] < torch.randint(0, 9, (100, 1), generator=gen)
        got, want = plain.step(rewards, ids, valid), selector.step(rewards, ids, valid)
        torch.testing.assert_close(got[0], want.advantages)
        for value, name in zip(got[1:], ("pass_rate", "energy", "momentum", "keep_mask",
                                         "kept_indices", "num_kept")):
            assert torch.equal(value, getattr(want, name)), name


def test_sync_count_sees_each_host_read():
    def step(rewards, prompt_ids):
        total = rewards.sum()
        float(total)  # one .item()
        return rewards[rewards > 0]  # boolean mask: a nonzero

    counts = gpu_bench.profile_step(step, RoundInputs(8, 4, CPU), CPU)
    assert counts == {"launches": 0, "syncs": 2}


def test_launch_count_leaves_out_the_step_range_on_the_device_timeline():
    """With CPU and CUDA activity the profiler mirrors the step's record_function range onto the
    device timeline; the first GPU run counted it as a third launch of the fused step."""
    from types import SimpleNamespace as Event

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    window = Event(start=0, end=10)
    events = [Event(name=gpu_bench.STEP_RANGE, device_type=cpu, time_range=window),
              Event(name=gpu_bench.STEP_RANGE, device_type=cuda, time_range=window),
              Event(name="lze_step_kernel", device_type=cuda, time_range=window),
              Event(name="lze_topk_kernel", device_type=cuda, time_range=window),
              Event(name="cudaLaunchKernel", device_type=cpu, time_range=Event(start=1, end=2))]
    assert gpu_bench.count_step_events(events, on_cuda=True) == {"launches": 2, "syncs": 0}


def test_unknown_variant_is_named():
    with pytest.raises(ValueError, match="variant: expected one of"):
        gpu_bench.build_step("magic", 8, CPU, 2)


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


def test_trainer_data_loads_through_the_real_datasets(tmp_path):
    """The stand-in of datasets is gone: the real one is installed (or travels as a wheel)."""
    from lze_trainer.data import load_prompts

    assert not (ROOT / "tools" / "gpu_stand_ins").exists()
    data = gpu_workload.write_arithmetic_jsonl(tmp_path / "train.jsonl", 12)
    rows = load_prompts(str(data), limit=10).to_list()
    assert len(rows) == 10 and rows[3]["messages"][0]["content"].startswith("Calculate ")


def test_model_with_real_size_vocabulary(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    texts = gpu_workload.texts(gpu_workload.write_arithmetic_jsonl(tmp_path / "t.jsonl", 32))
    folder = gpu_workload.build_model(
        tmp_path / "m", texts, vocab=1000,
        spec="tiny:qwen2?hidden=32&layers=1&heads=1&kv_heads=1&vocab=300")
    config = AutoConfig.from_pretrained(folder)
    assert config.vocab_size == 1000 and config.tie_word_embeddings
    assert len(AutoTokenizer.from_pretrained(folder)) < 1000


def test_phase_memory_is_a_no_op_without_cuda():
    from lze_trainer import metrics

    record = {}
    before = metrics.Timer.__call__
    with gpu_workload.phase_memory(record):
        timer = metrics.Timer()
        with timer("rollout"):
            pass
    assert record == {} and metrics.Timer.__call__ is before and "rollout" in timer.seconds


def test_the_stages_share_their_workload_without_an_import_circle():
    """gpu_check and gpu_peer both import gpu_workload; gpu_peer never imports gpu_check, and
    the trainer's reward function resolves to gpu_workload's."""
    assert "gpu_check" not in (ROOT / "tools" / "gpu_peer.py").read_text().split('"""', 2)[2]
    for module in ("gpu_workload", "gpu_report"):
        source = (ROOT / "tools" / f"{module}.py").read_text()
        assert "import gpu_check" not in source and "import gpu_peer" not in source
    assert f"reward.function={gpu_workload.REWARD_FUNCTION}" in gpu_workload.TRAINER_OVERRIDES
    from lze_trainer.reward import import_function

    assert import_function(gpu_workload.REWARD_FUNCTION) is gpu_workload.coin_flip


# ----------------------------------------------------------------------------- install, paths


def test_install_stage_checks_what_is_installed(tmp_path, monkeypatch):
    """Without wheels (a user's `make test-gpu`), the install stage imports what is installed and
    fails naming the imports that fail; nothing is installed or built."""
    monkeypatch.setattr(gpu_offline, "install", lambda *args: pytest.fail("installed"))
    ok = {m: f"ok /venv/{m}.py" for m in gpu_check.IMPORTS}
    monkeypatch.setattr(gpu_check, "check_imports", lambda work: ok)
    assert gpu_check.stage_install(tmp_path, {"wheels": None})["status"] == "passed"
    missing = {**ok, "lze_kernels._lze_cuda": "ModuleNotFoundError: No module named ..."}
    monkeypatch.setattr(gpu_check, "check_imports", lambda work: missing)
    result = gpu_check.stage_install(tmp_path, {"wheels": None})
    assert result["status"] == "failed" and "lze_kernels._lze_cuda" in result["reason"]


def test_stage_environment_puts_the_installed_package_first(tmp_path):
    """F6/F7/F8: a stage child (python -P, cwd = the work folder) imports lze_kernels from the
    site folder, never from the source tree or the venv's editable install, with compiled Triton."""
    fake = tmp_path / "site" / "lze_kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    env = gpu_check.child_env(tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "site")
    assert str(ROOT) not in env["PYTHONPATH"].split(os.pathsep)
    assert env["TRITON_INTERPRET"] == "0" and env["HF_HUB_OFFLINE"] == "1"
    code = "import lze_kernels, os; print(lze_kernels.__file__, os.environ['TRITON_INTERPRET'])"
    # The base interpreter: in the venv, the editable install's import hook (first on
    # sys.meta_path) serves the clone whatever the path; the device has no editable install, and
    # the install stage names an lze_kernels that does not come from the site folder.
    python = getattr(sys, "_base_executable", sys.executable)
    for cwd in (tmp_path, ROOT):
        out = subprocess.run([python, "-P", "-c", code], env=env, cwd=cwd,
                             capture_output=True, text=True, check=True).stdout.split()
        assert out == [str(fake / "__init__.py"), "0"]


def test_memory_arithmetic_is_the_docs():
    """docs/gpu-memory.md's figures: logits and their gradient 9.96 GB each at 8 x 4096 x V, a
    float32 chunk of 441 rows 0.27 GB; states 16 bytes a parameter."""
    terms = gpu_check.memory_arithmetic(1_543_714_304, 8, 4096, gpu_check.QWEN_1_5B)
    gb = 2**30 / 1e9
    assert round(terms["logits, bf16"] * gb, 2) == 9.96
    assert terms["logit gradient, bf16"] == terms["logits, bf16"]
    assert round(terms["float32 chunks (3)"] * gb / 3, 2) == 0.27
    assert round(terms["model states (16 B/parameter)"] * gb, 1) == 24.7
    assert terms["total"] == pytest.approx(sum(v for k, v in terms.items() if k != "total"))


def test_synthetic_batch_trains_only_response_tokens():
    batch, norm = gpu_check.synthetic_batch(2, 16, 5, 300)
    assert batch.input_ids.shape == (2, 16) and int(batch.input_ids.max()) < 300
    assert batch.loss_mask.sum() == 10 and batch.loss_mask[:, -5:].all()
    assert norm.tokens == 10 and norm.sequences == 2 and norm.max_response_length == 5


def test_step_bytes_and_floors_on_cpu():
    assert gpu_bench.step_bytes(65536, 16) == pytest.approx(8 * 65536 * 16 + 92.2 * 65536, rel=1e-6)
    with pytest.raises(ValueError, match="device: the floors are CUDA timings"):
        gpu_bench.floors(256, 16, CPU, rounds=1)


# ----------------------------------------------------------------------------- dry run


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``bash tools/gpu_check.sh REPORT_DIR`` once, as a user runs it, from a read-only copy of
    the tree (the check never writes to it), the work folder elsewhere, the report folder named,
    the peer stage at its Qwen2.5-0.5B size (shrunken on a CPU; the other size runs the same
    code with the trainer stage's model). Shared by the tests below."""
    base = tmp_path_factory.mktemp("dry-run")
    tree, out, work = base / "tree", base / "out", base / "work"
    for path in gpu_offline.travel_files(ROOT, carry=()):
        target = tree / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    for path in sorted(tree.rglob("*"), reverse=True):
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    tree.chmod(tree.stat().st_mode & ~stat.S_IWUSR)
    env = {**os.environ, "GPU_CHECK_DIR": str(work), "PYTHON": sys.executable,
           "GPU_CHECK_COMMIT": "abc1234"}  # the copy has no git
    try:
        begin = time.monotonic()
        proc = subprocess.run(["bash", "tools/gpu_check.sh", str(out), "--peer-sizes",
                               "qwen2.5-0.5b"], cwd=tree, env=env, capture_output=True,
                              text=True, timeout=1200)
        seconds = time.monotonic() - begin
    finally:
        for path in [tree, *tree.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    print(f"dry run: {seconds:.0f} s")
    result = json.loads((out / "gpu_check.json").read_text())
    return dict(tree=tree, out=out, work=work, proc=proc, result=result,
                stages=result["stages"])


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_dry_run")
def test_dry_run_ends_every_stage_and_writes_the_report(dry_run):
    """Every stage ends with a status, the CUDA ones skipped here with the reason; the report
    files are in the report folder (a console log, the JSON with the tree's commit, the markdown
    with the goals); nothing is written into the tree."""
    stages, out, proc = dry_run["stages"], dry_run["out"], dry_run["proc"]
    assert list(stages) == list(gpu_check.STAGES), proc.stdout[-3000:]
    assert dry_run["result"]["commit"] == "abc1234" and dry_run["result"]["budget_s"] is None
    if not torch.cuda.is_available():
        for name in gpu_check.NEEDS_CUDA:
            assert stages[name] == {"status": "skipped", "reason": gpu_check._skip_reason(
                name, {"preflight": {"cuda_available": False}}, None)}, name
        assert proc.returncode == 1
    names = {p.name for p in out.iterdir()}
    assert {"gpu_check.json", "gpu_check.md", "console.log", "peer.log"} <= names
    assert names <= set(gpu_check.REPORT_FILES)
    assert "## Goals" in (out / "gpu_check.md").read_text()
    assert "== install: passed" in (out / "console.log").read_text()
    assert not [p for p in dry_run["tree"].rglob("*")
                if p.name in ("build", "__pycache__", "site")]


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_dry_run")
def test_dry_run_checks_what_is_installed(dry_run):
    """The preflight records the versions and names those unlike the pinned CUDA set; the
    install stage imports every module from what is installed (here the venv's editable install
    of this clone), building nothing."""
    pre, install = dry_run["stages"]["preflight"], dry_run["stages"]["install"]
    assert pre["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert pre["versions"]["torch"] == md.version("torch") and "nvcc" in pre["versions"]
    assert pre["expected"] == gpu_check.expected_versions()
    assert pre["expected_from"] == "requirements/constraints-cuda.txt"
    unlike = [k for k, v in pre["expected"].items()
              if not str(pre["versions"].get(k) or "").startswith(v)]
    assert [m.split()[0] for m in pre["mismatches"]] == unlike
    if not torch.cuda.is_available():
        assert pre["status"] == "failed" and not pre["cuda_available"]
    assert install["status"] == "passed" or "_lze_cuda" in install["reason"], install
    for module in ("lze_kernels._lze_cpu", "lze_trainer.trainer", "deepspeed", "datasets", "trl"):
        assert install["imports"][module].startswith("ok"), install["imports"][module]
    assert "build_exit" not in install and not (dry_run["work"] / "site").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_dry_run")
def test_dry_run_peer_stage_runs_both_trainers(dry_run):
    """The peer stage runs without CUDA too: lze_trainer and TRL's GRPOTrainer each in a child
    process at the shrunken size (TRL's GRPOConfig valid for the installed trl, one time per
    step), their output in peer.log, the shaped model's random weights at the CPU shape."""
    peer, work = dry_run["stages"]["peer"], dry_run["work"]
    log = (dry_run["out"] / "peer.log").read_text()
    assert peer["status"] == "passed", (peer, log[-3000:])
    size = gpu_peer.PEER_SIZES[1]
    cpu = size.on_cpu()
    (entry,) = peer["sizes"]
    assert entry["name"] == size.name and entry["setting"] == cpu.setting()
    assert len(entry["lze_steps_s"]) == len(entry["trl_steps_s"]) == cpu.steps
    assert all(t > 0 for t in entry["trl_steps_s"]) and entry["ratio"] > 0
    assert entry["lze_peak_memory_gib"] == {} and entry["trl_peak_memory_gib"] is None
    for kind in ("lze", "trl"):
        assert f"== {size.name}: {kind}" in log
    config = json.loads((work / "peer" / f"{size.name}-model" / "config.json").read_text())
    assert config["num_hidden_layers"] == gpu_peer.CPU_SHAPE["num_hidden_layers"]
    assert config["vocab_size"] == gpu_workload.VOCAB


def test_step_summary_counts_the_steps_that_ran(tmp_path):
    """Step 0 of metrics.jsonl is the evaluation before training (no step time); the first GPU
    run counted it and failed the trainer stage with "4 steps" of 3."""
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/accuracy": 0.1}] + [
        {"step": s, "timing_s/step": 0.5 * s, "reward/mean": 0.5} for s in (1, 2, 3)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = gpu_workload.step_summary(metrics)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0] == {"step": 1, "timing_s/step": 0.5, "reward/mean": 0.5}


@pytest.mark.slow
def test_update_only_pass_runs_on_cpu(tmp_path):
    """The memory stage's pieces at a tiny shape on the CPU, in a fresh process (it joins a
    one-rank process group): the preset's Actor, the synthetic micro-batch, one update."""
    code = f"""
import os, sys
sys.path.insert(0, {str(ROOT / 'tools')!r})
import gpu_check, gpu_workload
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(gpu_workload.free_port()))
shape = dict(gpu_check.QWEN_1_5B, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, vocab_size=512)
model = gpu_workload.random_model(gpu_check.Path({str(tmp_path / 'model')!r}), shape)
actor, params = gpu_check.update_only_actor(model, ("trainer.device=cpu",))
batch, norm = gpu_check.synthetic_batch(2, 64, 16, 512)
stats = actor.update([[batch]], [norm]).as_dict()
print("params", params, "loss-terms", sorted(stats)[:3])
"""
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT / "tools")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "params" in proc.stdout


def test_dots_benchmark_harness_on_cpu(monkeypatch):
    """The DOTS benchmark's calls and arithmetic at a tiny size (CUDA timers replaced by a host
    clock): the kernel agrees with the chunked reference, FLOPs over time over the peak."""
    def host_median(fn, rounds):
        begin = time.perf_counter()
        for _ in range(rounds):
            fn()
        return (time.perf_counter() - begin) / rounds

    monkeypatch.setattr(gpu_bench, "_event_median", host_median)
    monkeypatch.setattr(gpu_bench, "bf16_peak_flops", lambda device: 1e12)
    result = gpu_bench.dots_benchmark(CPU, n=300, k=16, d=8, dtype=torch.float32, rounds=2)
    assert result["backend"] == "cpu" and result["max_abs_error"] < 1e-5
    assert result["speedup"] == pytest.approx(result["reference_ms"] / result["kernel_ms"])
    assert result["peak_fraction"] == pytest.approx(result["tflops"] / 1.0)
