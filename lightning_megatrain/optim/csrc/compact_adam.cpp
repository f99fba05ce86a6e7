// AdamW over 8-bit block-quantized moments, one pass over memory: the native kernel of optim/compact_kernel.py.
//
// The update is optim/compact_adam.py's _chunk_update (torch's AdamW op order, see that file's docstring), computed a
// quantization block (BLOCK = 256 elements, optim/rounding.py [Note: 8-bit moments]) at a time: a block's moments are
// decoded, updated and kept in fp32 arrays on the stack, their block maxima taken, and they are encoded back, so each
// byte of state is read once and written once (what inductor's fusion of the same ops does in several passes over fp32
// temporaries). Blocks are independent; OpenMP splits them over `threads` threads. Plain C ABI: loaded through ctypes.
//
// Arithmetic: IEEE single precision, built with -ffp-contract=off, so each multiply and add rounds as torch's eager
// ops do; where torch's CPU kernels use a fused multiply-add (lerp, addcmul, add with alpha) this uses std::fma.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlock = 256;
// rounding.py's decoding factors, Python floats (doubles) rounded to fp32 as torch rounds a scalar operand
const float kInv127 = static_cast<float>(1.0 / 127.0);
const float kInv255 = static_cast<float>(1.0 / 255.0);

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// The bits of the fp32 value equal to the bf16 nearest to x (ties to even): rounding.py nearest_bits.
inline uint32_t nearest_bits(float x) {
  uint32_t b = float_to_bits(x);
  return (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
}

// The low 16 bits of rounding.py's _hash32 of (start + i), the 32-bit index wrapping as there.
inline uint32_t hash_bits(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x5BD1E995u;
  x ^= x >> 16;
  return x & 0xFFFFu;
}

struct Hyper {
  float neg_step_size, inv_bc2_sqrt, decay, grad_scale, one_minus_beta1, beta2, one_minus_beta2, eps, coupled_decay;
};

// Weight formats, as compact_kernel.py numbers them.
enum Weights { kFp32 = 0, kBf16 = 1, kBf16Sr = 2, kBf16Kahan = 3 };

// The largest of x[0..n) (values >= 0), a NaN if any is NaN, as torch's amax. On the bits with the sign cleared:
// non-negative floats order as their bit patterns, and every NaN's bits are above infinity's; an integer maximum
// vectorizes where a float one (NaN and signed-zero rules) does not.
inline float amax(const float* x, int64_t n) {
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = float_to_bits(x[i]) & 0x7FFFFFFFu;
    top = b > top ? b : top;
  }
  return bits_to_float(top);
}

// One block of n <= kBlock elements starting at element `first`; W, GradBf16 and Coupled are template arguments so
// that each loop body is branch-free and vectorizes.
template <int W, bool GradBf16, bool Coupled>
void update_block(void* w, const void* g, int8_t* m, float* m_scale, uint8_t* v, float* v_scale, uint16_t* comp,
                  int64_t first, int64_t n, uint32_t seed, const Hyper& h) {
  float w32[kBlock], m32[kBlock], v32[kBlock], root[kBlock];
  const float ms = m_scale[0], vs = v_scale[0];
  // torch's lerp(m, g, 1 - beta1) has two forms, by whether the weight is below 0.5, each one fused multiply-add:
  // m + wt * (g - m), or g - (1 - wt) * (g - m). The form is chosen here, once: a test of the weight inside the loop
  // kept it from vectorizing (2-3x slower on 2 cores).
  const bool lerp_low = h.one_minus_beta1 < 0.5f;
  const float lerp_weight = lerp_low ? h.one_minus_beta1 : -(1.0f - h.one_minus_beta1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = first + i;
    float wi = W == kFp32 ? static_cast<float*>(w)[k] : bf16_to_float(static_cast<uint16_t*>(w)[k]);
    if (W == kBf16Kahan) wi = wi + bf16_to_float(comp[k]);
    float gi = GradBf16 ? bf16_to_float(static_cast<const uint16_t*>(g)[k]) : static_cast<const float*>(g)[k];
    gi = gi * h.grad_scale;
    wi = wi * h.decay;
    if (Coupled) gi = std::fma(h.coupled_decay, wi, gi);  // add(w, alpha=decay): a fused multiply-add in torch
    const float d = static_cast<float>(m[k]) * kInv127;
    const float mi = d * std::fabs(d) * ms;
    float e = static_cast<float>(v[k]) * kInv255;
    e = e * e;
    const float vi = e * e * vs;
    const float mn = std::fma(lerp_weight, gi - mi, lerp_low ? mi : gi);  // lerp(m, g, 1 - beta1), see above
    const float vn = std::fma(h.one_minus_beta2 * gi, gi, vi * h.beta2);  // addcmul(v * beta2, g, g, 1 - beta2)
    const float r = std::sqrt(vn);
    w32[i] = wi + (h.neg_step_size * mn) / (r * h.inv_bc2_sqrt + h.eps);
    m32[i] = mn;
    v32[i] = vn;
    root[i] = r;
  }
  float am[kBlock];
  for (int64_t i = 0; i < n; ++i) am[i] = std::fabs(m32[i]);
  const float m_max = amax(am, n), v_max = amax(v32, n);
  const float m_inv = m_max > 0.0f ? 1.0f / m_max : 0.0f;
  const float v_root = std::sqrt(v_max);
  const float v_inv = v_root > 0.0f ? 1.0f / v_root : 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = first + i;
    const float q = std::nearbyint(127.0f * std::sqrt(am[i] * m_inv));
    m[k] = static_cast<int8_t>(m32[i] < 0.0f ? -q : q);
    v[k] = static_cast<uint8_t>(std::nearbyint(255.0f * std::sqrt(root[i] * v_inv)));
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = first + i;
    const float x = w32[i];
    if (W == kFp32) {
      static_cast<float*>(w)[k] = x;
    } else if (W == kBf16Sr) {  // rounding.py round_stochastic
      const uint32_t b = (float_to_bits(x) + hash_bits(seed + static_cast<uint32_t>(k))) & 0xFFFF0000u;
      static_cast<uint16_t*>(w)[k] = static_cast<uint16_t>(b >> 16);
    } else {
      const uint32_t high = nearest_bits(x);
      static_cast<uint16_t*>(w)[k] = static_cast<uint16_t>(high >> 16);
      if (W == kBf16Kahan) comp[k] = static_cast<uint16_t>(nearest_bits(x - bits_to_float(high)) >> 16);
    }
  }
  m_scale[0] = m_max;
  v_scale[0] = v_max;
}

template <int W, bool GradBf16, bool Coupled>
void update(void* w, const void* g, int8_t* m, float* m_scale, uint8_t* v, float* v_scale, uint16_t* comp,
            int64_t numel, uint32_t seed, const Hyper& h, int threads) {
  const int64_t blocks = (numel + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 16)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * kBlock;
    const int64_t n = numel - first < kBlock ? numel - first : kBlock;
    update_block<W, GradBf16, Coupled>(w, g, m, m_scale + b, v, v_scale + b, comp, first, n, seed, h);
  }
}

template <int W>
void dispatch(bool grad_bf16, bool coupled, void* w, const void* g, int8_t* m, float* m_scale, uint8_t* v,
              float* v_scale, uint16_t* comp, int64_t numel, uint32_t seed, const Hyper& h, int threads) {
  if (grad_bf16) {
    coupled ? update<W, true, true>(w, g, m, m_scale, v, v_scale, comp, numel, seed, h, threads)
            : update<W, true, false>(w, g, m, m_scale, v, v_scale, comp, numel, seed, h, threads);
  } else {
    coupled ? update<W, false, true>(w, g, m, m_scale, v, v_scale, comp, numel, seed, h, threads)
            : update<W, false, false>(w, g, m, m_scale, v, v_scale, comp, numel, seed, h, threads);
  }
}

}  // namespace

extern "C" int compact_adamw_int8(void* w, const void* g, int8_t* m, float* m_scale, uint8_t* v, float* v_scale,
                                  uint16_t* comp, int64_t numel, int64_t seed, float neg_step_size,
                                  float inv_bc2_sqrt, float decay, float grad_scale, float one_minus_beta1,
                                  float beta2, float one_minus_beta2, float eps, float coupled_decay, int coupled,
                                  int weights, int grad_bf16, int threads) {
  const Hyper h{neg_step_size, inv_bc2_sqrt, decay, grad_scale, one_minus_beta1, beta2, one_minus_beta2, eps,
                coupled_decay};
  const uint32_t start = static_cast<uint32_t>(static_cast<uint64_t>(seed));  // the hash input's low 32 bits
  const bool bf16 = grad_bf16 != 0, l2 = coupled != 0;
  switch (weights) {
    case kFp32: dispatch<kFp32>(bf16, l2, w, g, m, m_scale, v, v_scale, comp, numel, start, h, threads); return 0;
    case kBf16: dispatch<kBf16>(bf16, l2, w, g, m, m_scale, v, v_scale, comp, numel, start, h, threads); return 0;
    case kBf16Sr: dispatch<kBf16Sr>(bf16, l2, w, g, m, m_scale, v, v_scale, comp, numel, start, h, threads); return 0;
    case kBf16Kahan:
      dispatch<kBf16Kahan>(bf16, l2, w, g, m, m_scale, v, v_scale, comp, numel, start, h, threads);
      return 0;
    default: return 1;
  }
}
