// Paged attention of decode rows on the CPU, reading the KV cache in place (docs/design.md, "Attention backends").
//
// A row has q >= 1 queries at consecutive positions ending at its context's end: its last token, and with
// speculative decoding the drafts it verifies. Each (row, KV head) task reads that row's keys (all, or the
// sliding windows' last) block by block straight from the head-major cache, so no per-layer copy of the row's
// K/V is made. Two passes over the row's context: scores (each key row loaded once for all the row's queries
// of the KV head's group), then per query softmax and the weighted sum of values. Built at start-up by
// cpu_paged.py; compiled for the host CPU, so the inner loops vectorize with its widest SIMD.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Bring a whole block of one head (block_size rows of dim elements) towards the core: blocks are
// scattered, and hardware prefetchers do not cross into the next block's page on their own.
template <typename T>
inline void prefetch_block(const T* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + off);
}

#if defined(__AVX512F__)
// 16 elements as float32 (bfloat16 is the high half of a float32).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Dot products of one query (D floats) with 4 key rows, reduced together: one
// horizontal reduction per 4 keys instead of one per key.
template <typename T, int D>
inline void dot4(const float* qg, const T* k0, int64_t stride, float* out) {
  __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
  for (int i = 0; i < D; i += 16) {
    const __m512 qv = _mm512_loadu_ps(qg + i);
    a = _mm512_fmadd_ps(qv, load16(k0 + i), a);
    b = _mm512_fmadd_ps(qv, load16(k0 + stride + i), b);
    c = _mm512_fmadd_ps(qv, load16(k0 + 2 * stride + i), c);
    d = _mm512_fmadd_ps(qv, load16(k0 + 3 * stride + i), d);
  }
  // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then [sum a, sum b, sum c, sum d].
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
}
#endif

// Per-thread scratch of the tasks: scores [G * q, n_keys]; the scaled queries of a multi-query row.
struct Scratch {
  std::vector<float> scores, queries;
};

// One (row, KV head) task: the row's nq queries, at positions ctx - nq .. ctx - 1, times the G query heads sharing
// the KV head (query j = i * G + g). Query i sees keys first_i .. ctx - nq + i: all of them, or a sliding window's
// last. Each key row is loaded once for all G * nq queries. G and D are compile-time so the accumulators stay in
// registers; Q = 1 compiles the decode row (its queries in registers too), Q = 0 takes nq at run time.
// softcap > 0 caps each score s to softcap * tanh(s / softcap) (Gemma 2).
template <typename T, int G, int D, int Q>
void attend_task(const T* q0, int64_t q_tok, int64_t q_head, T* o0, int64_t o_tok, int64_t o_head, int64_t nq_run,
                 const T* k_head, const T* v_head, const int64_t* row_blocks, int64_t ctx, int64_t window,
                 int64_t block_size, float scale, float softcap, Scratch& scratch) {
  const int64_t nq = Q ? Q : nq_run, nj = G * nq;
  float q_local[Q ? G * Q : 1][D];
  if constexpr (Q == 0) scratch.queries.resize(nj * D);
  float(*qf)[D] = Q ? q_local : reinterpret_cast<float(*)[D]>(scratch.queries.data());
  for (int64_t i = 0; i < nq; ++i)
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) qf[i * G + g][d] = static_cast<float>(q0[i * q_tok + g * q_head + d]) * scale;
  // Query i attends keys [first_of(i), ctx - nq + i + 1).
  const auto first_of = [&](int64_t i) {
    return window > 0 ? std::max<int64_t>(ctx - nq + i + 1 - window, 0) : int64_t{0};
  };
  const int64_t first = first_of(0), n_keys = ctx - first;
  const int64_t b0 = first / block_size, b_end = (ctx - 1) / block_size + 1;
  scratch.scores.resize(nj * n_keys);
  float* scores = scratch.scores.data();
  const int64_t block_bytes = block_size * D * sizeof(T);
  // Pass 1: scaled scores of every query against every key of the row's range (a query's keys outside its own
  // range are computed but left out of its softmax and sum).
  for (int64_t b = b0; b < b_end; ++b) {
    const int64_t base = b * block_size;
    const int64_t lo = std::max<int64_t>(first - base, 0), hi = std::min(block_size, ctx - base);
    const T* kb = k_head + row_blocks[b] * block_size * D;
    float* sb = scores + base - first;  // scores of this block's keys, for query 0
    // Prefetch two blocks ahead (one block's compute did not cover a fetch), and V's first two
    // blocks during the last K block, so they arrive while the softmax runs.
    if (b == b0) {
      prefetch_block(kb, block_bytes);
      if (b + 1 < b_end) prefetch_block(k_head + row_blocks[b + 1] * block_size * D, block_bytes);
    }
    if (b + 2 < b_end) prefetch_block(k_head + row_blocks[b + 2] * block_size * D, block_bytes);
    if (b + 1 == b_end) {
      prefetch_block(v_head + row_blocks[b0] * block_size * D, block_bytes);
      if (b0 + 1 < b_end) prefetch_block(v_head + row_blocks[b0 + 1] * block_size * D, block_bytes);
    }
    int64_t t = lo;
#if defined(__AVX512F__)
    if constexpr (D % 16 == 0) {
      for (; t + 4 <= hi; t += 4)
        for (int64_t j = 0; j < nj; ++j) dot4<T, D>(qf[j], kb + t * D, D, sb + j * n_keys + t);
    }
#endif
    for (; t < hi; ++t) {
      const T* kr = kb + t * D;
      for (int64_t j = 0; j < nj; ++j) {
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int d = 0; d < D; ++d) s += qf[j][d] * static_cast<float>(kr[d]);
        sb[j * n_keys + t] = s;
      }
    }
  }
  if (softcap > 0.f)
    for (int64_t i = 0; i < nj * n_keys; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t key_lo = first_of(i), key_hi = ctx - nq + i + 1;
    // Softmax per query over its own keys, unnormalised; the sum divides at the end.
    float inv_sum[G];
    for (int g = 0; g < G; ++g) {
      float* sg = scores + (i * G + g) * n_keys - first;  // indexed by key position
      float mx = sg[key_lo];
      for (int64_t k = key_lo + 1; k < key_hi; ++k) mx = std::max(mx, sg[k]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = key_lo; k < key_hi; ++k) {
        sg[k] = std::exp(sg[k] - mx);
        sum += sg[k];
      }
      inv_sum[g] = 1.f / sum;
    }
    // Pass 2: weighted sum of values, accumulated in registers; query 0 reads V from memory, later ones from
    // the core's cache.
    float acc[G][D];
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
    const int64_t vb0 = key_lo / block_size, vb_end = (key_hi - 1) / block_size + 1;
    for (int64_t b = vb0; b < vb_end; ++b) {
      const int64_t base = b * block_size;
      const int64_t lo = std::max<int64_t>(key_lo - base, 0), hi = std::min(block_size, key_hi - base);
      const T* vb = v_head + row_blocks[b] * block_size * D;
      const float* sb = scores + (i * G) * n_keys + base - first;
      if (i == 0 && b + 2 < vb_end) prefetch_block(v_head + row_blocks[b + 2] * block_size * D, block_bytes);
      for (int64_t t = lo; t < hi; ++t) {
        const T* vr = vb + t * D;
        for (int g = 0; g < G; ++g) {
          const float p = sb[g * n_keys + t];
#pragma omp simd
          for (int d = 0; d < D; ++d) acc[g][d] += p * static_cast<float>(vr[d]);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) o0[i * o_tok + g * o_head + d] = static_cast<T>(acc[g][d] * inv_sum[g]);
  }
}

template <typename T, int G, int D>
void attend_rows(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& token_index, const at::Tensor& query_lens, const at::Tensor& block_ids,
                 const at::Tensor& context_lens, double scale, int64_t block_size, int64_t window, double softcap) {
  const int64_t rows = block_ids.size(0), max_blocks = block_ids.size(1);
  const int64_t kv_heads = k_cache.size(0), slots = k_cache.size(1);
  const int64_t q_row = q.stride(0), q_head = q.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tok = token_index.data_ptr<int64_t>();
  const int64_t* qlens = query_lens.data_ptr<int64_t>();
  const int64_t* bids = block_ids.data_ptr<int64_t>();
  const int64_t* ctxs = context_lens.data_ptr<int64_t>();
  const float scale_f = static_cast<float>(scale), softcap_f = static_cast<float>(softcap);
  // Fewer (row, KV head) pairs than two per thread (one row verifying its drafts): each pair's queries are split
  // into up to `splits` tiles, each a task that reads the row's keys again (from the shared cache).
  const int64_t pairs = rows * kv_heads;
  int64_t splits = (2 * at::get_num_threads() + pairs - 1) / pairs;
  if (splits > 1) splits = std::min(splits, *std::max_element(qlens, qlens + rows));
  at::parallel_for(0, pairs * splits, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / splits / kv_heads, h = task / splits % kv_heads, tile = task % splits;
      // A tile is the row's queries i0 .. i1 - 1: a row of i1 - i0 queries ending at context ctx - (q - i1).
      const int64_t i0 = tile * qlens[r] / splits, i1 = (tile + 1) * qlens[r] / splits, nq = i1 - i0;
      if (nq == 0) continue;
      const int64_t ctx = ctxs[r] - (qlens[r] - i1);
      const T* q0 = qp + (tok[r] + i0) * q_row + h * G * q_head;
      T* o0 = op + (tok[r] + i0) * o_row + h * G * o_head;
      const T* k_head = kp + h * slots * D;
      const T* v_head = vp + h * slots * D;
      if (nq == 1)
        attend_task<T, G, D, 1>(q0, q_row, q_head, o0, o_row, o_head, 1, k_head, v_head, bids + r * max_blocks, ctx,
                                window, block_size, scale_f, softcap_f, scratch);
      else
        attend_task<T, G, D, 0>(q0, q_row, q_head, o0, o_row, o_head, nq, k_head, v_head, bids + r * max_blocks, ctx,
                                window, block_size, scale_f, softcap_f, scratch);
    }
  });
}

// The (group, head_dim) shapes compiled: G = query heads per KV head, D = head_dim.
#define PIPELINE_SHAPES(X) X(1, 64) X(2, 64) X(3, 64) X(4, 64) X(5, 64) X(6, 64) X(8, 64) \
  X(1, 128) X(2, 128) X(4, 128) X(8, 128)

template <typename T>
bool dispatch(int64_t group, int64_t dim, at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& token_index, const at::Tensor& query_lens,
              const at::Tensor& block_ids, const at::Tensor& context_lens, double scale, int64_t block_size,
              int64_t window, double softcap) {
#define PIPELINE_RUN(G, D)                                                                                        \
  if (group == G && dim == D) {                                                                                 \
    attend_rows<T, G, D>(out, q, k_cache, v_cache, token_index, query_lens, block_ids, context_lens, scale,    \
                         block_size, window, softcap);                                                          \
    return true;                                                                                                \
  }
  PIPELINE_SHAPES(PIPELINE_RUN)
#undef PIPELINE_RUN
  return false;
}

bool supports(int64_t group, int64_t dim) {
#define PIPELINE_MATCH(G, D) if (group == G && dim == D) return true;
  PIPELINE_SHAPES(PIPELINE_MATCH)
#undef PIPELINE_MATCH
  return false;
}

void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& token_index, const at::Tensor& query_lens, const at::Tensor& block_ids,
                  const at::Tensor& context_lens, double scale, int64_t block_size, int64_t window, double softcap) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous [KVH, slots, D]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need contiguous head_dim");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(), "dtype mismatch");
  TORCH_CHECK(block_ids.is_contiguous() && token_index.is_contiguous() && query_lens.is_contiguous() &&
                  context_lens.is_contiguous(),
              "index tensors must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "query heads must be a multiple of KV heads");
  const int64_t group = q.size(1) / k_cache.size(0), dim = k_cache.size(2);
  bool done = false;
  if (q.scalar_type() == at::kFloat) {
    done = dispatch<float>(group, dim, out, q, k_cache, v_cache, token_index, query_lens, block_ids, context_lens,
                           scale, block_size, window, softcap);
  } else if (q.scalar_type() == at::kBFloat16) {
    done = dispatch<at::BFloat16>(group, dim, out, q, k_cache, v_cache, token_index, query_lens, block_ids,
                                  context_lens, scale, block_size, window, softcap);
  } else {
    TORCH_CHECK(false, "paged_decode supports float32 and bfloat16, got ", q.scalar_type());
  }
  TORCH_CHECK(done, "paged_decode is not compiled for ", group, " query heads per KV head and head_dim ", dim);
}

}  // namespace

TORCH_LIBRARY(pipeline_cpu, m) {
  m.def(
      "paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor token_index, "
      "Tensor query_lens, Tensor block_ids, Tensor context_lens, float scale, int block_size, int window, "
      "float softcap) -> ()");
  m.def("supports(int group, int head_dim) -> bool", &supports);
}

TORCH_LIBRARY_IMPL(pipeline_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
