"""The update's forward (each prompt once, its sequences on its keys and values) against the
whole-sequence forward it replaced, the micro-batch sized by memory, and the update's phase
timings. CPU, fp32: the tolerances are those of fp32 sums taken in another order."""

import pytest
import torch
from transformers import Qwen2Config

from lze_trainer import actor as actor_module
from lze_trainer import config as C
from lze_trainer.actor import UpdateStats, update_bytes_per_token
from lze_trainer.batch import RolloutGroup, micro_batches
from lze_trainer.loss import (aggregate, clipped_surrogate, kl_penalty, token_log_probs,
                              token_log_probs_and_entropy)
from lze_trainer.metrics import Timer
from lze_trainer.rollout import Completion
from test_memory_bounds import model_dir, norm_of, stub_actor  # noqa: F401 (fixture)

TEMPERATURE = 0.7


def ragged_groups(seed: int) -> list[RolloutGroup]:
    """Groups of 1-4 responses of 1-9 tokens after prompts of 1-7 tokens (one-token prompts have
    an empty prefix), one group twice (the same prompt in two groups shares one prefix row)."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda low, high: int(torch.randint(low, high, (1,), generator=gen))
    groups = []
    for row in range(5):
        responses = [Completion(torch.randint(3, 100, (k,), generator=gen).tolist(),
                                (-torch.rand(k, generator=gen)).tolist(), False)
                     for k in (draw(1, 10) for _ in range(draw(1, 5)))]
        groups.append(RolloutGroup(row=row, prompt_id=row,
                                   prompt=torch.randint(3, 100, (draw(1, 8),), generator=gen).tolist(),
                                   responses=responses, rewards=[0.0] * len(responses),
                                   advantages=torch.randn(len(responses), generator=gen).tolist()))
    groups.append(RolloutGroup(row=5, prompt_id=0, prompt=groups[0].prompt,
                               responses=groups[1].responses, rewards=groups[1].rewards,
                               advantages=groups[1].advantages))
    return groups


def frozen_neighbour(model):
    """A frozen copy of ``model`` with its weights moved a little: a KL reference that differs."""
    import copy

    reference = copy.deepcopy(model).requires_grad_(False).eval()
    gen = torch.Generator().manual_seed(1)
    for p in reference.parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return reference


def previous_update(actor, groups, norm, reference) -> dict:
    """The update as it was: every sequence whole (prompt then response, right-padded) through
    the model in one micro-batch, log-probs of every position, the loss on the response tokens."""
    a, model = actor.cfg.actor, actor.engine.module
    sequences = [(g, j) for g in groups for j in range(len(g.responses))]
    length = max(len(g.prompt) + len(g.responses[j].token_ids) for g, j in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    attention, loss_mask = torch.zeros_like(ids), torch.zeros(len(sequences), length)
    for i, (g, j) in enumerate(sequences):
        start, end = len(g.prompt), len(g.prompt) + len(g.responses[j].token_ids)
        ids[i, :end] = torch.tensor(g.prompt + g.responses[j].token_ids)
        attention[i, :end] = 1
        loss_mask[i, start:end] = 1.0
    advantages = torch.tensor([g.advantages[j] for g, j in sequences])
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    logp, entropy = token_log_probs_and_entropy(logits, ids, TEMPERATURE, entropy=True)
    pg, _ = clipped_surrogate(logp, logp.detach(), advantages, a.clip_ratio_low, a.clip_ratio_high)
    loss = aggregate(pg, loss_mask, a.loss_agg_mode, norm)
    loss = loss - a.entropy_coef * aggregate(entropy, loss_mask, a.loss_agg_mode, norm)
    with torch.no_grad():
        ref_logits = reference(input_ids=ids, attention_mask=attention, use_cache=False).logits
    kl = kl_penalty(logp, token_log_probs(ref_logits, ids, TEMPERATURE), a.kl_estimator)
    loss = loss + a.kl_coef * aggregate(kl, loss_mask, a.loss_agg_mode, norm)
    loss.backward()
    pg, entropy, kl = pg.detach(), entropy.detach(), kl.detach()
    return {"pg_loss": float((pg * loss_mask).sum()), "entropy": float((entropy * loss_mask).sum()),
            "kl": float((kl * loss_mask).sum()), "grad": _grad(model)}


def _grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def update_now(actor, groups, norm, micro_batch_size, max_tokens=None) -> dict:
    stats = UpdateStats.zeros("cpu")
    stats.entropy_measured = True
    for batch in micro_batches(groups, micro_batch_size, 0, pad_id=0, max_tokens=max_tokens):
        actor._backward(batch, norm, stats, Timer())
    sums = stats.as_dict()
    return {key: sums[key] for key in ("pg_loss", "entropy", "kl")} | {
        "grad": _grad(actor.engine.module), "sequence_tokens": sums["sequence_tokens"]}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("shares_prefix", [True, False])
@pytest.mark.parametrize("micro_batch_size", [64, 3])
def test_update_equals_the_whole_sequence_update(model_dir, mode, shares_prefix,  # noqa: F811
                                                 micro_batch_size):
    """Loss terms (policy gradient, entropy, KL to a frozen copy) and the accumulated gradient
    of the shared-prefix path (and of whole sequences with logits kept only where needed, the
    path under gradient checkpointing) equal the previous whole-sequence update's, in one
    micro-batch and in several."""
    groups = ragged_groups(micro_batch_size)
    norm = norm_of(groups)
    overrides = (f"actor.loss_agg_mode={mode}", f"rollout.temperature={TEMPERATURE}",
                 "actor.entropy_coef=0.01", "actor.kl_coef=0.1")
    before = stub_actor(model_dir, torch.float32, *overrides)
    reference = frozen_neighbour(before.engine.module)
    expected = previous_update(before, groups, norm, reference)
    actor = stub_actor(model_dir, torch.float32, *overrides)
    actor.shares_prefix, actor.reference = shares_prefix, reference
    got = update_now(actor, groups, norm, micro_batch_size)
    for key in ("pg_loss", "entropy", "kl"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-5), key
    torch.testing.assert_close(got["grad"], expected["grad"], rtol=1e-4, atol=1e-6)
    whole = sum(len(g.prompt) + len(c.token_ids) for g in groups for c in g.responses)
    assert got["sequence_tokens"] == whole  # the FLOPs proxy counts every sequence whole


def test_a_prefix_runs_once_per_micro_batch(model_dir, monkeypatch):  # noqa: F811
    """One micro-batch of 6 groups: one pass over the 5 distinct prompts (one group repeats a
    prompt) and one over the 16 sequences after them, not 16 whole sequences."""
    groups = ragged_groups(0)
    actor = stub_actor(model_dir, torch.float32)
    calls = []
    forward = actor.engine.forward
    monkeypatch.setattr(actor.engine, "forward",
                        lambda **kw: calls.append(tuple(kw["input_ids"].shape)) or forward(**kw))
    (batch,) = micro_batches(groups, None, 1, pad_id=0)
    actor._backward(batch, norm_of(groups), UpdateStats.zeros("cpu"), Timer())
    sequences = sum(len(g.responses) for g in groups)
    longest_prompt = max(len(g.prompt) for g in groups)
    assert calls == [(5, longest_prompt - 1), (sequences, batch.input_ids.shape[1])]


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("shape", [dict(hidden_size=128, intermediate_size=512, layers=2, heads=4),
                                   dict(hidden_size=256, intermediate_size=1024, layers=3, heads=8),
                                   dict(hidden_size=448, intermediate_size=2432, layers=2, heads=7)])
def test_bytes_per_token_bound_what_autograd_saves(shape, checkpointing):
    """update_bytes_per_token, less the one layer it adds for the backward's temporaries, is
    what autograd saves per token of a Qwen2 forward (counted by a saved-tensors hook) plus the
    logits and their gradient, to within 15 % above it (never below)."""
    from transformers import Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=shape["hidden_size"],
                         intermediate_size=shape["intermediate_size"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=1, vocab_size=1000, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    parameters = {p.data_ptr() for p in model.parameters()}
    saved = {}

    def keep(t):
        if t.data_ptr() not in parameters:
            saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    n, length = 4, 64
    ids = torch.randint(0, config.vocab_size, (n, length))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(input_ids=ids, use_cache=False)
    measured = sum(saved.values()) / (n * length)
    kv = config.hidden_size // config.num_attention_heads  # one KV head
    layer = 4 * (10 * config.hidden_size + 2 * kv + 4 * config.intermediate_size)
    logits_and_gradient = 2 * 4 * config.vocab_size
    estimate = update_bytes_per_token(config, torch.float32, checkpointing) - layer
    assert 1.0 <= estimate / (measured + logits_and_gradient) <= 1.15


def test_micro_batch_tokens_follow_free_memory(model_dir, monkeypatch):  # noqa: F811
    """The token cap: half the free memory beyond the log-softmax's chunks over the bytes a token
    holds, floored to a power of two (so free memory's swings do not change it), the least over
    ranks; actor.max_tokens_per_micro_batch overrides it."""
    monkeypatch.setattr(actor_module.D, "all_reduce", lambda value, op="sum": value)
    actor = stub_actor(model_dir, torch.float32)
    actor.bytes_per_token = 1000
    vocab = actor.engine.module.config.vocab_size
    chunks = 3 * (2**26 // vocab) * vocab * 4
    caps = {}
    for free in (2 * chunks + 2 * 1000 * 3000, 2 * chunks + 2 * 1000 * 4000, 2 * chunks + 2 * 10**9):
        monkeypatch.setattr(actor_module, "free_memory", lambda world, free=free: free)
        caps[free] = actor.micro_batch_tokens()
    assert list(caps.values()) == [2048, 2048, 2**19]
    actor.cfg = C.load("tiny", ["actor.max_tokens_per_micro_batch=100"])
    assert actor.micro_batch_tokens() == 100


def test_update_reports_forward_backward_and_optimizer_apart(model_dir, monkeypatch):  # noqa: F811
    groups = ragged_groups(1)
    actor = stub_actor(model_dir, torch.float32)
    monkeypatch.setattr(actor, "_optimizer_step", lambda finite, stats: None, raising=False)
    timer = Timer()
    actor.update([micro_batches(groups, 4, 0, pad_id=0)], [norm_of(groups)], timer)
    parts = ("update_forward", "update_backward", "update_optimizer")
    assert set(timer.seconds) == set(parts) and all(timer.seconds[p] > 0 for p in parts)


def test_vllm_engine_leaves_the_text_to_the_trainer():
    """The vLLM engine asks for token ids and log-probs only (detokenize=False): the trainer
    decodes the responses it scores itself."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from lze_trainer.rollout import SamplingSpec, vllm_engine

    asked = []

    def generate(requests, sampling_params, use_tqdm):
        asked.extend(sampling_params)
        return [SimpleNamespace(outputs=[]) for _ in requests]

    engine = vllm_engine.VLLMEngine.__new__(vllm_engine.VLLMEngine)
    engine.llm, engine._sleeping = SimpleNamespace(generate=generate), set()
    engine.generate([[5, 6], [7]], [2, 1], SamplingSpec(1.0, 1.0, 4), seed=0)
    assert len(asked) == 2 and not any(p.detokenize for p in asked)


def test_prompt_features_take_as_many_prompts_as_the_token_cap_holds(model_dir, monkeypatch):  # noqa: F811
    """Without actor.micro_batch_size the prefill forward (HIVE's entropy, DOTS's embeddings)
    takes cap // data.max_prompt_tokens prompts a pass (the same count on every rank), and the
    features do not depend on it."""
    from types import SimpleNamespace

    from lze_trainer.methods import prefill

    actor = stub_actor(model_dir, torch.float32)
    actor.pad_id = 0
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    features, forward = {}, actor.engine.forward
    for size, cap in ((None, 128), (None, 10**6), (5, None)):
        cfg = C.load("tiny", [f"actor.micro_batch_size={'null' if size is None else size}"])
        monkeypatch.setattr(actor, "micro_batch_tokens", lambda cap=cap: cap, raising=False)
        ctx = SimpleNamespace(actor=actor, cfg=cfg,
                              generation=SimpleNamespace(world=SimpleNamespace(device="cpu")))
        calls = []
        monkeypatch.setattr(actor.engine, "forward", lambda calls=calls, **kw:
                            calls.append(len(kw["input_ids"])) or forward(**kw))
        features[(size, cap)] = prefill._forward(ctx, prompts, prefill.mean_prompt_entropy, False)
        assert calls == ([2, 2, 1] if cap == 128 else [5]), (size, cap)  # 128 // 64 = 2 a pass
    torch.testing.assert_close(features[(None, 128)], features[(5, None)], rtol=1e-5, atol=1e-6)
