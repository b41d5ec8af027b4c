// Decode attention over an e4m3 paged KV cache on the tensor cores (kernels/fp8_decode_cuda.py compiles
// and launches it; NVRTC, no headers). One block: one request's query token, the GROUP query heads of one
// KV head, one split of its keys; the block's warps take the split's 16-key tiles in turn, each with its
// own online softmax, and merge in shared memory at the end. With splits the block writes its fp32 partial
// output and base-2 log-sum-exp as kernels/attention.py's decode does (split_kv.merge_splits merges them);
// without, the output in the query's dtype.
//
// The heads are m16n8k16's 16 rows (GROUP <= 16; rows past the group are zero), so the scores' C fragments
// are the probabilities' A fragments with no shuffle (FlashAttention-2's register reuse). The MMA's sum
// over its k-slots may take the values in any order both operands share, so each lane's loaded bytes feed
// its fragments as they lie:
// - Q.K^T, keys as B's 8 columns: lane (g, t) = (lane / 4, lane % 4) loads bytes [HEAD_DIM/4 * t, +HEAD_DIM/4)
//   of keys g and g + 8 of the tile; k-step j takes word j (dims d..d+3, d = HEAD_DIM/4 * t + 4j) as its
//   slots (2t, 2t+1, 2t+8, 2t+9), and the query's fragments (held in registers, fp16) take the same dims.
//   One cvt widens two e4m3 values of a key into B's fp16 pair.
// - P.V, dims as B's columns: lane (g, t) loads bytes [HEAD_DIM/8 * g, +HEAD_DIM/8) of keys 2t, 2t+1, 2t+8
//   and 2t+9 (its probabilities' k-slots); n-tile i's column g is the lane's i-th dim, and one PRMT pairs
//   the two keys' bytes of two dims before one cvt each widens them. The output fragment's columns 2t and
//   2t+1 are then dims HEAD_DIM/8 * 2t + i and HEAD_DIM/8 * (2t+1) + i.
// Keys and values stream from global memory straight into registers, 16-byte loads (8 at HEAD_DIM 64),
// AHEAD tiles ahead of the one being computed; no shared memory until the merge. e4m3 is exact in fp16, the
// query is clamped to fp16's range and the probabilities (<= 1) are fp16, as the Triton kernel does.
//
// Defines: HEAD_DIM (64, 128, 256), GROUP (query heads a KV head, 1-16), BLOCK_SIZE (the cache's page, a
// multiple of 16: a tile never straddles two pages), BF16 (query and out: 1 bf16, 0 fp16), WARPS, AHEAD
// (tiles a warp loads ahead of the one it computes), MIN_BLOCKS (blocks a multiprocessor the registers must
// leave room for: __launch_bounds__'s second argument), EARLY (1: the first tiles of earlier steps' keys
// load before the PDL wait), SPLIT (1: write partial outputs and log-sum-exps), MERGE (with SPLIT, 1: the
// last of a request's KV head's split blocks to finish merges the splits' partials into `out` itself,
// counting the finished ones in merge_counts, which it leaves at zero; 0: a merge launch follows),
// ROTARY (1: the query and the step's key arrive unrotated, as paged_attention's `rotary` has them: each
// block rotates its query rows, and the block whose split holds the step's key rotates it and stores it
// and the value into the cache itself, one launch instead of two), COS_SIN_F32 (1: the rotary's cos/sin
// cache is float32, as the engine's rotary embedding holds it; 0: the query's 16-bit dtype).
// Dynamic shared memory: WARPS * GROUP * (HEAD_DIM + 2) * 4 B. (Tiles asked of L2 ahead of the register
// tiles, prefetch.global.L2, and the loads' L2 fetch-size hints gained nothing on an H100 or an H200 and
// were taken out: docs/performance.md, forty-eighth and forty-ninth sessions.)
// sm_89 or later (cvt.rn.f16x2.e4m3x2).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
#if COS_SIN_F32
typedef float cos_sin_t;
#else
typedef unsigned short cos_sin_t;
#endif

#define NC_LOAD "ld.global.nc.L1::no_allocate"

#define K_WORDS (HEAD_DIM / 16)  // a lane's words of a key, one a k-step of Q.K^T
#define V_WORDS (HEAD_DIM / 32)  // a lane's words of a value: four n8 tiles of P.V each
#define N_TILES (HEAD_DIM / 8)
#define ROWS_HI (GROUP > 8)  // whether rows g + 8 hold heads
#define NEG_INF (-__int_as_float(0x7f800000))

#if BF16
#define CVT_OUT "cvt.rn.bf16.f32"
#else
#define CVT_OUT "cvt.rn.f16.f32"
#endif

__device__ __forceinline__ float in_float(u16 h) {
#if BF16
  return __uint_as_float(((u32)h) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}

__device__ __forceinline__ float in_float(float f) { return f; }  // a float32 cos/sin cache's values

__device__ __forceinline__ u16 to_out(float v) {
  u16 h;
  asm(CVT_OUT " %0, %1;" : "=h"(h) : "f"(v));
  return h;
}

// A row's dim d after rotate-half rotary by the position's cos/sin row, rounded to the 16-bit dtype as
// kernels/rotary.py stores it: x1 cos - x2 sin for the first half, x2 cos + x1 sin for the second.
__device__ __forceinline__ float rotated(const u16* row, const cos_sin_t* cos_sin, int d) {
  const int half = HEAD_DIM / 2, i = d % half;
  const float c = in_float(cos_sin[i]), s = in_float(cos_sin[half + i]);
  const float x1 = in_float(row[i]), x2 = in_float(row[half + i]);
  return in_float(to_out(d < half ? x1 * c - x2 * s : x2 * c + x1 * s));
}

__device__ __forceinline__ u8 to_e4m3(float v) {
  u16 pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(v));
  return (u8)(pair & 0xff);
}

// (lo, hi) as an fp16 pair, lo in the low half.
__device__ __forceinline__ u32 f16_pair(float lo, float hi) {
  u32 d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// The word's four e4m3 values as two fp16 pairs: bytes 0-1 into lo, 2-3 into hi.
__device__ __forceinline__ void widen(u32 w, u32& lo, u32& hi) {
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
      : "=r"(lo), "=r"(hi) : "r"(w));
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// N words from p: through the non-coherent path, or (COHERENT) plain loads, which see what this block
// stored before a barrier (the step's own key and value, ROTARY).
template <int N, bool COHERENT = false>
__device__ __forceinline__ void load_words(u32 (&w)[N], const u8* p) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int q = 0; q < N / 4; ++q) {
      if constexpr (COHERENT)
        asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(w[4 * q]), "=r"(w[4 * q + 1]), "=r"(w[4 * q + 2]), "=r"(w[4 * q + 3])
                     : "l"(p + 16 * q));
      else
        asm volatile(NC_LOAD ".v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(w[4 * q]), "=r"(w[4 * q + 1]), "=r"(w[4 * q + 2]), "=r"(w[4 * q + 3])
                     : "l"(p + 16 * q));
    }
  } else {
    static_assert(N == 2, "8- or 16-byte loads");
    if constexpr (COHERENT)
      asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
    else
      asm volatile(NC_LOAD ".v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  }
}

// A lane's bytes of one 16-key tile: keys g and g + 8 (k), keys 2t, 2t+1, 2t+8, 2t+9 (v).
struct Tile {
  u32 k[2][K_WORDS];
  u32 v[4][V_WORDS];
};

struct Cursor {  // where a lane's bytes of tile i lie: a page's row, plus the lane's offsets in it
  const u8* k_cache;
  const u8* v_cache;
  const int* table;
  long long stride_block;
  int stride_slot, kv_lo;
  int k_off[2], v_off[4];  // within a page (the head's offset included): keys g, g + 8; 2t, 2t+1, 2t+8, 2t+9

  template <bool COHERENT = false>
  __device__ __forceinline__ void load_tile(Tile& x, int i) const {
    const unsigned base = kv_lo + 16 * i;
    const long long row = (long long)table[base / BLOCK_SIZE] * stride_block + (int)(base % BLOCK_SIZE) * stride_slot;
    const u8* k = k_cache + row;
    const u8* v = v_cache + row;
#pragma unroll
    for (int n = 0; n < 2; ++n) load_words<K_WORDS, COHERENT>(x.k[n], k + k_off[n]);
#pragma unroll
    for (int c = 0; c < 4; ++c) load_words<V_WORDS, COHERENT>(x.v[c], v + v_off[c]);
  }

  // Tile i; the one this block stored the step's key and value into (fresh, ROTARY) with plain loads.
  __device__ __forceinline__ void load(Tile& x, int i, int fresh) const {
    if (ROTARY && i == fresh)
      load_tile<true>(x, i);
    else
      load_tile<false>(x, i);
  }
};

struct State {  // a warp's online softmax over its tiles: rows g (0) and g + 8 (1)
  float o[N_TILES][4];
  float m[2], l[2];  // m in log2 units, uniform over a row's four lanes; l the lane's own share
};

// A row's running max over its four lanes' scores s (already in log2 units): returns exp2(m_old - m_new)
// and turns s into the probabilities.
__device__ __forceinline__ float softmax_row(float& m, float& l, float (&s)[4]) {
  float mx = fmaxf(fmaxf(s[0], s[1]), fmaxf(s[2], s[3]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m, mx);
  const float alpha = exp2f(m - m_new);
  m = m_new;
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    s[e] = exp2f(s[e] - m_new);
    sum += s[e];
  }
  l = l * alpha + sum;
  return alpha;
}

__device__ __forceinline__ void attend(State& st, Tile& x, const u32 (&q)[2][K_WORDS][2], int key0, int kv_hi,
                                       float qk_scale, int t) {
  // Scores of keys 0-7 (s[0]) and 8-15 (s[1]) of the tile, two chains each over the k-steps.
  float s[2][4], e[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) s[n][r] = e[n][r] = 0.f;
#pragma unroll
  for (int j = 0; j < K_WORDS; ++j) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      u32 lo, hi;
      widen(x.k[n][j], lo, hi);
      mma(j % 2 ? e[n] : s[n], q[0][j][0], q[1][j][0], q[0][j][1], q[1][j][1], lo, hi);
    }
  }
  // C fragment: [0], [1] row g, keys 2t, 2t+1 (+8 for n = 1); [2], [3] row g + 8.
  float row0[4] = {(s[0][0] + e[0][0]) * qk_scale, (s[0][1] + e[0][1]) * qk_scale,
                   (s[1][0] + e[1][0]) * qk_scale, (s[1][1] + e[1][1]) * qk_scale};
  float row1[4] = {(s[0][2] + e[0][2]) * qk_scale, (s[0][3] + e[0][3]) * qk_scale,
                   (s[1][2] + e[1][2]) * qk_scale, (s[1][3] + e[1][3]) * qk_scale};
  const bool partial = key0 + 16 > kv_hi;
  if (partial) {  // keys past the split's end: no weight, and their values zero (stale bytes may be NaN)
    const int keys[4] = {key0 + 2 * t, key0 + 2 * t + 1, key0 + 2 * t + 8, key0 + 2 * t + 9};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (keys[c] >= kv_hi) {
        row0[c] = row1[c] = NEG_INF;
#pragma unroll
        for (int w = 0; w < V_WORDS; ++w) x.v[c][w] = 0u;
      }
    }
  }
  const float alpha0 = softmax_row(st.m[0], st.l[0], row0);
  float alpha1 = 1.f;
  if (ROWS_HI) alpha1 = softmax_row(st.m[1], st.l[1], row1);
  const u32 p0 = f16_pair(row0[0], row0[1]), p2 = f16_pair(row0[2], row0[3]);
  const u32 p1 = ROWS_HI ? f16_pair(row1[0], row1[1]) : 0u, p3 = ROWS_HI ? f16_pair(row1[2], row1[3]) : 0u;
  // The outputs rescaled only where some row's maximum moved (after the first tiles, rarely).
  if (__any_sync(0xffffffffu, alpha0 != 1.f || alpha1 != 1.f)) {
#pragma unroll
    for (int i = 0; i < N_TILES; ++i) {
      st.o[i][0] *= alpha0;
      st.o[i][1] *= alpha0;
      if (ROWS_HI) {
        st.o[i][2] *= alpha1;
        st.o[i][3] *= alpha1;
      }
    }
  }
#pragma unroll
  for (int w = 0; w < V_WORDS; ++w) {
    // Keys (2t, 2t+1) and (2t+8, 2t+9) of dims 4w..4w+3: bytes paired by key, then widened.
    u32 b0[4], b1[4];
    widen(prmt(x.v[0][w], x.v[1][w], 0x5140), b0[0], b0[1]);
    widen(prmt(x.v[0][w], x.v[1][w], 0x7362), b0[2], b0[3]);
    widen(prmt(x.v[2][w], x.v[3][w], 0x5140), b1[0], b1[1]);
    widen(prmt(x.v[2][w], x.v[3][w], 0x7362), b1[2], b1[3]);
#pragma unroll
    for (int c = 0; c < 4; ++c) mma(st.o[4 * w + c], p0, p1, p2, p3, b0[c], b1[c]);
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
fp8_decode_attention(const u16* __restrict__ query, u8* __restrict__ k_cache, u8* __restrict__ v_cache,
                     u16* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_lse,
                     const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                     const int* __restrict__ query_start_loc, float qk_scale, float k_scale, float v_scale,
                     int stride_q_tok, int stride_q_head, int stride_o_tok, int stride_o_head, int stride_block,
                     int stride_slot, int stride_head, int stride_table, const long long* __restrict__ positions,
                     const cos_sin_t* __restrict__ cos_sin, const u16* __restrict__ key, const u16* __restrict__ value,
                     const long long* __restrict__ slot_mapping, int stride_cos, int stride_key_tok,
                     int stride_key_head, int stride_value_tok, int stride_value_head, int* __restrict__ merge_counts) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int seq = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z, num_splits = gridDim.z;
  // No kernel of the step writes the request's offsets and length: read before the PDL wait.
  const int q_start = query_start_loc[seq];
  const int query_len = query_start_loc[seq + 1] - q_start;
  const int seq_len = seq_lens[seq];
#if ROTARY
  // Nor the token's position and slot.
  const long long pos = query_len > 0 ? positions[q_start] : 0;
  const long long slot = query_len > 0 ? slot_mapping[q_start] : -1;
  const cos_sin_t* cs = cos_sin + pos * stride_cos;
#endif
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  if (query_len == 0) return;  // a padded request

  // This split's keys: whole 16-key tiles, the last cut at seq_len.
  const int split_len = ((seq_len + num_splits - 1) / num_splits + 15) & ~15;
  const int kv_lo = split * split_len;
  const int kv_hi = min(kv_lo + split_len, seq_len);
  const int n_tiles = kv_hi > kv_lo ? (kv_hi - kv_lo + 15) >> 4 : 0;

  const int head_offset = kv_head * stride_head;
  const Cursor at{k_cache, v_cache, block_tables + (long long)seq * stride_table, stride_block, stride_slot, kv_lo,
                  {head_offset + g * stride_slot + (HEAD_DIM / 4) * t,
                   head_offset + (g + 8) * stride_slot + (HEAD_DIM / 4) * t},
                  {head_offset + 2 * t * stride_slot + (HEAD_DIM / 8) * g,
                   head_offset + (2 * t + 1) * stride_slot + (HEAD_DIM / 8) * g,
                   head_offset + (2 * t + 8) * stride_slot + (HEAD_DIM / 8) * g,
                   head_offset + (2 * t + 9) * stride_slot + (HEAD_DIM / 8) * g}};
  // The tile that holds the step's key: stored by the launch before this one (ROTARY: by this block, below).
  const int step = seq_len - 1;
  const int step_tile = kv_lo <= step && step < kv_hi ? (step - kv_lo) >> 4 : -1;
  // Tiles warp, warp + WARPS, ...: AHEAD + 1 register tiles in turn, AHEAD loading while one is computed;
  // the first AHEAD requested before the query is read, so the two loads' latencies overlap. With EARLY
  // those that hold only earlier steps' keys and values load before the PDL wait: no kernel of the step
  // writes them (the block table neither: the step's metadata is copied in before its kernels).
  Tile buf[AHEAD + 1];
#if EARLY
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    const int tile = warp + s * WARPS;
    if (tile < n_tiles && tile != step_tile) at.load(buf[s], tile, -1);
  }
#endif
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  int fresh = -1;  // the tile this block stores the step's key and value into, if any
#if ROTARY
  // The split that holds the step's key rotates it and stores it and the value (x / scale, saturated to
  // e4m3, as kernels/rotary.py stores them), then attends to them from the cache like any other key.
  if (step_tile >= 0 && slot >= 0) {
    const u16* k_row = key + (long long)q_start * stride_key_tok + (long long)kv_head * stride_key_head;
    const u16* v_row = value + (long long)q_start * stride_value_tok + (long long)kv_head * stride_value_head;
    const long long row = (slot / BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot + head_offset;
    for (int d = threadIdx.x; d < HEAD_DIM; d += WARPS * 32) {
      k_cache[row + d] = to_e4m3(rotated(k_row, cs, d) / k_scale);
      v_cache[row + d] = to_e4m3(in_float(v_row[d]) / v_scale);
    }
    fresh = step_tile;
  }
  __syncthreads();  // the stores before any warp loads the tile (plain loads: coherent within the block)
#endif
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    const int tile = warp + s * WARPS;
    if (tile < n_tiles && (!EARLY || tile == step_tile)) at.load(buf[s], tile, fresh);
  }

  // The query's fragments in fp16: [row g, g + 8][k-step j][dims d, d+1 | d+2, d+3].
  u32 q[2][K_WORDS][2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    const bool real = row < GROUP;
    const u16* q_row = query + (long long)q_start * stride_q_tok +
                       (long long)(kv_head * GROUP + (real ? row : 0)) * stride_q_head + (HEAD_DIM / 4) * t;
#pragma unroll
    for (int j = 0; j < K_WORDS; ++j) {
      float v[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
#if ROTARY
        const int d = (HEAD_DIM / 4) * t + 4 * j + c;  // the dim's value and its rotate-half partner
        const float x = real ? rotated(q_row - (HEAD_DIM / 4) * t, cs, d) : 0.f;
#else
        const float x = real ? in_float(q_row[4 * j + c]) : 0.f;
#endif
        v[c] = fminf(fmaxf(x, -65504.f), 65504.f);
      }
      q[r][j][0] = f16_pair(v[0], v[1]);
      q[r][j][1] = f16_pair(v[2], v[3]);
    }
  }

  State st;
#pragma unroll
  for (int i = 0; i < N_TILES; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) st.o[i][r] = 0.f;
  st.m[0] = st.m[1] = NEG_INF;
  st.l[0] = st.l[1] = 0.f;

  for (int i = warp; i < n_tiles;) {
#pragma unroll
    for (int s = 0; s <= AHEAD; ++s) {
      if (i >= n_tiles) break;
      if (i + AHEAD * WARPS < n_tiles) at.load(buf[(s + AHEAD) % (AHEAD + 1)], i + AHEAD * WARPS, fresh);
      attend(st, buf[s], q, kv_lo + 16 * i, kv_hi, qk_scale, t);
      i += WARPS;
    }
  }

  // Each row's sum over its four lanes, then the warps' states in shared memory: [warp][row][dim] outputs,
  // then [warp][row] maxima and sums.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 1);
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 2);
  }
  extern __shared__ float shared[];
  float* s_o = shared;
  float* s_m = shared + WARPS * GROUP * HEAD_DIM;
  float* s_l = s_m + WARPS * GROUP;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    if (row >= GROUP) continue;
    float* o_row = s_o + (warp * GROUP + row) * HEAD_DIM;
#pragma unroll
    for (int i = 0; i < N_TILES; ++i) {
      o_row[(HEAD_DIM / 8) * (2 * t) + i] = st.o[i][2 * r];
      o_row[(HEAD_DIM / 8) * (2 * t + 1) + i] = st.o[i][2 * r + 1];
    }
    if (t == 0) {
      s_m[warp * GROUP + row] = st.m[r];
      s_l[warp * GROUP + row] = st.l[r];
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < GROUP * HEAD_DIM; e += WARPS * 32) {
    const int row = e / HEAD_DIM, dim = e % HEAD_DIM;
    float m = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, s_m[w * GROUP + row]);
    float o = 0.f, l = 0.f;
    if (m != NEG_INF) {  // else an empty split: lse -inf and a zero output, which weigh nothing in the merge
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float weight = exp2f(s_m[w * GROUP + row] - m);
        o += weight * s_o[(w * GROUP + row) * HEAD_DIM + dim];
        l += weight * s_l[w * GROUP + row];
      }
    }
    const float result = l > 0.f ? o * (v_scale / l) : 0.f;
    const int head = kv_head * GROUP + row;
#if SPLIT
    const long long partial_row = ((long long)seq * GROUP * gridDim.y + head) * num_splits + split;
    partial_out[partial_row * HEAD_DIM + dim] = result;
    if (dim == 0) partial_lse[partial_row] = l > 0.f ? m + __log2f(l) : NEG_INF;
#else
    out[(long long)q_start * stride_o_tok + (long long)head * stride_o_head + dim] = to_out(result);
#endif
  }
#if SPLIT && MERGE
  // Count this split done, its partials fenced first; the last one's block merges every split, reading
  // the others' partials from L2 (ld.cg: this multiprocessor's L1 never held them), as the merge launch
  // would: weights 2^(lse - max lse), an empty split (lse -inf) weighing nothing.
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* count = merge_counts + seq * gridDim.y + kv_head;
    last = atomicAdd(count, 1) == num_splits - 1;
    if (last) *count = 0;  // every split has counted: zero again for the next launch
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int e = threadIdx.x; e < GROUP * HEAD_DIM; e += WARPS * 32) {
    const int row = e / HEAD_DIM, dim = e % HEAD_DIM;
    const int head = kv_head * GROUP + row;
    const long long first = ((long long)seq * GROUP * gridDim.y + head) * num_splits;
    float m = NEG_INF;
    for (int s = 0; s < num_splits; ++s) m = fmaxf(m, __ldcg(partial_lse + first + s));
    float o = 0.f, weights = 0.f;
    if (m != NEG_INF) {
      for (int s = 0; s < num_splits; ++s) {
        const float weight = exp2f(__ldcg(partial_lse + first + s) - m);
        o += weight * __ldcg(partial_out + (first + s) * HEAD_DIM + dim);
        weights += weight;
      }
    }
    out[(long long)q_start * stride_o_tok + (long long)head * stride_o_head + dim] =
        to_out(weights > 0.f ? o / weights : 0.f);
  }
#endif
}
