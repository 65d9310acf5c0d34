"""The CPU-runnable parts of the GPU check (tools/gpu_check.py, `bash tools/gpu_check.sh REPORT_DIR`
on a machine with one GPU and no network): arguments, what is copied to it against its budget, the
wheels against the preinstalled packages, the install's paths and environment (the installed
package wins, compiled Triton), the report after each stage, the benchmark harness and its floors,
the verl-style vectorised baseline, the memory arithmetic, the trainer stage's model, and a dry run
of the whole script as a GPU machine would run it (read-only tree, a report folder, no network)."""

import importlib.metadata as md
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))
import gpu_bench  # noqa: E402
import gpu_check  # noqa: E402
import gpu_report  # noqa: E402
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
                                 "--batches", "256,65536"])
    assert args.stages == ["bench", "trainer"] and args.batches == [256, 65536]
    default = gpu_check.parse_args(["check", "--report", "r"])
    assert default.stages == list(gpu_check.STAGES) and default.budget == gpu_check.BUDGET_S
    assert default.work == Path("/tmp/gpu_check") and default.report == Path("r")
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["check"])  # the report folder is always named


def test_stage_plan_fits_the_budget():
    """Every stage has a cap and an estimate; the estimates fit the 7-minute budget with room,
    the order is kernels, trainer, bench, ... and at most 8 files come back."""
    assert set(gpu_check.STAGE_CAP_S) == set(gpu_check.STAGE_ESTIMATE_S) == set(gpu_check.STAGES)
    assert gpu_check.BUDGET_S <= 420
    assert sum(gpu_check.STAGE_ESTIMATE_S.values()) <= 0.9 * gpu_check.BUDGET_S
    order = list(gpu_check.STAGES)
    assert order[:5] == ["preflight", "install", "kernels", "trainer", "bench"]
    assert len(gpu_check.REPORT_FILES) <= 8 and gpu_check.MAX_REPORT_BYTES <= 16 * 2**20


@pytest.mark.parametrize("argv", [["check", "--stages", "kernels,vllm"],
                                  ["check", "--stages", ","], ["check", "--batches", "256,x"],
                                  ["check", "--batches", "0"]])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args([*argv, "--report", "r"])
    assert exc.value.code == 2
    assert argv[1] in capsys.readouterr().err


# ----------------------------------------------------------------------------- wheels


def _normalised(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def test_travel_is_within_budget():
    """What would be copied to the GPU machine today (tracked + untracked-not-ignored + the
    wheels, at their recorded sizes where not downloaded) stays under 48 MiB of the 64 allowed."""
    report = gpu_check.travel_report(ROOT)
    assert report["within_budget"], gpu_check.format_travel(report)
    assert report["budget_bytes"] == 48 * 2**20 < report["limit_bytes"]


def test_travel_counts_what_is_copied(tmp_path):
    repo = tmp_path / "repo"
    (repo / "wheels").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/wheels/\nbuild/\n")
    (repo / "tracked.py").write_bytes(b"x" * 1000)
    (repo / "untracked.txt").write_bytes(b"y" * 300)  # not ignored: travels
    (repo / "build").mkdir()
    (repo / "build" / "big.o").write_bytes(b"z" * 10**6)  # ignored: stays
    (repo / "wheels" / "a.whl").write_bytes(b"w" * 5000)  # ignored but carried
    subprocess.run(["git", "-C", str(repo), "add", "tracked.py", ".gitignore"], check=True)
    names = {p.relative_to(repo).as_posix() for p in gpu_check.travel_files(repo)}
    assert names == {".gitignore", "tracked.py", "untracked.txt", "wheels/a.whl"}
    report = gpu_check.travel_report(repo, budget_mib=0.005)
    assert report["wheel_bytes"] == 5000 and report["wheels_on_disk"]
    assert not report["within_budget"] and "OVER" in gpu_check.format_travel(report)


def test_wheels_and_local_build_outputs_are_ignored():
    for path in ("wheels/x.whl", "gpu_check/site/x.py"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path


def test_wheels_are_only_what_the_image_lacks():
    """Never a package of the image, except one installed only where the image's copy is older
    than the pin (typing-extensions, which pydantic needs at >= 4.16)."""
    carried = {_normalised(w.requirement.split("==")[0]) for w in gpu_check.WHEELS}
    always = {_normalised(w.requirement.split("==")[0]) for w in gpu_check.WHEELS
              if not w.if_older}
    assert not always & gpu_check.IMAGE_PACKAGES, "carried although the image has it"
    assert carried - always <= gpu_check.IMAGE_PACKAGES
    assert {"deepspeed", "pydantic", "pydantic-core", "datasets", "dill", "multiprocess",
            "trl", "omegaconf", "math-verify"} <= carried


def test_wheels_and_image_cover_every_requirement():
    """The closure of the carried packages' requirements (their metadata here, extras left out)
    is inside WHEELS + the image: a package like pydantic for DeepSpeed cannot go missing."""
    carried = {_normalised(w.requirement.split("==")[0]): w for w in gpu_check.WHEELS}
    have = set(carried) | gpu_check.IMAGE_PACKAGES
    missing = {}
    device = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": "",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    for name in carried:
        for req in map(Requirement, md.requires(name) or []):
            if req.marker is not None and not req.marker.evaluate(device):
                continue  # an extra's, or for another Python
            if _normalised(req.name) not in have:
                missing.setdefault(name, []).append(req.name)
    assert not missing


def test_recorded_wheel_sizes_are_plausible():
    for wheel in gpu_check.WHEELS:
        assert 10_000 < wheel.size < 5 * 2**20, wheel
    assert [w.requirement for w in gpu_check.WHEELS if w.if_older] == ["typing-extensions==4.16.0"]


def test_wheel_pins_match_the_cuda_set():
    """Every wheel brought is the version the CUDA pinned set resolves to (where it has it)."""
    pins = {}
    for line in (ROOT / "requirements" / "constraints-cuda.txt").read_text().splitlines():
        req = line.split("#")[0].strip()
        if "==" in req:
            name, version = req.split("==")
            pins[name.lower()] = version
    for wheel in gpu_check.WHEELS:
        assert wheel.how in ("binary", "built"), wheel
        name, version = wheel.requirement.split("==")
        assert pins[name.lower()] == version, wheel


# ----------------------------------------------------------------------------- report


def _results():
    """A small fake run: every stage, with goals met and missed."""
    case = [("fused_cuda", 8e-6, 7, 0), ("fused_triton", 3e-5, 7, 0),
            ("fused_cuda_checked", 3e-5, 10, 1), ("torch_plain", 2e-4, 40, 0),
            ("torch_plain_compile", 1e-5, 6, 0), ("verl_vectorised", 1e-3, 60, 3)]
    rows = []
    for batch in (256, 65536, 1048576):
        rows += gpu_bench.with_ratios([{"B": batch, "G": 16, "variant": v, "seconds": t,
                                        "launches": n, "syncs": k} for v, t, n, k in case])
    floors = {str(b): {"bytes": gpu_bench.step_bytes(b, 16), "launch_s": 5e-6, "hbm_s": 3e-6}
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
    """docs/gpu-results.md from a fake run: machine, every stage, every figure, each goal."""
    text = gpu_report.render(_results())
    assert "| device | NVIDIA H100 80GB HBM3 (81559 MiB) |" in text
    assert "| python / torch / triton | 3.12.3 / 2.11.0 / 3.6.0 |" in text
    assert "| trainer | failed |  | RuntimeError: boom |" in text
    assert "| 65,536 | 8.0 (7, 0) | 30.0 (7, 0) | 30.0 (10, 1) | 200.0 (40, 0) | 10.0 (6, 0) " \
           "| 1000.0 (60, 3) | 5.0 | 3.0 |" in text
    assert "50.6% of the bf16 matrix peak" in text and "| rollout | 5.25 |" in text
    goals = {g["goal"]: g for g in gpu_report.goals(_results())}
    met = {name: g["met"] for name, g in goals.items()}
    assert met["host syncs per fused step (check_inputs=False)"]
    assert met["host syncs per checked step (the default call)"]
    assert met["kernel launches per fused step"]
    assert met["fused_cuda vs max(launch floor, HBM floor) at B = 65,536"]  # 1.6x of 5 us
    assert met["fused_cuda speed-up over the plain PyTorch step (eager), B >= 65,536"]  # 25x
    assert met["fused_cuda speed-up over the plain PyTorch step (eager), B < 65,536"]
    compiled = goals["fused_cuda speed-up over the plain step under torch.compile, every B"]
    assert not compiled["met"] and compiled["measured"] == "1.25x at worst (B = 256)"
    assert not met["fused_triton within 2x of fused_cuda (CUDA time / Triton time), every B"]
    assert met["checked step's cost over the unchecked one, B <= 65,536"]  # 22 us
    assert met["DOTS prediction (N = 1M, K = 1024, d = 384) vs chunked torch reference"]
    memory = [g for g in gpu_report.goals(_results()) if g["goal"].startswith("update-only")][0]
    assert memory["met"] is False and "+20%" in memory["measured"]  # 60 vs 50 GiB
    assert met["lze_trainer step / TRL GRPOTrainer step (hf generation, same GPU)"]
    out = tmp_path / "gpu-results.md"
    (tmp_path / "run.json").write_text(json.dumps(_results()))
    assert gpu_report.main([str(tmp_path / "run.json"), "-o", str(out)]) == 0
    assert out.read_text() == text


def test_shipped_results_are_generated_from_the_shipped_run():
    """docs/gpu-results.md is the render of docs/gpu-results.json (the run it reports), and the
    README's goals table is that report's, copied by tools/gpu_report.py."""
    run = json.loads((ROOT / "docs" / "gpu-results.json").read_text())
    markdown = gpu_report.render(run)
    assert (ROOT / "docs" / "gpu-results.md").read_text() == markdown
    readme = (ROOT / "README.md").read_text()
    quoted = readme.split(gpu_report.README_BEGIN, 1)[1].split(gpu_report.README_END, 1)[0]
    assert quoted.strip() == gpu_report.goals_table(markdown)


def test_readme_quote_replaces_what_was_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{gpu_report.README_BEGIN}\nold\n{gpu_report.README_END}\nrest\n")
    markdown = "# GPU results\n\n## Goals\n\n| goal |\n|---|\n\n## Kernel benchmark\n\nx\n"
    assert gpu_report.quote_in_readme(markdown, readme)
    assert readme.read_text() == (f"intro\n{gpu_report.README_BEGIN}\n| goal |\n|---|\n"
                                  f"{gpu_report.README_END}\nrest\n")
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    assert not gpu_report.quote_in_readme(markdown, plain)


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
    variants = ["fused_cpu", "fused_cpu_checked", "torch_plain", "verl_vectorised", "torch_topk",
                "torch_sort"]
    assert gpu_bench.variants_for(CPU, include_compile=False) == variants
    rows = gpu_bench.run(CPU, batches=[64, 128], group=4, rounds=2, variants=variants,
                         log=lambda _: None)
    assert [(r["B"], r["variant"]) for r in rows] == [(b, v) for b in (64, 128) for v in variants]
    for row in rows:
        assert row["seconds"] > 0 and row["launches"] == 0  # no device events on a CPU
    by = {(r["B"], r["variant"]): r for r in rows}
    assert by[64, "fused_cpu"]["ratio_to_fused"] == 1.0
    # The unchecked step and the plain PyTorch step never read the device; the checked step
    # reads its fault word once; the verl-style step reads three times per step.
    assert by[64, "fused_cpu"]["syncs"] == by[64, "torch_plain"]["syncs"] == 0
    assert by[64, "fused_cpu_checked"]["syncs"] == 1
    assert by[64, "verl_vectorised"]["syncs"] == 3


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
    """The stand-in of datasets is gone: the real one travels as a wheel."""
    from lze_trainer.data import load_prompts

    assert not (ROOT / "tools" / "gpu_stand_ins").exists()
    data = gpu_check.write_arithmetic_jsonl(tmp_path / "train.jsonl", 12)
    rows = load_prompts(str(data), limit=10).to_list()
    assert len(rows) == 10 and rows[3]["messages"][0]["content"].startswith("Calculate ")


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


# ----------------------------------------------------------------------------- install, paths


def _fake_wheel(folder: Path, name="gpu_check_probe", version="0.1") -> Path:
    """A pure wheel holding one module ``name`` (what pip needs: a module, METADATA, WHEEL,
    RECORD)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_wheels_install_from_a_relative_folder_without_network(tmp_path, monkeypatch):
    """F4: relative paths; F2: --no-compile; only interpreter-compatible wheels; missing ones
    of WHEELS are listed."""
    _fake_wheel(tmp_path / "rel" / "wheels")
    (tmp_path / "rel" / "wheels" / "other-1.0-cp399-cp399-manylinux2014_x86_64.whl").write_bytes(
        b"")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    site = tmp_path / "work" / "site"
    with open(tmp_path / "install.log", "w") as log:
        result = gpu_check.install_wheels(Path("rel/wheels"), site, log)
    assert result["installed"] == ["gpu_check_probe-0.1-py3-none-any.whl"]
    assert result["skipped"] == {"other-1.0-cp399-cp399-manylinux2014_x86_64.whl":
                                 "not for this interpreter"}
    assert len(result["missing"]) == len(gpu_check.WHEELS)
    assert (site / "gpu_check_probe.py").exists() and not list(site.rglob("*.pyc"))
    assert "--no-index" in (tmp_path / "install.log").read_text()


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
    for cwd in (tmp_path, ROOT):
        out = subprocess.run([sys.executable, "-P", "-c", code], env=env, cwd=cwd,
                             capture_output=True, text=True, check=True).stdout.split()
        assert out == [str(fake / "__init__.py"), "0"]


def test_check_writes_the_report_folder_after_the_preflight(tmp_path):
    """One real stage (the preflight) through the parent: versions against the expected ones, the
    report in the named folder; without a GPU the CUDA stages are skipped with the reason."""
    code = gpu_check.main(["check", "--work", str(tmp_path / "work"), "--report",
                           str(tmp_path / "out"), "--stages", "preflight,kernels"])
    assert code == 1  # no GPU here
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    pre = result["stages"]["preflight"]
    assert pre["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert pre["versions"]["torch"] == md.version("torch") and "nvcc" in pre["versions"]
    if not torch.cuda.is_available():
        assert pre["status"] == "failed" and not pre["cuda_available"]
        assert result["stages"]["kernels"] == {"status": "skipped", "reason":
                                               gpu_check._skip_reason("kernels", result["stages"],
                                                                      100)}
    assert any("torch" in m for m in pre["mismatches"]) == (not md.version("torch")
                                                            .startswith("2.11"))


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


def _read_only_copy(dest: Path) -> Path:
    """What is copied to the GPU machine (travel_files), copied and made read-only like a tree that
    must not be written to."""
    for path in gpu_check.travel_files(ROOT, carry=()):
        target = dest / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    for path in sorted(dest.rglob("*"), reverse=True):
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    dest.chmod(dest.stat().st_mode & ~stat.S_IWUSR)
    return dest


@pytest.mark.slow
def test_dry_run_of_the_whole_script_with_the_device_layout(tmp_path):
    """bash tools/gpu_check.sh REPORT_DIR from a read-only copy of what travels, the report folder
    empty, the work folder elsewhere, no network (PIP_NO_INDEX), a wheels folder with one pure
    wheel: every stage ends with a status, the CUDA ones skipped here with the reason, the peer
    stage run at both its sizes (shrunken), the package built from the copy and imported from the
    site folder, and the report files in the report folder."""
    tree = _read_only_copy(tmp_path / "tree")
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    _fake_wheel(tmp_path / "wheels")
    env = {**os.environ, "GPU_CHECK_DIR": str(work), "PIP_NO_INDEX": "1",
           "WHEELS": str(tmp_path / "wheels"), "PYTHON": sys.executable,
           "PIP_CONSTRAINT": "",
           # the device's caps assume 16 cores; CI has 2, maybe busy
           "GPU_CHECK_CAP_SCALE": "5", "GPU_CHECK_BUDGET_S": "1500"}
    try:
        begin = time.monotonic()
        proc = subprocess.run(["bash", "tools/gpu_check.sh", str(out)], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=1600)
        seconds = time.monotonic() - begin
    finally:
        for path in [tree, *tree.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    result = json.loads((out / "gpu_check.json").read_text())
    stages = result["stages"]
    assert list(stages) == list(gpu_check.STAGES), proc.stdout[-3000:]
    install = stages["install"]
    assert install["build_exit"] == 0, (work / "install.log").read_text()[-3000:]
    assert install["lze_kernels_from"] == f"ok {work / 'site' / 'lze_kernels' / '__init__.py'}"
    assert install["wheels"]["installed"] == ["gpu_check_probe-0.1-py3-none-any.whl"]
    for module in ("lze_kernels._lze_cpu", "lze_trainer.trainer", "deepspeed", "datasets"):
        assert install["imports"][module].startswith("ok"), install["imports"][module]
    if not torch.cuda.is_available():
        for name in gpu_check.NEEDS_CUDA:
            assert stages[name]["status"] == "skipped" and "no CUDA device" in \
                stages[name]["reason"], name
        assert proc.returncode == 1
    peer = stages["peer"]  # runs without CUDA too, both sizes shrunken
    assert peer["status"] == "passed", (peer, (out / "peer.log").read_text()[-3000:])
    assert [s["name"] for s in peer["sizes"]] == list(gpu_report.PEER_SIZES)
    names = {p.name for p in out.iterdir()}
    assert {"gpu_check.json", "gpu_check.md", "console.log", "install.log"} <= names
    assert names <= set(gpu_check.REPORT_FILES) and len(names) <= 8
    assert "## Goals" in (out / "gpu_check.md").read_text()
    assert "== install: " in (out / "console.log").read_text()
    assert not [p for p in tree.rglob("*") if p.name in ("build", "__pycache__", "site")]
    print(f"dry run: {seconds:.0f} s, install {install['seconds']} s (build "
          f"{install['build_seconds']} s)")


def test_step_summary_counts_the_steps_that_ran(tmp_path):
    """Step 0 of metrics.jsonl is the evaluation before training (no step time); the first GPU
    run counted it and failed the trainer stage with "4 steps" of 3."""
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/accuracy": 0.1}] + [
        {"step": s, "timing_s/step": 0.5 * s, "reward/mean": 0.5} for s in (1, 2, 3)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = gpu_check._step_summary(metrics)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0] == {"step": 1, "timing_s/step": 0.5, "reward/mean": 0.5}


@pytest.mark.slow
def test_update_only_pass_runs_on_cpu(tmp_path):
    """The memory stage's pieces at a tiny shape on the CPU, in a fresh process (it joins a
    one-rank process group): the preset's Actor, the synthetic micro-batch, one update."""
    code = f"""
import os, sys
sys.path.insert(0, {str(ROOT / 'tools')!r})
import gpu_check
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(gpu_check._free_port()))
shape = dict(gpu_check.QWEN_1_5B, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, vocab_size=512)
model = gpu_check.random_model(gpu_check.Path({str(tmp_path / 'model')!r}), shape)
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
