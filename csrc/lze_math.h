// Scalar math of Learning-Zone Energy selection, shared by the C++ CPU kernels and the CUDA
// kernels (and, through them, the CUDA emulator). Everything here is a pure function of its
// arguments, written as __host__ __device__ inline so both compilers see the same expression
// trees. Every backend must produce bit-identical energies for binary rewards, so the order of
// operations below is part of the specification (docs/spec.md §3) and is mirrored literally by
// lze_kernels/reference.py and the Triton kernels. Build with FMA contraction off
// (-ffp-contract=off, nvcc --fmad=false) so a*b+c is never fused differently per backend.
#pragma once
#include <stdint.h>

// Under nvcc these are device functions too; under g++ (the C++ CPU kernels, and the CUDA
// sources built against the emulator, where device code is host code) they are plain inline.
#if defined(__CUDACC__)
#define LZE_HD __host__ __device__ __forceinline__
#else
#define LZE_HD inline
#endif

#include <math.h>

namespace lze {

// Layout of the persistent per-prompt state: one 32-byte record per prompt, its four float fields
// then its four int fields (a PromptState, below), so that on a GPU a prompt's state is one
// 32-byte sector: its gather, claim and scatter touch one random sector per row (two 16-byte
// loads and stores of it). Mirrored by lze_kernels/layout.py.
enum FloatField : int { kDInit = 0, kEma = 1, kLastPassRate = 2, kLastEnergy = 3, kNumFloatFields = 4 };
enum IntField : int { kSeen = 0, kSolvedStreak = 1, kFlags = 2, kClaim = 3, kNumIntFields = 4 };
// 32-bit words per record, and the word where the int fields start.
enum RecordWord : int { kRecordWords = 8, kIntFieldsAt = 4 };
enum Flag : int32_t { kFlagPruned = 1, kFlagReplay = 2 };

// Fault bits recorded in the device-side fault word when check_inputs is off.
enum Fault : int32_t {
  kFaultIdOutOfRange = 1,
  kFaultDuplicateId = 2,
  kFaultNonFiniteReward = 4,
  kFaultRewardOutOfRange = 8,
};

// Reward element types accepted by the kernels (upcast to fp32 on load).
enum RewardDType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// A prompt counts as solved when its pass rate reaches this (docs/spec.md §5).
constexpr float kSolvedThreshold = 1.0f - 1e-6f;

// Scalar parameters, already rounded to fp32 on the host (one_minus_beta is computed in double
// there and rounded once, exactly as torch rounds a Python scalar).
struct Params {
  float beta;
  float one_minus_beta;
  float d_min;
  float alpha;
  float eps;
  int32_t norm_by_std;
  int32_t prune_after;
};

LZE_HD float bf16_bits_to_float(uint16_t bits) {
  union { uint32_t u; float f; } v;
  v.u = static_cast<uint32_t>(bits) << 16;
  return v.f;
}

// IEEE binary16 -> binary32, exact for every input (normals, subnormals, inf, nan).
LZE_HD float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113u;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  union { uint32_t u; float f; } v;
  v.u = bits;
  return v.f;
}

LZE_HD float load_reward(const void* rewards, int64_t index, int32_t dtype) {
  if (dtype == kBF16) return bf16_bits_to_float(static_cast<const uint16_t*>(rewards)[index]);
  if (dtype == kF16) return f16_bits_to_float(static_cast<const uint16_t*>(rewards)[index]);
  return static_cast<const float*>(rewards)[index];
}

// Fault bits of one valid reward (0 when it is a finite number in [0, 1]).
LZE_HD int32_t reward_fault(float r) {
  if (!(r == r) || r - r != 0.0f) return kFaultNonFiniteReward;  // NaN, or +-inf
  if (r < 0.0f || r > 1.0f) return kFaultRewardOutOfRange;
  return 0;
}

// GRPO advantage of one rollout (docs/spec.md §2): (r - mean) / (std + eps), or r - mean (Dr. GRPO).
LZE_HD float grpo_advantage(float r, float mean, float std, int64_t count, const Params& p) {
  if (count < 2) return 0.0f;
  const float centred = r - mean;
  return p.norm_by_std ? centred / (std + p.eps) : centred;
}

// Unbiased standard deviation from the sum of squared deviations over `count` rewards.
LZE_HD float unbiased_std(float sum_sq_dev, int64_t count) {
  if (count < 2) return 0.0f;
  return sqrtf(sum_sq_dev / static_cast<float>(count - 1));
}

// Uncertainty u = 4 p (1 - p): zero at p in {0, 1}, 1 at p = 1/2.
LZE_HD float uncertainty(float p) { return (4.0f * p) * (1.0f - p); }

// Anchor difficulty, set on first sight only: D = max(1 - p, d_min).
LZE_HD float anchor_difficulty(float p, const Params& prm) { return fmaxf(1.0f - p, prm.d_min); }

// Momentum m = min(2 |p - ema_before|, 1).
LZE_HD float momentum(float p, float ema_before) { return fminf(2.0f * fabsf(p - ema_before), 1.0f); }

// E = D * u * (1 + alpha m), evaluated left to right.
LZE_HD float energy(float d_init, float u, float m, const Params& prm) {
  return (d_init * u) * (1.0f + prm.alpha * m);
}

LZE_HD float ema_update(float ema, float p, const Params& prm) {
  return prm.beta * ema + prm.one_minus_beta * p;
}

// One prompt's state record: its float fields then its int fields, in the order of the enums above.
struct PromptState {
  float d_init, ema, last_pass_rate, last_energy;
  int32_t seen, solved_streak, flags, claim;
};

// A prompt's state after a step, and the momentum its energy (next.last_energy) used.
struct PromptStep {
  PromptState next;
  float momentum;
};

// docs/spec.md §3 and §5 for a prompt that scored pass rate p in the step stamped `stamp`: anchor on first
// sight, momentum against the EMA before the update, energy, EMA, solved streak and pruning.
LZE_HD PromptStep advance_prompt(const PromptState& s, float p, int32_t stamp, const Params& prm) {
  const bool first_sight = s.seen == 0;
  const float d_init = first_sight ? anchor_difficulty(p, prm) : s.d_init;
  const float m = first_sight ? 0.0f : momentum(p, s.ema);
  const float e = energy(d_init, uncertainty(p), m, prm);
  const float ema = first_sight ? p : ema_update(s.ema, p, prm);
  const int32_t streak = p >= kSolvedThreshold ? s.solved_streak + 1 : 0;
  // Writing the flags whole clears the replay bit and un-prunes a replay that failed.
  const int32_t flags = streak >= prm.prune_after ? kFlagPruned : 0;
  return PromptStep{{d_init, ema, p, e, s.seen + 1, streak, flags, stamp}, m};
}

// Philox-4x32-10 (Salmon et al., SC'11), first output word, with the constants and round
// structure of triton.language.random, so tl.randint(seed, offset) and this agree bit for bit.
LZE_HD uint32_t mulhi32(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

LZE_HD uint32_t philox_4x32_10(uint32_t key0, uint32_t key1, uint32_t c0) {
  uint32_t c1 = 0, c2 = 0, c3 = 0;
  for (int round = 0; round < 10; ++round) {
    const uint32_t prev_c0 = c0, prev_c2 = c2;
    c0 = mulhi32(0xCD9E8D57u, prev_c2) ^ c1 ^ key0;
    c2 = mulhi32(0xD2511F53u, prev_c0) ^ c3 ^ key1;
    c1 = 0xCD9E8D57u * prev_c2;
    c3 = 0xD2511F53u * prev_c0;
    key0 += 0x9E3779B9u;
    key1 += 0xBB67AE85u;
  }
  return c0;
}

// Uniform in [2^-24, 1 - 2^-24], strictly inside (0, 1): the top 23 bits plus one half, exact
// in fp32 (b + 1/2 < 2^23 needs 24 significant bits; with 24 bits the largest value would round
// to 1 and its Gumbel draw to +inf).
LZE_HD float uniform_from_bits(uint32_t bits) {
  return (static_cast<float>(bits >> 9) + 0.5f) * 1.1920928955078125e-07f;  // 2^-23
}

// Natural log of a positive normal double (no checks: zero, NaN, negative and subnormal inputs
// give garbage), within 1 ulp: fdlibm's e_log.c algorithm as
// straight-line arithmetic, so that a loop over it vectorises (a libm call does not) and CUDA
// and the CPU evaluate the same expression tree. x = 2^k m with m in [sqrt(1/2), sqrt(2));
// with f = m - 1 (exact) and s = f / (2 + f), log m = f - f^2/2 + s (f^2/2 + R(s^2)), R the
// minimax polynomial of fdlibm (error < 2^-58.45 for |s| <= 0.1716), and k ln2 split hi/lo so
// k ln2_hi is exact.
LZE_HD double log_nonnegative(double x) {
  union { double d; uint64_t u; } v;
  v.d = x;
  // Adding 1 - sqrt(1/2) to the significand carries into the exponent exactly when m >= sqrt(2)
  // would hold for the unbiased mantissa, so the biased exponent field is that of 2^k.
  constexpr uint64_t kOneMinusSqrtHalf = 0x3ff0000000000000ull - 0x3fe6a09e667f3bcdull;
  const uint64_t biased_k = (v.u + kOneMinusSqrtHalf) >> 52;
  v.u -= (biased_k - 1023) << 52;  // unsigned wrap-around: m = x / 2^k
  const double f = v.d - 1.0;
  // double(k) without an int64 -> double conversion (AVX-512 only): 2^52 + biased_k has
  // biased_k in its low significand bits.
  union { uint64_t u; double d; } kd;
  kd.u = 0x4330000000000000ull | biased_k;
  const double k = kd.d - (4503599627370496.0 + 1023.0);  // 2^52 + bias
  constexpr double kLn2Hi = 6.93147180369123816490e-01;  // 0x3fe62e42fee00000
  constexpr double kLn2Lo = 1.90821492927058770002e-10;  // 0x3dea39ef35793c76
  constexpr double kLg1 = 6.666666666666735130e-01, kLg2 = 3.999999999940941908e-01,
                   kLg3 = 2.857142874366239149e-01, kLg4 = 2.222219843214978396e-01,
                   kLg5 = 1.818357216161805012e-01, kLg6 = 1.531383769920937332e-01,
                   kLg7 = 1.479819860511658591e-01;
  const double s = f / (2.0 + f);
  const double z = s * s;
  const double w = z * z;
  const double r = z * (kLg1 + w * (kLg3 + w * (kLg5 + w * kLg7))) +
                   w * (kLg2 + w * (kLg4 + w * kLg6));
  const double half_f_sq = 0.5 * f * f;
  return k * kLn2Hi - ((half_f_sq - (s * (half_f_sq + r) + k * kLn2Lo)) - f);
}

// Standard Gumbel draw -log(-log(u)), evaluated in double and rounded once to fp32. Every
// libm's fp32 log (glibc, CUDA, SLEEF in torch, numpy) is faithfully but not correctly rounded,
// and they disagree in the last bit on ~15% of inputs, which reorders near-tied noisy scores
// across backends. In double, two faithful logs round to the same fp32 value except within one
// double ulp of an fp32 rounding boundary (~2^-29 per draw), or near u = 1/e, where the outer
// log is near 0 and its fp32 rounding can hinge on the inner log's last bit
// (tests/test_gumbel_exhaustive.py compares all 2^23 draws with the reference). Both logs see
// arguments in [1e-7, 17]: positive and normal.
LZE_HD float standard_gumbel(float u) {
  return static_cast<float>(-log_nonnegative(-log_nonnegative(static_cast<double>(u))));
}

// The GPU's canonical NaN (0x7fffffff) for a NaN: x86 makes 0xffc00000, which orders below
// every score where the GPU's orders above, so every backend forms NaN scores with the GPU's
// bits (a score is NaN when an energy is +inf and noise is on).
LZE_HD float canonical_nan(float x) {
  if (x == x) return x;
  union { uint32_t u; float f; } v;
  v.u = 0x7fffffffu;
  return v.f;
}

// Exploration score s = E + c * g of a candidate with standard Gumbel draw g (docs/spec.md §4).
LZE_HD float score_with_draw(float e, float gumbel_scale, float draw) {
  return canonical_nan(e + gumbel_scale * draw);
}

// The score of batch row `row` in the noise stream keyed by (seed, step); c = 0 is no noise.
LZE_HD float noisy_score(float e, float gumbel_scale, uint32_t seed, uint32_t step, uint32_t row) {
  if (gumbel_scale == 0.0f) return e;
  const float draw = standard_gumbel(uniform_from_bits(philox_4x32_10(seed, step, row)));
  return score_with_draw(e, gumbel_scale, draw);
}

// Gumbel scale c = noise_scale * max(max E - min E, 0.01) over the candidates.
LZE_HD float gumbel_scale(float noise_scale, float max_e, float min_e) {
  return noise_scale * fmaxf(max_e - min_e, 0.01f);
}

// The bits of a float as an unsigned integer in the same order: negative floats have their bits
// flipped, the others their sign bit set, so a < b as floats iff ordered(a) < ordered(b). It is
// never 0 for a non-NaN score (0 would be the NaN 0xFFFFFFFF), so the top-k kernels use 0 for
// "not a candidate".
LZE_HD uint32_t ordered_score_bits(float score) {
  union { float f; uint32_t u; } v;
  v.f = score;
  return (v.u & 0x80000000u) ? ~v.u : (v.u | 0x80000000u);
}

// 64-bit ordering key of a candidate: the ordered score bits in the high word, the inverted
// batch position in the low word, so a larger key is a larger score and, for equal scores, the
// smaller position. Non-candidates have key 0, below every candidate key.
LZE_HD uint64_t selection_key(float score, int64_t row) {
  return (static_cast<uint64_t>(ordered_score_bits(score)) << 32) |
         (0xFFFFFFFFu - static_cast<uint32_t>(row));
}

// e^x for x <= 0, within 2 ulp for x in [-87, 0] and 0 below (so e^-inf = 0; NaN gives 0
// too): straight-line arithmetic, so that a loop over it vectorises (a libm call does not).
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, with ln2 split so n ln2_hi is exact,
// e^r by Cephes' degree-7 minimax polynomial (expf.c), and 2^n built in the exponent field.
LZE_HD float exp_nonpositive(float x) {
  const float clamped = x > -87.0f ? x : -87.0f;  // not fmaxf: a libm call on plain x86-64
  const float n = rintf(clamped * 1.44269504088896341f);
  const float r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.0f;
  union { uint32_t u; float f; } scale;
  scale.u = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;  // n in [-126, 0]
  return x >= -87.0f ? p * scale.f : 0.0f;
}

// Online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022) of scores s_j with
// values y_j: max = max_j s_j, sum = sum_j e^(s_j - max), weighted = sum_j e^(s_j - max) y_j.
// The DOTS prediction (docs/spec.md §8) is weighted / sum over all references.
struct OnlineSoftmax {
  float max;
  float sum;
  float weighted;
};

LZE_HD OnlineSoftmax online_softmax_empty() { return OnlineSoftmax{-INFINITY, 0.0f, 0.0f}; }

// The state of the union of two disjoint sets of scores. Each side is rescaled to the common
// max; the side holding it is not rescaled at all (also when both are empty: -inf - -inf).
LZE_HD OnlineSoftmax online_softmax_merge(const OnlineSoftmax& a, const OnlineSoftmax& b) {
  const float m = fmaxf(a.max, b.max);
  const float ea = a.max == m ? 1.0f : exp_nonpositive(a.max - m);
  const float eb = b.max == m ? 1.0f : exp_nonpositive(b.max - m);
  return OnlineSoftmax{m, a.sum * ea + b.sum * eb, a.weighted * ea + b.weighted * eb};
}

// sum_j softmax_j(s) y_j of a non-empty state.
LZE_HD float online_softmax_mean(const OnlineSoftmax& s) { return s.weighted / s.sum; }

}  // namespace lze
