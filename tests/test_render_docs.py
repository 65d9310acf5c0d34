"""Every figure of the README and docs is rendered from a results file (tools/render_docs.py): the
rendered blocks and pages are current, a planted stale block, a changed results file and a block
that does not name its source's commit and machine all fail, and no page has a figure in its prose
outside a rendered block, except the pages and sections listed here with the reason."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import render_docs  # noqa: E402

# Pages whose figures are not rendered yet, each with the reason.
NOT_RENDERED: dict[str, str] = {}
# Figures in prose that are settings, targets, tolerances or published values, not measurements:
# (page, text) -> why ("*": every figure of the page).
NOT_MEASURED = {
    ("docs/methods.md", "0.4 x"): "published LZE's fixed keep ratio",
    ("docs/methods.md", "40 %"): "the LZE paper's keep ratio",
    ("docs/spec.md", "10 %"): "a draw at 0.1 marks a tenth of the prompts: the test's expectation",
    ("docs/spec.md", "1 %"): "the test's tolerance around that expectation",
    ("docs/spec.md", "99.9 %"): "the chi-square test's quantile",
    ("docs/spec.md", "25 %"): "what a paper's sequence-level selection keeps",
    ("docs/spec.md", "40 %"): "the LZE paper's keep ratio",
    ("docs/verl.md", "1.5x"): "the estimator benchmark's goal",
    ("docs/verl.md", "0.5 ms"): "the estimator benchmark's goal",
    ("docs/verl.md", "1 %"): "the prompt keys' goal: under 1 % of verl's balance + advantage",
    ("docs/testing.md", "20 minutes"): "make test's budget",
    ("docs/testing.md", "3x"): "make test-times' tolerance (check_tolerance)",
    ("docs/testing.md", "2 %"): "the share of a test file not listed in tests/time_budgets.json",
    ("docs/testing.md", "1 %"): "the share under which a file is not judged",
    ("docs/testing.md", "1.5x"): "the report's warning tolerance (report_tolerance)",
    ("docs/testing.md", "90 minutes"): "CI's limit on a run",
    ("docs/testing.md", "15 minutes"): "faulthandler_timeout in pyproject.toml",
    ("docs/study-task.md", "12 points"): "the study task's condition on plain GRPO's gain",
    ("docs/study-task.md", "30-60 %"): "the study task's condition on zero-variance groups",
    ("docs/study-task.md", "10 %"): "the study task's condition on each end of them",
    ("docs/study-speed.md", "4x"): "SPEED's official screening factor",
    ("docs/study-overview.md", "90 %"): "the study's target: 90 % of plain GRPO's gain",
    ("docs/study-overview.md", "0.5x"): "the study's goal",
    ("docs/study-overview.md", "0.6x"): "the study's goal",
    ("docs/study-overview.md", "2x"): "GRESO's published saving",
    ("docs/trainer.md", "30 s"): "torchrun's default shutdown timeout",
    ("docs/gpu-memory.md", "*"): "the arithmetic of the update's memory (tests/test_memory_bounds.py)",
    ("docs/install.md", "500 MB"): "the size of a vllm wheel on PyPI",
    ("docs/trl.md", "1 GiB"): "a setting of the test's vLLM engines",
    ("docs/figure-templates.toml", "90 %"): "the study's target: 90 % of plain GRPO's gain",
    ("docs/kernels.md", "48 KiB"): "a GPU's shared memory a block without the opt-in",
    ("docs/kernels.md", "128 KiB"): "65,536 packed 16-bit counters: the plan's design",
    ("docs/kernels.md", "4 KiB"): "2,048 packed 16-bit counters: the plan's design",
    ("docs/kernels.md", "41 KiB"): "the step tile's static shared memory, 256 x 33 x 4 + 256 x 32 B",
    ("docs/kernels.md", "128 MB"): "4M prompts' 32-byte records",
}


def test_every_registered_results_file_is_committed():
    """A registered results file that git ignores (benchmarks/results/*.json is ignored for the
    tests' own outputs) renders here and is missing from every clone: each one must be tracked."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    registry = render_docs.tomllib.loads((ROOT / render_docs.REGISTRY).read_text())
    paths = sorted({entry["path"] for entry in registry.values()})
    def tracked(path: str) -> bool:  # a file, or a run's folder with its files
        return bool(subprocess.run(["git", "ls-files", "--", path], cwd=ROOT, capture_output=True,
                                   text=True, check=True).stdout.strip())

    assert [path for path in paths if not tracked(path)] == []


def test_every_rendered_block_and_page_is_current():
    """`python tools/render_docs.py` leaves nothing to change."""
    assert render_docs.stale(ROOT) == []


def copy_of_the_pages(dest: Path) -> Path:
    """What rendering reads and writes, in a folder of its own."""
    shutil.copy(ROOT / "README.md", dest / "README.md")
    shutil.copytree(ROOT / "docs", dest / "docs", ignore=shutil.ignore_patterns("*.png", "*.csv"))
    shutil.copytree(ROOT / "benchmarks" / "results", dest / "benchmarks" / "results")
    return dest


def test_a_planted_stale_block_fails(tmp_path):
    """A figure changed by hand inside a rendered block, and a generated page edited by hand, are
    each named with their line."""
    root = copy_of_the_pages(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    block = text[text.index("<!-- render: @readme-measured -->"):]
    figure = re.search(r"\d\.\d\dx", block).group()
    readme.write_text(text.replace(figure, "9.99x", 1))
    results = root / "docs" / "gpu-results.md"
    results.write_text(results.read_text().replace("| passed |", "| failed |", 1))
    found = render_docs.stale(root)
    line = readme.read_text().count("\n", 0, readme.read_text().index("9.99x")) + 1
    assert f"README.md:{line} is stale (python tools/render_docs.py)" in found
    assert any(f.startswith("docs/gpu-results.md:") for f in found) and len(found) == 2
    assert render_docs.main_check(root) == 1


def test_a_results_file_changed_without_its_record_fails(tmp_path):
    root = copy_of_the_pages(tmp_path)
    results = root / "benchmarks" / "results" / "trl_peer.md"
    results.write_text(results.read_text().replace("0.84x", "0.48x"))
    with pytest.raises(render_docs.RenderError, match="trl_peer.md changed since"):
        render_docs.rendered(root)


def test_recording_a_results_file_names_its_commit_and_machine(tmp_path):
    root = copy_of_the_pages(tmp_path)
    results = root / "benchmarks" / "results" / "step_cpu.md"
    results.write_text("| case | time |\n|---|---:|\n| fused | 1.5 ms |\n")
    name = render_docs.record("benchmarks/results/step_cpu.md", None, "abc1234", None, root=root)
    source = render_docs.load_sources(root)[name]
    assert name == "step_cpu" and source.at == f"at `abc1234` on {render_docs.describe_cpu()}"
    assert render_docs.describe_cpu().endswith("CPU") and source["fused"]["time"] == "1.5 ms"


def test_a_block_must_name_what_it_reads(tmp_path):
    sources = render_docs.load_sources(ROOT)
    with pytest.raises(render_docs.RenderError, match="reads trl_peer without naming"):
        render_docs.render_template("{trl_peer[trl LZEGRPOTrainer][ratio]}", sources, "x.md:1")
    assert render_docs.render_template(
        "{trl_peer[trl LZEGRPOTrainer][ratio]} ({trl_peer.at})", sources, "x.md:1") == \
        "0.84x (at `a2423ce` on a 2-core x86-64 CPU)"
    with pytest.raises(render_docs.RenderError, match="2 rows labelled"):
        render_docs.parse_tables("| a | b |\n|---|---|\n| x | 1 |\n| x | 2 |\n")[0]["x"]


def test_a_json_source_of_rows_renders_as_a_table(tmp_path):
    root = copy_of_the_pages(tmp_path)
    (root / "benchmarks" / "results" / "rows.json").write_text(
        '{"columns": ["trainer", "step"], "rows": [{"trainer": "v1", "step": 1.5}]}')
    render_docs.record("benchmarks/results/rows.json", None, "abc1234", "an H100", root=root)
    sources = render_docs.load_sources(root)
    assert render_docs.render_template("{rows.table}\n{rows.at}", sources, "x.md:1") == \
        "| trainer | step |\n|---|---|\n| v1 | 1.5 |\nat `abc1234` on an H100"
    assert sources["rows"]["rows"][0]["step"] == 1.5


def test_tables_are_read_by_row_label_and_column():
    (table,) = render_docs.parse_tables("text\n\n| trainer | method | step |\n|---|---|---:|\n"
                                        "| v1 | GRPO | 1.0 s |\n| v1 | LZE | 0.6 s |\n")
    assert table["v1 LZE"]["step"] == "0.6 s" and table[0][1] == "GRPO"
    with pytest.raises(render_docs.RenderError, match="no column 'steps'"):
        table["v1 GRPO"]["steps"]


def test_rendered_prose_is_wrapped_without_splitting_a_figure():
    text = "word " * 20 + "0.29 % and `make test-gpu GPU_REPORT=x` " + "word " * 20
    lines = render_docs.wrap(text, width=40).splitlines()
    assert all(len(line) <= 40 or "`" in line for line in lines)
    assert any("0.29 %" in line for line in lines) and any("`make test-gpu GPU_REPORT=x`" in line
                                                           for line in lines)
    table = "| a |\n|---|\n| " + "x " * 40 + "|"
    assert render_docs.wrap(table, width=20) == table


def _exempt(page: str, figure: str) -> bool:
    return (page, figure) in NOT_MEASURED or (page, "*") in NOT_MEASURED


def test_no_figure_in_prose_without_a_source():
    """Outside rendered blocks, code and the sections typed until their results file exists, no
    page states a measured figure (a number with a unit of time, memory or share, or a ratio);
    templates' own text states none either."""
    found = []
    for page in render_docs.pages(ROOT):
        name = page.relative_to(ROOT).as_posix()
        if name in render_docs.GENERATED or name in NOT_RENDERED:
            continue
        found += [f"{name}:{line}: {figure}" for line, figure in render_docs.unsourced(
            page.read_text()) if not _exempt(name, figure)]
    templates = render_docs.tomllib.loads((ROOT / render_docs.TEMPLATES).read_text())
    for name, template in templates.items():
        literal = re.sub(r"\{[^{}]*\}", "", template)
        found += [f"{render_docs.TEMPLATES} {name}: {figure}" for _, figure in
                  render_docs.unsourced(literal) if not _exempt(render_docs.TEMPLATES, figure)]
    assert found == []


def test_typed_sections_wait_for_a_results_file_that_does_not_exist_yet():
    """A section typed until its results file exists must be rendered once it does."""
    for page in render_docs.pages(ROOT):
        for path in re.findall(r"<!-- typed until (\S+) -->", page.read_text()):
            assert not (ROOT / path).exists(), f"{page.name}: render the section from {path}"


def test_figures_are_found_in_prose():
    text = ("It took 1.5 ms, 0.84x and 2 %, at B = 65,536.\n```\n3.2 s in code\n```\n"
            "<!-- render: {x} -->4.5 GiB<!-- end render --> `7 s inline`\n")
    assert [figure for _, figure in render_docs.unsourced(text)] == ["1.5 ms", "0.84x", "2 %"]
    ranges = ("The check took 89-288 us; 0.99-1.09x the floor; 3 to 4 minutes; it ends -2.9 points "
              "below, 40.6 CPU s and 954 CPU seconds; 2,160 passed, 73 skipped, 0 failures; "
              "launches: 2 at B = 256 to 65,536; Qwen2.5-3B, 1-3-digit sums, B = 256.")
    assert [figure for _, figure in render_docs.unsourced(ranges)] == [
        "89-288 us", "0.99-1.09x", "3 to 4 minutes", "-2.9 points", "40.6 CPU s",
        "954 CPU seconds", "2,160 passed", "73 skipped", "0 failures", "launches: 2"]
    typed = "<!-- typed until a.md -->\n9 ms\n<!-- end typed -->\nthen 8 ms\n"
    assert [figure for _, figure in render_docs.unsourced(typed)] == ["8 ms"]


def test_every_page_the_renderer_writes_is_listed_and_generated():
    for name in render_docs.PAGES:
        assert name in render_docs.GENERATED
        assert "do not edit by hand" in (ROOT / name).read_text()


# ----------------------------------------------------------------------------- make bench


def registered_digests() -> dict[str, str]:
    """Each registered results file's SHA-256, by path."""
    registry = render_docs.tomllib.loads((ROOT / render_docs.REGISTRY).read_text())
    return {entry["path"]: render_docs.digest(ROOT / entry["path"]) for entry in registry.values()}


def make_bench_commands(*variables: str) -> list[str]:
    """The commands `make bench` runs after its set-up (make -n: nothing runs)."""
    out = subprocess.run(["make", "-n", "--no-print-directory", "bench",
                          f"PYTHON={sys.executable}", *variables], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.replace("\\\n", " ")
    lines = out.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("mkdir -p "))
    return lines[start:]


def test_make_bench_writes_into_its_run_folder_and_records_only_when_asked(tmp_path):
    run = str(tmp_path / "run")
    commands = make_bench_commands(f"BENCH_RUN={run}")
    assert commands[0] == f"mkdir -p {run}"
    assert f"LZE_BENCH_RUN={run} " in commands[1]
    assert f"--benchmark-json={run}/benchmarks.json" in commands[1]
    assert commands[2].endswith(f"benchmarks/report.py {run}/benchmarks.json")
    assert len(commands) == 3 and "--record" not in " ".join(commands)
    recorded = make_bench_commands(f"BENCH_RUN={run}", "RECORD=1")
    assert recorded[3].endswith(f"tools/render_docs.py --record {run}")


def test_no_benchmark_writes_to_the_registered_results():
    """Every benchmark module writes through bench_common.run_file: only bench_common (which
    starts a new run's table from the registered one) and report.py (which reads the GPU suites'
    resource files) name benchmarks/results/."""
    naming = [path.name for path in (ROOT / "benchmarks").glob("*.py")
              if re.search(r"""["']results["']""", path.read_text())]
    assert sorted(naming) == ["bench_common.py", "report.py"]


def test_a_benchmark_run_leaves_the_registered_results_as_they_were(tmp_path):
    """The cheapest writer, the host-cost benchmark, run as make bench runs it: its files land in
    the run folder with run.json, and no registered results file changes."""
    before = registered_digests()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "benchmarks/test_bench_step.py", "-k", "host_cost"], cwd=ROOT,
                         env={**os.environ, "LZE_BENCH_RUN": str(tmp_path)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert registered_digests() == before
    assert {"host_cost.json", "host_cost.md", "run.json"} <= {p.name for p in tmp_path.iterdir()}
    meta = json.loads((tmp_path / "run.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{7}", meta["commit"]) and meta["machine"]


def test_recording_a_bench_run_copies_its_files_and_records_the_registered_ones(tmp_path):
    (tmp_path / "root").mkdir()
    root = copy_of_the_pages(tmp_path / "root")
    run = tmp_path / "run"
    run.mkdir()
    (run / "host_cost.json").write_text('{"median_us": {"fused_off": 1.0}}\n')
    (run / "topk_scaling.md").write_text("| a |\n|---|\n| 1 |\n")
    meta = {"commit": "abc1234", "uncommitted_changes": False, "machine": "a 4-core ARM64 CPU"}
    (run / "run.json").write_text(json.dumps(meta))
    assert render_docs.record_run(run, root) == ["host_cost"]
    source = render_docs.load_sources(root)["host_cost"]
    assert source["median_us"]["fused_off"] == 1.0
    assert source.at == "at `abc1234` on a 4-core ARM64 CPU"
    assert (root / "benchmarks" / "results" / "topk_scaling.md").read_text().startswith("| a |")
    (run / "run.json").write_text(json.dumps({**meta, "uncommitted_changes": True}))
    with pytest.raises(render_docs.RenderError, match="uncommitted changes"):
        render_docs.record_run(run, root)


# ----------------------------------------------------------------------------- of which code


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def known(commit: str) -> bool:
    return git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


def run_sources() -> dict:
    return {name: s for name, s in render_docs.load_sources(ROOT).items()
            if isinstance(s, render_docs.RunSource)}


def test_each_gpu_run_names_the_first_later_change_of_the_kernels():
    """A GPU run's registry entry names the first commit after its own that changed the kernel
    sources (what the README and docs/gpu-results.md say of its code), and names none when
    there is none: a kernel change after a run's commit fails here until the entry says so."""
    registry = render_docs.tomllib.loads((ROOT / render_docs.REGISTRY).read_text())
    for name in run_sources():
        last = registry[name]["commit"].split()[-1]
        if not known(last):
            pytest.skip(f"{last} is not in this clone's history")
        changes = git("rev-list", "--reverse", f"{last}..HEAD", "--",
                      *render_docs.KERNEL_SOURCES).stdout.split()
        recorded = registry[name].get("kernels_changed")
        if not changes:
            assert recorded is None, name
        else:
            assert recorded and git("rev-parse", recorded).stdout.strip() == changes[0], \
                f"{name}: the kernels first changed in {changes[0][:7]} after {last}"


def test_each_gpu_runs_files_name_the_script_that_wrote_them():
    """provenance.json of each run folder names, for every results file, the script that wrote
    it, at a commit that has it, and the conditions of its timings."""
    for source in run_sources().values():
        folder = source.path
        provenance = json.loads((folder / "provenance.json").read_text())
        assert set(provenance) == {p.name for p in folder.glob("*.json")} - {"provenance.json"}
        for entry in provenance.values():
            assert entry["conditions"]
            script = entry["script"].split()[0]
            for commit in entry["commit"].split(" and "):
                if known(commit):
                    assert git("cat-file", "-e", f"{commit}:{script}").returncode == 0, \
                        f"{script} is not in {commit}"


def test_the_launch_counts_are_the_built_modules():
    """benchmarks/results/launches.json (tools/count_launches.py, counted in the emulator) is of
    today's CUDA plans: after a change of the plans, `python tools/count_launches.py` again."""
    from lze_kernels import available_backends

    if "cuda_emulated" not in available_backends("cpu"):
        pytest.skip("the CUDA emulator is not built")
    import count_launches

    from lze_kernels import emulated

    data = json.loads((ROOT / count_launches.RESULTS).read_text())
    assert sorted(data["architectures"]) == [f"sm_{a}" for a in emulated.ARCHITECTURES]
    for arch in emulated.ARCHITECTURES:
        counts = data["architectures"][f"sm_{arch}"]
        with emulated.architectures(arch):
            edges = count_launches.boundaries(lambda b: count_launches.module_launches(b, 0))
            assert [span["from"] for span in counts["spans"][1:]] == edges, \
                "the CUDA plans changed: run python tools/count_launches.py"
            for row in counts["rows"]:
                assert (row["launches"], row["checked"]) == (
                    count_launches.module_launches(row["B"], 0),
                    count_launches.module_launches(row["B"], 1))


def test_launch_counts_are_merged_into_spans_and_words():
    import count_launches

    def count(batch):
        return 2 if batch <= 100 else 4 if batch <= 5000 else 7

    assert count_launches.boundaries(count, top=1 << 20) == [101, 5001]
    rows = [{"B": b, "launches": count(b), "checked": count(b) + 1}
            for b in (1, 100, 101, 5000, 5001, 1 << 20)]
    spans = count_launches.spans(rows)
    assert [(s["from"], s["to"], s["launches"]) for s in spans] == [
        (1, 100, 2), (101, 5000, 4), (5001, 1 << 20, 7)]
    assert count_launches.words(spans) == (
        "2 at B = 1 to 100 and 4 at B = 101 to 5,000 and 7 at B = 5,001 to 1,048,576 "
        "(1 more with `check_inputs=True`: its undo copy)")


def test_a_markdown_source_reads_across_tables_under_headings_and_in_its_prose(tmp_path):
    root = copy_of_the_pages(tmp_path)
    (root / "benchmarks" / "results" / "t.md").write_text(
        "Medians of steps 2-8; load average 2.0\n\n## Greedy\n\n| m | a |\n|---|---|\n| x | 1 |\n\n"
        "| m | b |\n|---|---|\n| x | 2 |\n\n## Sampled\n\n| m | a |\n|---|---|\n| x | 3 |\n")
    render_docs.record("benchmarks/results/t.md", None, "abc1234", None, root=root)
    source = render_docs.load_sources(root)["t"]
    assert (source["x"]["a"], source["x"]["b"]) == ("1", "2")
    assert source.sections["Sampled"]["x"]["a"] == "3" and source.says["load average"] == "2.0"
    with pytest.raises(render_docs.RenderError, match="says nothing after 'load peak'"):
        source.says["load peak"]


def test_a_gpu_runs_code_says_whether_todays_kernels_are_it():
    text = render_docs.render_template("{gpu_h100.code}", render_docs.load_sources(ROOT), "x:1")
    assert text.startswith("today's kernels are not this code: `2901552` changed them (")
