"""DOTS's adaptive difficulty predictor (lze_kernels.dots_adapter, trained by
lze_trainer.methods.dots_predictor): the kernel inference path against the differentiable one,
offline BCE training on a synthetic task whose pass rates depend on the embeddings, the official
in-sample calibration, and known values of the calibration head."""

import math

import pytest
import torch

from lze_kernels import ops
from lze_kernels.dots_adapter import DifficultyAdapter, projection
from lze_trainer.methods.dots_predictor import (LabelledPrompts, held_out_quality, pearson_r,
                                                predict_with_references, train_adapter)


def synthetic_task(n=600, signal_dims=2, noise_dims=30, seed=0):
    """Embeddings whose pass rate is a logistic function of two coordinates, drowned in 30
    coordinates of larger noise: raw dot products mostly measure the noise."""
    gen = torch.Generator().manual_seed(seed)
    signal = torch.randn(n, signal_dims, generator=gen)
    noise = 3.0 * torch.randn(n, noise_dims, generator=gen)
    pass_rate = torch.sigmoid(2.5 * signal.sum(1))
    mixed = (pass_rate > 0.1) & (pass_rate < 0.9)
    return torch.cat([signal, noise], dim=1), pass_rate, mixed


def test_projection_is_the_official_stack():
    layers = [type(m).__name__ for m in projection(8, 4, layers=3, dropout=0.1)]
    assert layers == ["LayerNorm", "Linear", "GELU", "Dropout", "Linear", "GELU", "Dropout",
                      "Linear", "LayerNorm"]


@pytest.mark.parametrize("layers", [1, 3])
def test_kernel_inference_matches_the_differentiable_forward(layers):
    torch.manual_seed(0)
    adapter = DifficultyAdapter(24, hidden_size=16, layers=layers).eval()
    q, r, y = torch.randn(50, 24), torch.randn(7, 24), torch.rand(7)
    with torch.no_grad():
        want = adapter(q, r, y)
    torch.testing.assert_close(adapter.predict(q, r, y, backend="torch"), want)
    torch.testing.assert_close(adapter.predict(q, r, y), want, rtol=1e-5, atol=1e-6)


def test_calibration_head_known_values():
    adapter = DifficultyAdapter(4, hidden_size=4, layers=1)
    with torch.no_grad():  # temperature softplus(0) = log 2, bias tanh(atanh(0.5)) = 0.5
        adapter.calibration[2].weight.zero_()
        adapter.calibration[2].bias.copy_(torch.tensor([0.0, math.atanh(0.5)]))
    base = torch.tensor([0.2, 0.5, 0.9])
    want = torch.sigmoid(torch.logit(base) / math.log(2.0) + 0.5)
    torch.testing.assert_close(adapter.calibrate(base, torch.tensor([0.0, 1.0])), want)


def test_predict_in_training_mode_is_an_error():
    adapter = DifficultyAdapter(4, hidden_size=4)
    with pytest.raises(RuntimeError, match="eval"):
        adapter.predict(torch.randn(3, 4), torch.randn(2, 4), torch.rand(2))


def test_bad_sizes_name_the_arguments():
    with pytest.raises(ValueError, match="input_size, hidden_size and layers"):
        DifficultyAdapter(0)


def test_training_lowers_bce_and_beats_the_untrained_kernel_regression():
    embeddings, pass_rate, mixed = synthetic_task()
    labelled = LabelledPrompts(torch.arange(len(pass_rate)), pass_rate, mixed)
    held_in, held_out = labelled.split(0.25, torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    adapter = DifficultyAdapter(embeddings.shape[1], hidden_size=32, layers=2)
    stats = train_adapter(adapter, embeddings[held_in], pass_rate[held_in], 64, epochs=15,
                          time_s=120.0, lr=3e-3, batch_size=32,
                          generator=torch.Generator().manual_seed(1))
    assert stats["dots/predictor_epochs"] == 15
    assert stats["dots/predictor_bce_last_epoch"] < stats["dots/predictor_bce_first_epoch"] - 0.05
    quality = held_out_quality(adapter.eval(), embeddings, labelled, held_in, held_out, 64, 1.0,
                               torch.Generator().manual_seed(2))
    assert quality["dots/heldout_pearson_trained"] > 0.5
    assert quality["dots/heldout_pearson_trained"] > quality["dots/heldout_pearson_untrained"] + 0.3
    assert (quality["dots/heldout_mixed_share_trained"]
            > quality["dots/heldout_mixed_share_random"] + 0.1)


def test_training_stops_at_the_time_cap():
    embeddings, pass_rate, _ = synthetic_task(n=64)
    stats = train_adapter(DifficultyAdapter(32, hidden_size=8), embeddings, pass_rate, 16,
                          epochs=1000, time_s=0.0, lr=1e-3, batch_size=16,
                          generator=torch.Generator().manual_seed(0))
    assert stats["dots/predictor_epochs"] == 0


def test_in_sample_calibration_keeps_a_near_uniform_predictor_the_right_way_round():
    """Unit vectors of a sentence encoder give near-uniform attention (|score| <= 1/sqrt(d)); the
    official in-sample fit stretches the faint signal with a positive slope (a leave-one-out fit
    inverted it: each reference's prediction then leans away from its own label)."""
    embeddings, pass_rate, _ = synthetic_task(n=400, noise_dims=6)
    unit = torch.nn.functional.normalize(embeddings, dim=1)
    refs = torch.arange(64)
    predicted, (slope, _) = predict_with_references(None, unit, refs, pass_rate[refs], 1.0, True)
    raw = ops.predict_pass_rates(unit, unit[refs], pass_rate[refs])
    assert raw.max() - raw.min() < 0.2  # near-uniform attention
    assert float(slope) > 1.0
    others = torch.arange(64, 400)
    assert pearson_r(predicted[others].double(), pass_rate[others].double()) > 0.2
    # The leave-one-out fit this replaced: a negative slope, the predictor reversed.
    scores = unit[refs] @ unit[refs].T / math.sqrt(unit.shape[1])
    loo = torch.softmax(scores.fill_diagonal_(-torch.inf), dim=1) @ pass_rate[refs]
    assert float(ops.calibrate_linear(loo, pass_rate[refs])[0]) < 0


def test_pearson_known_values():
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert pearson_r(x, 2 * x + 1) == pytest.approx(1.0)
    assert pearson_r(x, -x) == pytest.approx(-1.0)
    assert pearson_r(x, torch.ones(3, dtype=torch.float64)) == 0.0


# ---------------------------------------------------------------- in the trainer's DOTS method

from test_trainer_methods import N, build, one_process_group, run_step  # noqa: E402,F401


def test_dots_trains_its_predictor_once_before_the_first_round_and_resumes_with_it():
    method = build("dots", "selection.dots.reference_size=9", "selection.dots.every=2",
                   "selection.dots.predictor_prompts=24", "selection.dots.predictor_hidden=8",
                   "selection.dots.predictor_epochs=3")
    chooser = method.chooser
    chooser.embeddings = torch.nn.functional.one_hot(torch.arange(N) % 3, 3).float() * 5
    run_step(method, 0)
    calls = method.ctx.generation.calls
    assert [c[0] for c in calls] == ["predictor", "reference", "train"]
    assert len(set(calls[0][1])) == 24 and calls[0][2] == [4] * 24  # M prompts, n rollouts each
    assert method.ctx.generation.ledger.step[("rollouts", "predictor")] == 24 * 4  # booked as its own
    assert chooser.adapter is not None and not chooser.adapter.training
    logged = method.step_metrics()
    assert logged["dots/predictor_epochs"] == 3 and logged["dots/heldout_prompts"] == 6
    assert "dots/heldout_pearson_trained" not in method.step_metrics()  # logged once
    run_step(method, 1)
    run_step(method, 2)  # a new round: references only, the predictor stays frozen
    assert [c[0] for c in calls[3:]] == ["train", "reference", "train"]
    other = build("dots", "selection.dots.predictor_hidden=8")
    other.load_state_dict(method.state_dict())
    labels = torch.linspace(0.0, 1.0, 9)
    emb = chooser.embeddings
    torch.testing.assert_close(other.chooser.adapter.predict(emb, emb[:9], labels),
                               chooser.adapter.predict(emb, emb[:9], labels))
