"""Memory bounds of the GPU path, checked on the CPU.

* The bounded log-prob / entropy (lze_trainer.loss) equals the naive full-vocabulary one, values
  and gradients, on random logits.
* A TorchDispatchMode sees every tensor the actor's log-prob / loss / backward path allocates:
  none is a float32 tensor of n x L x V entries (and the recorder does catch the naive path).
* Packing by length with a token cap covers every sequence once, respects both caps, and leaves
  the loss and its gradient unchanged.
* The rollout engines: vLLM gets the allocator cache back before every wake-up and a lazy weight
  stream; the ``hf`` engine's per-step log-probs equal those of ``output_scores=True``.
* The actor's optimizer is torch's AdamW (fused on CUDA), never DeepSpeed's run-time-built op.
"""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import assert_within, gamma
from lze_trainer import config as C
from lze_trainer import tiny_model
from lze_trainer.actor import Actor, UpdateStats, update_bytes_per_token
from lze_trainer.batch import RolloutGroup, micro_batches, pack
from lze_trainer.loss import Normaliser, token_log_probs_and_entropy
from lze_trainer.metrics import Timer
from lze_trainer.rollout import Completion, SamplingSpec


# Unit roundoff of bfloat16 (8 significant bits): a gradient stored in the logits' dtype.
U_BF16 = 2.0**-8


def naive_error_bounds(logits, input_ids, temperature, w_logp, w_ent, use_entropy):
    """Bounds on |bounded - naive| of the log-probs, entropies ([n, L - 1], positions 1..L-1)
    and logit gradients ([n, L - 1, V]) of ``(logp w_logp).sum() + (H w_ent).sum()``, from the
    exact values in fp64; each side is within half of it.

    Both read the same fp32 x = logits / T. log p = x_t - lse with lse = log sum_k e^(x_k): a sum
    of V exponentials (relative gamma_V, absolute in the log) and a few roundings of values up
    to 1 + max|x| + |lse|: d_logp = gamma_{V+4} (1 + max|x| + |lse|). H = -sum_k p_k log p_k:
    each term moves by p_k (1 + |log p_k|) d_logp, the sum adds gamma_V H. The gradient
    [a (1[k = t] - p_k) + b (-p_k (log p_k + H))] / T (a, b the weights) moves with p_k
    (relative d_logp), log p_k and H, plus a sum over V of terms up to p_k (a + b (1 + H)) in
    log-softmax's backward and gamma_4 of its terms. Values that underflow into fp32's subnormals
    carry an absolute error instead, up to 2^-150 per operation (Higham 2002, eq. (2.8)): p_k
    (times the factor it is multiplied by), H's terms and the gradient's last roundings."""
    x = logits[:, :-1].double() / temperature
    vocab = x.shape[-1]
    lse = torch.logsumexp(x, dim=-1)
    logp = x - lse[..., None]
    p = logp.exp()
    entropy = -(p * logp).sum(dim=-1)
    d_logp = gamma(vocab + 4) * (1 + x.abs().amax(dim=-1) + lse.abs())
    d_ent = d_logp * (1 + entropy) + gamma(vocab) * entropy
    underflow = 2.0**-150
    d_ent = d_ent + vocab * underflow * (1 + logp.abs().amax(dim=-1))
    w_a = w_logp[:, 1:, None].double()
    w_b = w_ent[:, 1:, None].double() if use_entropy else torch.zeros_like(w_a)
    a, b = w_a.abs(), w_b.abs()
    dl, dh, h = d_logp[..., None], d_ent[..., None], entropy[..., None]
    chosen = torch.nn.functional.one_hot(input_ids[:, 1:], vocab).double()
    terms = a * (chosen + p) + b * p * (logp.abs() + h)
    d_grad = (a * p * dl + b * p * (dl * (logp + h).abs() + dl + dh)
              + gamma(vocab + 4) * p * (a + b * (1 + h)) + gamma(4) * terms
              + underflow * (a + b * (logp.abs() + h + 1) + 4)) / temperature
    grad = (w_a * (chosen - p) - w_b * p * (logp + h)) / temperature
    d_store = U_BF16 * 2 * (grad.abs() + d_grad) if logits.dtype == torch.bfloat16 else 0.0
    return 2 * d_logp, 2 * d_ent, 2 * d_grad + d_store


def naive(logits, input_ids, temperature):
    """The full-vocabulary reference: float32 log-softmax of every position."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    chosen = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    pad = lambda t: torch.nn.functional.pad(t, (1, 0))
    return pad(chosen), pad(entropy)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3), length=st.integers(2, 6), vocab=st.integers(2, 40),
       chunk=st.integers(1, 20), temperature=st.floats(0.3, 2.0),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), use_entropy=st.booleans(),
       seed=st.integers(0, 2**16))
def test_bounded_log_probs_equal_naive(n, length, vocab, chunk, temperature, dtype, use_entropy,
                                       seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, length, vocab, generator=gen)).to(dtype)
    ids = torch.randint(0, vocab, (n, length), generator=gen)
    w_logp, w_ent = torch.randn(2, n, length, generator=gen)
    grads = []
    for compute in ("bounded", "naive"):
        x = logits.clone().requires_grad_()
        if compute == "bounded":
            logp, ent = token_log_probs_and_entropy(x, ids, temperature, use_entropy, chunk)
            assert (ent is None) == (not use_entropy)
        else:
            logp, ent = naive(x, ids, temperature)
        loss = (logp * w_logp).sum() + ((ent * w_ent).sum() if use_entropy else 0.0)
        loss.backward()
        grads.append((logp.detach(), ent.detach() if use_entropy else None, x.grad.float()))
    (lb, eb, gb), (ln, en, gn) = grads
    assert lb.dtype == torch.float32
    d_logp, d_ent, d_grad = naive_error_bounds(logits, ids, temperature, w_logp, w_ent,
                                               use_entropy)
    assert torch.equal(lb[:, 0], ln[:, 0]) and not gb[:, -1].any() and not gn[:, -1].any()
    assert_within(lb[:, 1:], ln[:, 1:], d_logp, "log-probs")
    if use_entropy:
        assert_within(eb[:, 1:], en[:, 1:], d_ent, "entropies")
    assert_within(gb[:, :-1], gn[:, :-1], d_grad, "gradients")


class AllocationRecorder(TorchDispatchMode):
    """(dtype, numel) of every tensor an aten op returns while active, backward included."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen.append((t.dtype, t.numel()))
        return out

    def largest_float32(self) -> int:
        return max((numel for dtype, numel in self.seen if dtype == torch.float32), default=0)


class _Engine(torch.nn.Module):
    """The DeepSpeed engine's surface the actor's backward uses."""

    def __init__(self, model):
        super().__init__()
        self.module = model

    def forward(self, **kwargs):
        return self.module(**kwargs)

    def backward(self, loss, scale_wrt_gas=False):
        loss.backward()


VOCAB = 320  # the tiny model's V (its tokenizer's size; the token ids below stay under 100)
HIDDEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    spec = f"tiny:qwen2?hidden={HIDDEN}&layers=1&heads=2&kv_heads=1&vocab={VOCAB}"
    return str(tiny_model.build(spec, folder, ["Calculate 1 + 2.", "3"] * 50))


def stub_actor(model_dir, dtype, *overrides):
    """An Actor whose engine is the bare model (no DeepSpeed, no process group)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    actor = Actor.__new__(Actor)
    actor.cfg = C.load("tiny", list(overrides))
    actor.world = SimpleNamespace(device=torch.device("cpu"), size=1)
    actor.engine, actor.reference, actor.updates = _Engine(model), None, 0
    actor.on_gpu, actor.shares_prefix = False, True
    actor.bytes_per_token = update_bytes_per_token(model.config, dtype, False)
    return actor


def groups(seed, count=3, responses=4):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for row in range(count):
        completions = []
        for _ in range(responses):
            k = int(torch.randint(1, 12, (1,), generator=gen))
            completions.append(Completion(torch.randint(3, 100, (k,), generator=gen).tolist(),
                                          (-torch.rand(k, generator=gen)).tolist(), False))
        out.append(RolloutGroup(row=row, prompt_id=row,
                                prompt=torch.randint(3, 100, (5,), generator=gen).tolist(),
                                responses=completions, rewards=[0.0] * responses,
                                advantages=torch.randn(responses, generator=gen).tolist()))
    return out


def norm_of(gs):
    return Normaliser(tokens=float(sum(len(c.token_ids) for g in gs for c in g.responses)),
                      sequences=float(sum(len(g.responses) for g in gs)), max_response_length=12)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_no_float32_n_by_l_by_v_tensor_in_log_prob_loss_backward(model_dir, entropy_coef,
                                                                 monkeypatch):
    """The actor's real ``_backward`` (forward, log-probs, entropy, loss, backward) on a bf16
    model, as on a GPU: no float32 tensor of the micro-batch's n x L x V entries (or the
    n x (L - 1) x V of the shifted logits) exists; the largest is a chunk of the bounded log-softmax or the model's own activations."""
    import lze_trainer.loss as loss_module

    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 4 * VOCAB)  # 4-row chunks
    actor = stub_actor(model_dir, torch.bfloat16, f"actor.entropy_coef={entropy_coef}",
                       "actor.kl_coef=0")
    gs = groups(1)
    batch = micro_batches(gs, micro_batch_size=16, count=1, pad_id=0)[0]
    n, length = batch.input_ids.shape
    assert actor.engine.module.config.vocab_size == VOCAB
    stats = UpdateStats.zeros("cpu")
    stats.entropy_measured = True
    with AllocationRecorder() as recorder:
        actor._backward(batch, norm_of(gs), stats, Timer())
    full = n * (length - 1) * VOCAB  # a full-vocabulary copy of the shifted logits, or more
    # Beyond the 4-row chunks, the only float32 tensors are the model's own (RMSNorm upcasts
    # its [n, L, hidden] input).
    assert recorder.largest_float32() <= max(4 * VOCAB, n * length * HIDDEN) < full
    assert any(dtype == torch.bfloat16 and numel == n * length * VOCAB
               for dtype, numel in recorder.seen)  # the logits (and their gradient) were seen
    # The recorder catches the naive path.
    logits = torch.randn(n, length, VOCAB, dtype=torch.bfloat16, requires_grad=True)
    with AllocationRecorder() as recorder:
        naive(logits, batch.input_ids, 1.0)[0].sum().backward()
    assert recorder.largest_float32() >= full


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=20),
       micro_batch_size=st.integers(1, 8), cap=st.one_of(st.none(), st.integers(30, 120)))
def test_pack_covers_every_sequence_within_caps(lengths, micro_batch_size, cap):
    group = RolloutGroup(row=0, prompt_id=0, prompt=[],
                         responses=[Completion([1] * k, [0.0] * k, False) for k in lengths],
                         rewards=[0.0] * len(lengths))
    chunks = pack([group], micro_batch_size, cap)
    assert sorted(j for chunk in chunks for _, j in chunk) == list(range(len(lengths)))
    order = [lengths[j] for chunk in chunks for _, j in chunk]
    assert order == sorted(lengths, reverse=True)
    for chunk in chunks:
        assert len(chunk) <= micro_batch_size
        assert cap is None or len(chunk) * max(lengths[j] for _, j in chunk) <= cap
    # Greedy on the sorted list: no chunk could have taken the next chunk's first sequence.
    for chunk, following in zip(chunks, chunks[1:]):
        rows = len(chunk) + 1
        assert rows > micro_batch_size or (cap is not None and rows * lengths[chunk[0][1]] > cap)


def test_packing_leaves_loss_and_gradient_unchanged(model_dir):
    """The same sequences in one micro-batch (group order) and packed under a token cap: the
    summed micro-batch losses and the accumulated gradient agree to float tolerance."""
    gs = groups(2)
    results = []
    for size, cap in ((16, None), (3, 40)):
        actor = stub_actor(model_dir, torch.float32, "actor.entropy_coef=0.01")
        norm = norm_of(gs)
        batches = micro_batches(gs, size, 0, pad_id=0, max_tokens=cap)
        if cap is not None:
            assert len(batches) > 2
            assert all(b.input_ids.numel() <= cap for b in batches)
        stats = UpdateStats.zeros("cpu")
        stats.entropy_measured = True
        for b in batches:
            actor._backward(b, norm, stats, Timer())
        grad = torch.cat([p.grad.flatten() for p in actor.engine.parameters()])
        results.append((stats.sums, grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-6)


def test_entropy_only_on_its_cadence_or_with_a_coefficient(model_dir, monkeypatch):
    gs = groups(3, count=1)
    for overrides, expected in ((["actor.entropy_every=2"], [True, False, True, False]),
                                (["actor.entropy_every=0"], [False] * 4),
                                (["actor.entropy_every=0", "actor.entropy_coef=0.1"], [True] * 4)):
        actor = stub_actor(model_dir, torch.float32, *overrides)
        monkeypatch.setattr(actor, "_optimizer_step", lambda finite, stats: None, raising=False)
        seen = []
        for _ in range(4):
            stats = actor.update([micro_batches(gs, 8, 1, pad_id=0)], [norm_of(gs)])
            seen.append(stats.entropy_measured)
            assert (stats.as_dict()["entropy"] > 0) == stats.entropy_measured
        assert seen == expected, overrides


def test_token_cap_and_entropy_cadence_are_validated():
    with pytest.raises(C.ConfigError, match="actor.max_tokens_per_micro_batch"):
        C.load("tiny", ["actor.max_tokens_per_micro_batch=8"])
    with pytest.raises(C.ConfigError, match="actor.entropy_every"):
        C.load("tiny", ["actor.entropy_every=-1"])


# ---------------------------------------------------------------------- rollout engines


class _FakeLLM:
    def __init__(self, calls):
        self.calls = calls

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def collective_rpc(self, method, kwargs):
        stream = kwargs["weights_iterator"]
        assert not isinstance(stream, (list, tuple))  # a stream, not every weight at once
        self.calls.append((method, [name for name, _ in stream]))

    def reset_prefix_cache(self):
        pass


@pytest.mark.parametrize("on_gpu", [True, False])
def test_vllm_returns_cached_memory_before_every_wake_up(monkeypatch, on_gpu):
    from lze_trainer.rollout import vllm_engine

    calls = []
    monkeypatch.setattr(vllm_engine.torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    engine = vllm_engine.VLLMEngine.__new__(vllm_engine.VLLMEngine)
    engine.llm, engine.on_gpu, engine.sleep_mode, engine._sleeping = _FakeLLM(calls), on_gpu, True, set()
    produced = []

    def weights():
        for name in ("a", "b"):
            produced.append(name)
            yield name, torch.zeros(1)

    engine.sleep()
    stream = weights()
    engine.load_weights(stream)
    engine._wake(["kv_cache"])
    release = ["empty_cache"] if on_gpu else []
    assert calls == [("sleep", 2), *release, ("wake_up", ("weights",)),
                     ("reload_weights", ["a", "b"]), *release, ("wake_up", ("kv_cache",))]
    assert produced == ["a", "b"]


@pytest.mark.parametrize("static", ["true", "false"])
def test_hf_engine_log_probs_equal_output_scores(model_dir, static):
    """Both decoders of the hf engine (the static cache's step and ``generate`` with the per-step
    recorder) give the log-probs ``output_scores=True`` gives (same seed, same tokens), under
    temperature and top-p, without keeping every step's scores."""
    from lze_trainer.rollout.base import reseed
    from lze_trainer.rollout.hf_engine import HFEngine

    cfg = C.load("tiny", ["model.dtype=float32", f"rollout.hf_static_cache={static}"])
    engine = HFEngine(cfg, model_dir, SimpleNamespace(device=torch.device("cpu")))
    prompts = [[5, 6, 7], [8, 9]]
    for spec in (SamplingSpec(0.7, 0.9, 6), SamplingSpec(1.3, 1.0, 5), SamplingSpec(0.0, 1.0, 4)):
        reseed(1)
        got = engine._generate_rows(prompts, spec)
        reseed(1)
        sampled = spec.temperature > 0
        ids = torch.tensor([[engine.pad_id, 5, 6, 7], [engine.pad_id, engine.pad_id, 8, 9]])
        out = engine.model.generate(
            input_ids=ids, attention_mask=(ids != engine.pad_id).long(), do_sample=sampled,
            temperature=spec.temperature if sampled else None, top_p=spec.top_p if sampled else None,
            top_k=0 if sampled else None, max_new_tokens=spec.max_new_tokens, output_scores=True,
            return_dict_in_generate=True, pad_token_id=engine.pad_id,
            eos_token_id=sorted(engine.eos_ids))
        tokens = out.sequences[:, ids.shape[1]:]
        scores = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], dim=1)
        expected = scores.gather(-1, tokens[..., None]).squeeze(-1)
        for row, completion in enumerate(got):
            k = len(completion.token_ids)
            assert completion.token_ids == tokens[row, :k].tolist()
            torch.testing.assert_close(torch.tensor(completion.logprobs), expected[row, :k],
                                       rtol=1e-5, atol=1e-5)


def test_hf_engine_rows_per_generate_call(model_dir, monkeypatch):
    """64 rows a call on a CPU; on a GPU as many as a quarter of the free memory holds at the
    arithmetic of ``generate_bytes_per_row`` (Qwen2.5-1.5B's shape: 2 x 28 layers x 2 KV heads x
    128 x 2 bytes = 28 KiB a token, plus 3 x V float32 scores) for the bucketed cache length,
    rounded down to a row bucket."""
    from transformers import Qwen2Config

    from lze_trainer.rollout import hf_engine

    qwen = Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151_936)
    per_row = hf_engine.generate_bytes_per_row(qwen, torch.bfloat16, 4096)
    assert per_row == 2 * 28 * 2 * 128 * 4096 * 2 + 3 * 151_936 * 4
    engine = hf_engine.HFEngine(C.load("tiny", ["model.dtype=float32"]), model_dir,
                                SimpleNamespace(device=torch.device("cpu")))
    assert engine._rows_per_call(4096) == hf_engine.CPU_ROWS_PER_CALL
    engine.device = torch.device("cuda")
    free = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, free))
    tiny = hf_engine.generate_bytes_per_row(engine.model.config, engine.model.dtype, 128)
    rows = int(0.25 * free) // tiny  # at 100 tokens' cache bucket, 128
    assert engine._rows_per_call(100) == hf_engine.bucket_down(rows) > 2 * rows / 3
    free = 1000  # less than one row: still one row a call
    assert engine._rows_per_call(100) == 1


# ---------------------------------------------------------------------- optimizer


@pytest.mark.parametrize("on_gpu", [True, False])
def test_optimizer_is_torch_adamw_without_runtime_op_build(on_gpu):
    actor = Actor.__new__(Actor)
    actor.cfg, actor.on_gpu, actor.bf16 = C.load("tiny"), on_gpu, on_gpu
    actor.schedule = SimpleNamespace(lr=1e-3)
    assert "optimizer" not in actor._deepspeed_config()  # DeepSpeed builds no FusedAdam
    params = [torch.nn.Parameter(torch.zeros(3))]
    optimizer = actor._client_optimizer()(params)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["fused"] is on_gpu
    actor.cfg = C.load("tiny", ["actor.offload=true", "actor.zero_stage=2"])
    assert actor._client_optimizer() is None  # ZeRO-Offload: DeepSpeed's CPU Adam
    assert actor._deepspeed_config()["optimizer"]["type"] == "AdamW"


def test_update_counts_every_token_of_its_trained_sequences(model_dir):
    """The FLOPs proxy's update tokens: prompt and response of every trained sequence (the pass
    runs through both); the loss's tokens are the responses only; padding micro-batches count
    nothing."""
    gs = groups(4)
    actor = stub_actor(model_dir, torch.float32)
    stats = UpdateStats.zeros("cpu")
    batches = micro_batches(gs, 5, 4, pad_id=0)  # 12 sequences in 3 chunks + 1 padding batch
    for b in batches:
        actor._backward(b, norm_of(gs), stats, Timer())
    sums = stats.as_dict()
    responses = sum(len(c.token_ids) for g in gs for c in g.responses)
    prompts = sum(len(g.prompt) * len(g.responses) for g in gs)
    assert sums["tokens"] == responses
    assert sums["sequence_tokens"] == prompts + responses
