"""python -m lze_trainer.compare: runs side by side, accuracy against step and update tokens."""

import json

import pytest

from lze_trainer import compare


def _run(folder, accuracies, tokens_per_step):
    folder.mkdir()
    rows = [{"step": 0, "eval/heldout/pass@1": accuracies[0], "eval/heldout/sampled_acc": 0.5}]
    for step, accuracy in enumerate(accuracies[1:], start=1):
        rows.append({"step": step, "reward/mean": 0.5, "total/update_tokens": step * tokens_per_step,
                     "eval/heldout/pass@1": accuracy, "eval/heldout/sampled_acc": 0.5})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_update_tokens_map_each_evaluation_to_the_cost_spent_by_then(tmp_path):
    rows = [json.loads(line) for line in
            (_run(tmp_path / "a", [0.1, 0.2, 0.3], 100) / "metrics.jsonl").read_text().splitlines()]
    assert compare._update_tokens_by_step(rows) == {0: 0.0, 1: 100, 2: 200}


def test_cli_writes_one_png_for_several_runs(tmp_path):
    lze = _run(tmp_path / "demo-lze", [0.1, 0.4, 0.6], 100)
    uniform = _run(tmp_path / "demo-uniform", [0.1, 0.3, 0.5], 250)
    out = tmp_path / "plots" / "compare.png"
    assert compare.main([str(lze), str(uniform), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")


def test_a_folder_without_metrics_is_named_in_the_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="empty"):
        compare.main([str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")])
