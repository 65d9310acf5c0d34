"""The hf engine's static-cache decoder (lze_trainer.rollout.static_decode) on the CPU, where its
step runs eagerly; on a GPU the same step is captured as a CUDA graph.

* Tokens equal ``generate``'s, greedy and sampled under the same seed (temperature, top-p, rows
  that end at different steps); log-probs within 1e-4 in float32 (:data:`FP32_LOGPROB_ATOL`),
  and equal to a teacher-forced forward pass with padded rows.
* The bucketing and step keys, without CUDA: a run builds a handful of steps, not one per call.
* What a capture relies on: warm-up steps before the capture change nothing the next call
  decodes, the step reads nothing back to the host and writes only the state's tensors in place.
* Ops the host launches per decoded token (torch profiler): the step counted as the one graph
  replay it is on a GPU, against ``generate``.
* The sampling and log-prob arithmetic in bfloat16, and the grouped-query decode attention.
"""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lze_trainer import config as C
from lze_trainer.rollout import grouped_attention
from lze_trainer.rollout import static_decode as S
from lze_trainer.rollout.base import SamplingSpec, reseed
from lze_trainer.rollout.generate_decode import generate_decode
from lze_trainer.rollout.hf_engine import HFEngine, require_static_decoding

CPU = torch.device("cpu")
VOCAB = 384
PAD = 0
# Prompt lengths 3..9 (left padding to 9); ids avoid the padding id.
PROMPTS = [[5 + (7 * i + 3 * j) % 300 for j in range(3 + i % 7)] for i in range(12)]
U_BF16 = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)
# float32: the two paths' forwards sum attention in other orders (a 9-token dynamic cache against
# a 64-slot static one, other SDPA kernels): each dot product of n <= 128 terms rounds within
# n * 2^-24 of its magnitude, about 1e-5 of the logits (|z| <= 10 here) per layer in the worst
# case; measured up to 1.4e-5 on the log-probs. The log-prob arithmetic itself (log of the
# gathered softmax against logit - logsumexp) differs by a few float32 roundings (1e-6).
FP32_LOGPROB_ATOL = 1e-4


def _config(**overrides):
    from transformers import Qwen2Config

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                 initializer_range=0.3, tie_word_embeddings=True, max_position_embeddings=512,
                 pad_token_id=PAD, eos_token_id=1)
    return Qwen2Config(**{**shape, **overrides})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Qwen2 with grouped heads (4 query heads on 2 KV heads) and peaked logits (initializer
    range 0.3: the top token holds 15-40 % of the mass), whose end-of-sequence token is the
    fourth token of the first prompt's greedy answer, so rows end at different steps."""
    from transformers import GenerationConfig, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_config()).eval()
    ids, attention = _left_padded(PROMPTS[:1])
    with torch.no_grad():
        answer = model.generate(input_ids=ids, attention_mask=attention, do_sample=False,
                                max_new_tokens=4, eos_token_id=None, pad_token_id=PAD)
    model.config.eos_token_id = int(answer[0, -1])
    folder = tmp_path_factory.mktemp("static-decode-model")
    model.save_pretrained(folder)
    GenerationConfig.from_model_config(model.config).save_pretrained(folder)
    return str(folder)


def _left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        attention[row, width - len(p):] = 1
    return ids, attention


def _engine(model_dir, static=True):
    cfg = C.load("tiny", ["model.dtype=float32", f"rollout.hf_static_cache={str(static).lower()}"])
    return HFEngine(cfg, model_dir, SimpleNamespace(device=CPU))


@pytest.fixture(scope="module")
def engines(model_dir):
    return _engine(model_dir, static=True), _engine(model_dir, static=False)


SPECS = [SamplingSpec(0.0, 1.0, 24), SamplingSpec(1.0, 1.0, 24), SamplingSpec(0.7, 0.9, 24),
         SamplingSpec(1.3, 1.0, 24)]


@pytest.mark.parametrize("spec", SPECS, ids=["greedy", "t1", "t0.7-p0.9", "t1.3"])
def test_tokens_and_log_probs_equal_generates(engines, spec):
    """8 rows (a row bucket: no padded rows, so both draw the same random numbers): the same
    tokens, ends and log-probs as ``generate`` with the recorder, from the same seed."""
    static, plain = engines
    prompts = PROMPTS[:8]
    reseed(4)
    got = static._generate_rows(prompts, spec)
    reseed(4)
    want = plain._generate_rows(prompts, spec)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.truncated for c in got] == [c.truncated for c in want]
    if spec.temperature == 0:
        assert len({len(c.token_ids) for c in got}) > 1  # rows ended at different steps
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs),
                                   rtol=0, atol=FP32_LOGPROB_ATOL)


def test_padded_rows_decode_the_real_rows_greedy_tokens(engines):
    """5 rows run as a bucket of 6 (the extra row repeats the first prompt): greedy tokens as
    ``generate``'s."""
    static, plain = engines
    spec = SamplingSpec(0.0, 1.0, 20)
    got = static._generate_rows(PROMPTS[3:8], spec)
    want = plain._generate_rows(PROMPTS[3:8], spec)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_log_probs_are_a_teacher_forced_pass(engines):
    """Sampled with top-p from 5 rows (a bucket of 6): each token's log-prob is the processed
    distribution's of a plain forward pass over prompt + response, no cache."""
    from transformers import TopPLogitsWarper

    static, _ = engines
    spec = SamplingSpec(0.8, 0.95, 16)
    prompts = PROMPTS[4:9]
    reseed(5)
    completions = static._generate_rows(prompts, spec)
    for prompt, completion in zip(prompts, completions):
        sequence = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = static.model(sequence).logits[0, len(prompt) - 1:-1] / spec.temperature
        scores = TopPLogitsWarper(spec.top_p)(None, logits)
        expected = scores.log_softmax(-1).gather(-1, sequence[0, len(prompt):, None])[:, 0]
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, rtol=0,
                                   atol=FP32_LOGPROB_ATOL)


# ------------------------------------------------------------------ buckets and step keys


def test_buckets_are_powers_of_two_and_three_halves():
    ladder = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert [S.bucket_up(n) for n in ladder] == ladder
    assert [S.bucket_down(n) for n in ladder] == ladder
    for n in range(1, 600):
        up, down = S.bucket_up(n), S.bucket_down(n)
        assert n <= up < 1.5 * n + 1 and 2 * n / 3 - 1 < down <= n
        assert up in ladder + [768] and down in ladder
    assert S.bucket_up(5, S.MIN_LENGTH) == 64 and S.bucket_up(65, S.MIN_LENGTH) == 96
    assert all(S.bucket_up(n, S.MIN_LENGTH) % 16 == 0 for n in range(1, 5000))


def test_a_run_builds_a_handful_of_steps():
    """The keys a trainer's calls map to: 50 training calls of 128 rows with prompts of 15-60
    tokens and 256 new tokens, held-out passes of 300 rows in calls of at most 128, greedy and
    sampled: 2 shapes (128 and 48 rows, 384 slots), 5 steps."""
    gen = torch.Generator().manual_seed(0)
    keys = set()
    for _ in range(50):
        width = int(torch.randint(15, 61, (1,), generator=gen))
        keys.add((S.DecodeShape.of(128, width, 256), S.Sampling.of(1.0, 1.0)))
    for temperature in (0.0, 0.6):
        for rows in (128, 128, 44):
            keys.add((S.DecodeShape.of(rows, 60, 256), S.Sampling.of(temperature, 0.9)))
    assert len({shape for shape, _ in keys}) == 2 and len(keys) == 5
    assert S.Sampling.of(0.0, 0.9) == S.Sampling.of(-1.0, 1.0)  # greedy ignores top-p


class _CountingCapture:
    """A capture that runs the step as it is and counts the builds."""

    def __init__(self, warmup=0):
        self.built, self.warmup = 0, warmup

    def __call__(self, step):
        self.built += 1
        for _ in range(self.warmup):  # as cuda_graph runs it before capturing
            step()
        return step


def _decoder(engine, capture, check_every=1):
    return S.StaticDecoder(engine.model, engine.eos_ids, engine.pad_id, capture, check_every)


def test_steps_are_built_once_per_shape_and_sampling(engines):
    static, _ = engines
    capture = _CountingCapture()
    decoder = _decoder(static, capture)
    ids, attention = _left_padded(PROMPTS[:8])
    for _ in range(3):
        decoder.decode(ids, attention, 1.0, 1.0, 8)
    assert capture.built == 1 and len(decoder.states) == 1
    decoder.decode(ids, attention, 0.0, 1.0, 8)  # greedy: a second step of the same shape
    assert capture.built == 2 and len(decoder.states) == 1
    decoder.decode(ids[:3], attention[:3], 0.0, 1.0, 8)  # another shape replaces the first
    assert capture.built == 3 and list(decoder.states) == [S.DecodeShape(3, 64)]
    decoder.decode(ids[:3], attention[:3], 0.0, 1.0, 1)  # one token: the prefill alone
    assert capture.built == 3 and decoder.captures == 3 and decoder.capture_seconds > 0


def test_engine_reports_compile_seconds_once(engines):
    static, plain = engines
    static.decoder.states.clear()
    static._generate_rows(PROMPTS[:2], SamplingSpec(1.0, 1.0, 4))
    assert static.take_compile_seconds() > 0 and static.take_compile_seconds() == 0
    assert plain.take_compile_seconds() == 0


def test_warm_up_before_a_capture_changes_nothing_decoded(engines):
    """cuda_graph runs the step eagerly before capturing it, from a prefilled state and with the
    random generators forked: the next call's prefill resets what those steps wrote, and the
    draws are the seed's, so the tokens are those of a decoder that never warmed up."""
    static, _ = engines
    ids, attention = _left_padded(PROMPTS[:8])
    outputs = []
    for warmup in (0, S.WARMUP_STEPS):
        decoder = _decoder(static, _CountingCapture(warmup))
        reseed(11)
        outputs.append(decoder.decode(ids, attention, 1.0, 1.0, 12))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])


def test_cuda_graph_follows_torchs_capture_recipe(monkeypatch):
    """Without a GPU, torch.cuda's streams and graphs replaced by autospecced fakes (every call
    checked against torch's real signatures): the step runs :data:`WARMUP_STEPS` times on a side
    stream, then once inside a thread-local capture, and the graph's replay comes back."""
    from unittest import mock

    fakes = {name: mock.create_autospec(getattr(torch.cuda, name)) for name in
             ("Stream", "stream", "current_stream", "CUDAGraph", "graph")}
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    calls = []
    fakes["graph"].return_value.__enter__.side_effect = lambda *a: calls.append("capture")
    replay = S.cuda_graph(lambda: calls.append("step"))
    assert calls == ["step"] * S.WARMUP_STEPS + ["capture", "step"]
    graph = fakes["CUDAGraph"].return_value
    fakes["graph"].assert_called_once_with(graph, capture_error_mode="thread_local")
    fakes["stream"].assert_called_once_with(fakes["Stream"].return_value)
    assert replay == graph.replay


def test_a_failed_capture_decodes_eagerly_with_a_warning(engines):
    """A capture that raises (as torch.cuda.graph does on an op it cannot capture) after its
    warm-up steps: the console gets the reason, the shape decodes eagerly, the same tokens."""
    static, _ = engines
    ids, attention = _left_padded(PROMPTS[:8])

    def failing(step):
        for _ in range(S.WARMUP_STEPS):
            step()
        raise RuntimeError("operation not permitted when stream is capturing")

    outputs = []
    for capture in (S.eager, failing):
        decoder = _decoder(static, capture)
        reseed(2)
        with pytest.warns(RuntimeWarning, match="lze_trainer: hf engine: capturing") if \
                capture is failing else contextlib.nullcontext():
            outputs.append(decoder.decode(ids, attention, 1.0, 1.0, 10))
    assert decoder.capture_failures == 1 and decoder.captures == 1
    assert torch.equal(outputs[0][0], outputs[1][0])


HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal", "allclose",
              "unique", "masked_select", "repeat_interleave"}


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_decode_step_reads_nothing_back_and_moves_no_tensor(engines):
    """What capturing the step as a CUDA graph needs: no op whose result the host must read
    (``.item()``, data-dependent shapes), and every tensor the step writes stays where it was
    (the state, the KV cache)."""
    static, _ = engines
    decoder = _decoder(static, S.eager)
    ids, attention = _left_padded(PROMPTS[:8])
    sampling = S.Sampling.of(0.7, 0.9)
    decoder.decode(ids, attention, 0.7, 0.9, 4)
    state = decoder.states[S.DecodeShape.of(8, ids.shape[1], 4)]
    tensors = {name: t for name, t in vars(state).items() if isinstance(t, torch.Tensor)}
    tensors.update({f"cache{i}.{n}": getattr(layer, n) for i, layer in enumerate(
        state.cache.layers) for n in ("keys", "values", "cumulative_length")})
    addresses = {name: t.data_ptr() for name, t in tensors.items()}
    before = {name: t.clone() for name, t in tensors.items()}
    with torch.no_grad(), _OpRecorder() as recorder:
        decoder._step(state, sampling)
    assert recorder.ops and not HOST_READS & set(recorder.ops), sorted(set(recorder.ops))
    assert {name: t.data_ptr() for name, t in tensors.items()} == addresses
    changed = {name for name, t in tensors.items() if not torch.equal(t, before[name])}
    assert {"token", "position", "slot", "visible", "count", "tokens", "logprobs"} <= changed


# ------------------------------------------------------------------ ops per decoded token


def _top_level_ops(run) -> int:
    """Ops the host dispatches (the torch profiler's events with no parent op)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for event in prof.events() if event.cpu_parent is None)


def _as_one_launch(step):
    """The step as one range, as its CUDA graph is one launch on a GPU."""
    def replay():
        with torch.profiler.record_function("graph replay"):
            step()
    return replay


def _ops_per_token(decode, short=9, long=41) -> float:
    """Marginal top-level ops per decoded token (the prefill and set-up cancel out)."""
    return (_top_level_ops(lambda: decode(long)) - _top_level_ops(lambda: decode(short))) \
        / (long - short)


def test_new_path_launches_at_most_a_fifth_of_generates_ops_per_token(engines, capsys):
    """Greedy, 8 rows, no end-of-sequence (the answers run to their length): the host's ops per
    decoded token with ``generate`` (every op of the model and of the sampling loop), with the
    static decoder's step run eagerly (what one graph holds), and with the step counted as the
    one launch of its graph replay and the host's check every :data:`CHECK_EVERY` tokens."""
    static, _ = engines
    ids, attention = _left_padded(PROMPTS[:8])
    no_end = [VOCAB + 1]  # an id the model cannot write

    def plain(n):
        generate_decode(static.model, ids, attention, 0.0, 1.0, n, PAD, no_end)

    def decoder_run(capture, check_every):
        decoder = S.StaticDecoder(static.model, no_end, PAD, capture, check_every)
        decoder.decode(ids, attention, 0.0, 1.0, 4)  # the step built before profiling
        return lambda n: decoder.decode(ids, attention, 0.0, 1.0, n)

    generate_ops = _ops_per_token(plain)
    eager_ops = _ops_per_token(decoder_run(S.eager, 1))
    captured_ops = _ops_per_token(decoder_run(_as_one_launch, S.CHECK_EVERY))
    with capsys.disabled():
        print(f"\nhost ops per decoded token: generate {generate_ops:.1f}, static step eager "
              f"{eager_ops:.1f}, captured {captured_ops:.2f}")
    assert captured_ops <= generate_ops / 5
    assert 1 <= captured_ops < 1.5  # the replay, and a check's few ops every 16 tokens


# ------------------------------------------------------------------ arithmetic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_token_is_multinomials_draw(dtype, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(16, 1000, generator=gen)).to(dtype)
    torch.manual_seed(7)
    token, _ = S.choose(logits, S.Sampling.of(temperature, 1.0))
    scaled = logits if temperature == 1.0 else (
        (logits - logits.amax(-1, keepdim=True)) / temperature)
    torch.manual_seed(7)
    assert torch.equal(token, torch.multinomial(scaled.softmax(-1), 1)[:, 0])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_bfloat16_log_prob_is_within_its_rounding(temperature):
    """Against the exact log-softmax (float64) of the bfloat16 logits over T. Error terms: the
    softmax's bfloat16 output (relative u = 2^-8, so at most u(1 + u) in its log) and, for
    T != 1, the rounding of (z - max) and of its quotient by T (2u |z - max| / T for each
    logit, in the chosen one and in the mean over the distribution)."""
    gen = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(32, 151_936 // 8, generator=gen) + 10).bfloat16()
    token, logprob = S.choose(logits, S.Sampling.of(0.0, 1.0) if temperature == 1.0
                              else S.Sampling.of(temperature, 1.0))
    z = logits.double()
    exact = (z / temperature).log_softmax(-1)
    distance = (z.amax(-1, keepdim=True) - z) / temperature
    p = exact.exp()
    scaling = 0.0 if temperature == 1.0 else 2 * U_BF16 * (
        distance.gather(-1, token[:, None])[:, 0] + (p * distance).sum(-1))
    bound = U_BF16 * (1 + U_BF16) + scaling + 1e-6
    error = (logprob.double() - exact.gather(-1, token[:, None])[:, 0]).abs()
    assert (error <= bound).all(), (error - bound).max()


def test_grouped_decode_attention_equals_repeated_heads():
    """One query token, 6 query heads on 2 KV heads, a padded mask: transformers' sdpa attention
    (KV heads repeated) and the grouped call agree; a prefill (several queries) is sdpa's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    key, value = (torch.randn(5, 2, 64, 16, generator=gen) for _ in range(2))
    mask = torch.rand(5, 1, 1, 64, generator=gen) < 0.7
    mask[..., 0] = True
    for q_len in (1, 4):
        query = torch.randn(5, 6, q_len, 16, generator=gen)
        attention = mask.expand(5, 1, q_len, 64)
        got, _ = grouped_attention.grouped_decode_attention(module, query, key, value, attention,
                                                            scaling=0.25)
        want, _ = sdpa_attention_forward(module, query, key, value, attention, scaling=0.25)
        assert got.shape == want.shape == (5, q_len, 6, 16)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sliding_window_models_are_refused():
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(_config(use_sliding_window=True, sliding_window=16,
                                     max_window_layers=1, layer_types=None))
    with pytest.raises(ValueError, match="hf_static_cache=false"):
        require_static_decoding(model)
    require_static_decoding(Qwen2ForCausalLM(_config()))
