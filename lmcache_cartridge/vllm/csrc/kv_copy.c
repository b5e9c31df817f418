/* Copy between token-major KV rows (LMCache's KV_2LTD chunks) and vLLM-CPU's paged KV blocks, per
 * (block, head) a K region followed by a V region, in one of two layouts:
 *   LAYOUT_K_TRANSPOSED ("vec"/"vec16" writers): K [head_dim][block_size], V [block_size][head_dim];
 *   LAYOUT_AMX_TILES ("amx" writer, 16-bit elements): K in tiles of 16 tokens, each the transpose
 *     of its [16][head_dim / 2] element pairs; V with each pair of tokens interleaved element by
 *     element inside groups of 16 columns, a group [block_size / 2][16][2] after another.
 *
 * Why a kernel: the K transpose is the whole cost of injection on vLLM's CPU backend. torch's
 * strided copy (and vLLM's own per-token writer) move it at a fraction of memory speed; a tiled
 * transpose with 8x8 (16-bit) / 4x4 (32-bit) SSE2 register transposes and streaming stores
 * runs near a plain copy (benchmarks/kv_copy.py). "amx"'s K tiles, whose destination lines are
 * 16 tokens wide, go through a 16x16 32-bit AVX-512 transpose (full 64-byte lines, half the shuffles
 * of SSE2 per byte) on CPUs that have AVX-512F, chosen at run time (cart_kv_simd); the file still
 * builds with the plain `cc -O3` flags and runs its SSE2 path everywhere else.
 * The layout itself is not decided here: lmcache_cartridge/vllm/cpu_layout.py derives it from
 * vLLM's writer op and only calls this kernel for a layout whose learned map it proved equal to
 * one of these two.
 *
 * Where it runs: in the vLLM worker process, on the thread LMCache calls the connector from
 * and, for pieces of a large copy, on the connector's helper threads (ctypes releases the GIL;
 * the caller never gives two threads rows that write the same bytes). It owns no memory: it
 * reads and writes what the caller passes.
 * Build: `make native` (cc -O3 -shared -fPIC); lmcache_cartridge/vllm/native.py loads it and
 * falls back to pure torch when it is absent.
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)  /* gcc and clang: per-function target attributes */
#include <immintrin.h>
#define HAVE_AVX512_PATH 1
#endif

/* SIMD level the copies use: 0 = SSE2 (or scalar), 1 = AVX-512F where it helps. -1 = not yet
 * detected. Set once per process from the CPU (or lowered by a test through cart_kv_simd). */
static int simd_level = -1;

static int simd_supported(void) {
#if defined(HAVE_AVX512_PATH)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") ? 1 : 0;
#else
  return 0;
#endif
}

/* want < 0: report the level in use; else use min(want, what this CPU supports). Returns the level. */
int cart_kv_simd(int want) {
  if (simd_level < 0 || want >= 0) {
    int top = simd_supported();
    simd_level = (want < 0 || want > top) ? top : want;
  }
  return simd_level;
}

/* Stores: streaming (non-temporal) when the destination is 16-byte aligned. A cartridge is
 * written once and read later by attention; streaming skips the read-for-ownership of every
 * destination line, which is what lets a transpose keep up with a plain memcpy (glibc's memcpy
 * streams large copies too). */
#if defined(__SSE2__)
#define TILE_STORE(nt, p, x) do { if (nt) _mm_stream_si128((__m128i *)(p), (x)); \
                                  else _mm_storeu_si128((__m128i *)(p), (x)); } while (0)

static inline void tile8x8_u16(const uint16_t *s, int64_t ss, uint16_t *d, int64_t ds, int nt) {
  __m128i a0 = _mm_loadu_si128((const __m128i *)(s + 0 * ss));
  __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 1 * ss));
  __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 2 * ss));
  __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 3 * ss));
  __m128i a4 = _mm_loadu_si128((const __m128i *)(s + 4 * ss));
  __m128i a5 = _mm_loadu_si128((const __m128i *)(s + 5 * ss));
  __m128i a6 = _mm_loadu_si128((const __m128i *)(s + 6 * ss));
  __m128i a7 = _mm_loadu_si128((const __m128i *)(s + 7 * ss));
  __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
  __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
  __m128i b4 = _mm_unpacklo_epi16(a4, a5), b5 = _mm_unpackhi_epi16(a4, a5);
  __m128i b6 = _mm_unpacklo_epi16(a6, a7), b7 = _mm_unpackhi_epi16(a6, a7);
  __m128i c0 = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);
  __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);
  __m128i c4 = _mm_unpacklo_epi32(b4, b6), c5 = _mm_unpackhi_epi32(b4, b6);
  __m128i c6 = _mm_unpacklo_epi32(b5, b7), c7 = _mm_unpackhi_epi32(b5, b7);
  TILE_STORE(nt, d + 0 * ds, _mm_unpacklo_epi64(c0, c4));
  TILE_STORE(nt, d + 1 * ds, _mm_unpackhi_epi64(c0, c4));
  TILE_STORE(nt, d + 2 * ds, _mm_unpacklo_epi64(c1, c5));
  TILE_STORE(nt, d + 3 * ds, _mm_unpackhi_epi64(c1, c5));
  TILE_STORE(nt, d + 4 * ds, _mm_unpacklo_epi64(c2, c6));
  TILE_STORE(nt, d + 5 * ds, _mm_unpackhi_epi64(c2, c6));
  TILE_STORE(nt, d + 6 * ds, _mm_unpacklo_epi64(c3, c7));
  TILE_STORE(nt, d + 7 * ds, _mm_unpackhi_epi64(c3, c7));
}

/* Four rows of four 32-bit elements at s (stride ss) -> o[0..3], o[j] = column j. */
static inline void load4x4_u32_t(const uint32_t *s, int64_t ss, __m128i o[4]) {
  __m128i a0 = _mm_loadu_si128((const __m128i *)(s + 0 * ss));
  __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 1 * ss));
  __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 2 * ss));
  __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 3 * ss));
  __m128i b0 = _mm_unpacklo_epi32(a0, a1), b1 = _mm_unpackhi_epi32(a0, a1);
  __m128i b2 = _mm_unpacklo_epi32(a2, a3), b3 = _mm_unpackhi_epi32(a2, a3);
  o[0] = _mm_unpacklo_epi64(b0, b2);
  o[1] = _mm_unpackhi_epi64(b0, b2);
  o[2] = _mm_unpacklo_epi64(b1, b3);
  o[3] = _mm_unpackhi_epi64(b1, b3);
}

static inline void tile4x4_u32(const uint32_t *s, int64_t ss, uint32_t *d, int64_t ds, int nt) {
  __m128i o[4];
  load4x4_u32_t(s, ss, o);
  for (int j = 0; j < 4; ++j) TILE_STORE(nt, d + j * ds, o[j]);
}
#endif

/* dst[c * ds + r] = src[r * ss + c] for r < rows, c < cols (strides in elements). Tiles go
 * column strip by column strip (outer c0), so each destination row is written front to back. */
#define DEFINE_TRANSPOSE(NAME, T, TILE, FN)                                                  \
  static void NAME(const T *src, int64_t ss, T *dst, int64_t ds, int64_t rows, int64_t cols) { \
    int64_t R = 0, C = 0;                                                                     \
    TRANSPOSE_SIMD(T, TILE, FN)                                                               \
    for (int64_t r = 0; r < rows; ++r)                                                        \
      for (int64_t c = (r < R ? C : 0); c < cols; ++c) dst[c * ds + r] = src[r * ss + c];     \
  }
#if defined(__SSE2__)
#define TRANSPOSE_SIMD(T, TILE, FN)                                                           \
  R = rows - rows % TILE;                                                                     \
  C = cols - cols % TILE;                                                                     \
  int nt = ((uintptr_t)dst % 16 == 0) && ((ds * (int64_t)sizeof(T)) % 16 == 0);               \
  for (int64_t c0 = 0; c0 < C; c0 += TILE)                                                    \
    for (int64_t r0 = 0; r0 < R; r0 += TILE) FN(src + r0 * ss + c0, ss, dst + c0 * ds + r0, ds, nt);
#else
#define TRANSPOSE_SIMD(T, TILE, FN)
#endif
DEFINE_TRANSPOSE(transpose_u16, uint16_t, 8, tile8x8_u16)
DEFINE_TRANSPOSE(transpose_u32, uint32_t, 4, tile4x4_u32)

/* Copy one row of `bytes`, streaming when both ends allow it. */
static inline void copy_row(char *dst, const char *src, int64_t bytes) {
#if defined(__SSE2__)
  if ((uintptr_t)dst % 16 == 0 && bytes % 16 == 0) {
    for (int64_t i = 0; i < bytes; i += 16)
      _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
    return;
  }
#endif
  memcpy(dst, src, (size_t)bytes);
}

static int transpose_any(int elem, const char *src, int64_t ss, char *dst, int64_t ds,
                         int64_t rows, int64_t cols) {
  if (elem == 2) {
    transpose_u16((const uint16_t *)src, ss, (uint16_t *)dst, ds, rows, cols);
  } else if (elem == 4) {
    transpose_u32((const uint32_t *)src, ss, (uint32_t *)dst, ds, rows, cols);
  } else if (elem == 1 || elem == 8) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        memcpy(dst + (c * ds + r) * elem, src + (r * ss + c) * elem, (size_t)elem);
  } else {
    return -1;
  }
  return 0;
}


#if defined(__SSE2__)
/* "amx" K, to the cache: 16 whole tokens -> one tile [D2][16] of u32 pairs, D2 = head_dim / 2 a
 * multiple of 4. Each destination line (one pair column, 16 tokens = 64 bytes) is written front to
 * back in one go: interleaving partial lines cost ~15% here. */
static void amx_k_tile16_sse2(const uint32_t *s, int64_t ss, uint32_t *d, int64_t c0, int64_t D2) {
  for (; c0 < D2; c0 += 4) {
    __m128i o[4][4];  /* o[q][j]: column c0 + j of tokens 4q..4q+3 */
    for (int q = 0; q < 4; ++q) load4x4_u32_t(s + 4 * q * ss + c0, ss, o[q]);
    for (int j = 0; j < 4; ++j)
      for (int q = 0; q < 4; ++q) _mm_stream_si128((__m128i *)(d + (c0 + j) * 16 + q * 4), o[q][j]);
  }
}
#endif

#if defined(HAVE_AVX512_PATH)
/* The same tile, 16 pair columns at a time: a 16x16 u32 transpose in 64 shuffles (per-lane 4x4
 * transposes, then two rounds of 128-bit lane shuffles), one 64-byte streaming store per line.
 * Returns the first pair column it did not do (the SSE2 path finishes D2 % 16). */
__attribute__((target("avx512f")))
static int64_t amx_k_tile16_avx512(const uint32_t *s, int64_t ss, uint32_t *d, int64_t D2) {
  int64_t c0 = 0;
  for (; c0 + 16 <= D2; c0 += 16) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512((const void *)(s + i * ss + c0));
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4g + j], lane L: column 4L + j of rows 4g..4g+3 */
    for (int g = 0; g < 4; ++g) {
      r[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
      r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
      r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
      r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int j = 0; j < 4; ++j) {
      __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), v1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
      __m512i w0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88), w1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
      _mm512_stream_si512((void *)(d + (c0 + 0 + j) * 16), _mm512_shuffle_i32x4(v0, w0, 0x88));
      _mm512_stream_si512((void *)(d + (c0 + 4 + j) * 16), _mm512_shuffle_i32x4(v1, w1, 0x88));
      _mm512_stream_si512((void *)(d + (c0 + 8 + j) * 16), _mm512_shuffle_i32x4(v0, w0, 0xDD));
      _mm512_stream_si512((void *)(d + (c0 + 12 + j) * 16), _mm512_shuffle_i32x4(v1, w1, 0xDD));
    }
  }
  return c0;
}
#endif

/* One whole 16-token "amx" K tile, to the cache; 0 if the destination is not 64-byte aligned (the
 * caller then takes the generic transpose). */
static int amx_k_tile16(const uint32_t *s, int64_t ss, uint32_t *d, int64_t D2) {
#if defined(__SSE2__)
  if ((uintptr_t)d % 64 || D2 % 4) return 0;
  int64_t c0 = 0;
#if defined(HAVE_AVX512_PATH)
  if (cart_kv_simd(-1) >= 1) c0 = amx_k_tile16_avx512(s, ss, d, D2);
#endif
  amx_k_tile16_sse2(s, ss, d, c0, D2);
  return 1;
#else
  (void)s; (void)ss; (void)d; (void)D2;
  return 0;
#endif
}

/* "amx" V, to the cache, a run starting at an even offset with an even length: group by group
 * (16 columns), each token pair interleaved into one 64-byte line, so every group's region is
 * written front to back (pair by pair across groups jumped 8 regions apart: ~1.5x slower). */
static int amx_v_run(const uint16_t *rows, int64_t ts, uint16_t *v_reg, int64_t n, int64_t off, int64_t bs,
                     int64_t D) {
#if defined(__SSE2__)
  if (off % 2 || n % 2 || (uintptr_t)v_reg % 16) return 0;
  for (int64_t g = 0; g < D / 16; ++g) {
    uint16_t *d = v_reg + g * bs * 16 + (off / 2) * 32;
    for (int64_t t = 0; t < n; t += 2, d += 32) {
      const uint16_t *x = rows + t * ts + g * 16, *y = x + ts;
      __m128i x0 = _mm_loadu_si128((const __m128i *)x), y0 = _mm_loadu_si128((const __m128i *)y);
      __m128i x1 = _mm_loadu_si128((const __m128i *)(x + 8)), y1 = _mm_loadu_si128((const __m128i *)(y + 8));
      _mm_stream_si128((__m128i *)(d + 0), _mm_unpacklo_epi16(x0, y0));
      _mm_stream_si128((__m128i *)(d + 8), _mm_unpackhi_epi16(x0, y0));
      _mm_stream_si128((__m128i *)(d + 16), _mm_unpacklo_epi16(x1, y1));
      _mm_stream_si128((__m128i *)(d + 24), _mm_unpackhi_epi16(x1, y1));
    }
  }
  return 1;
#else
  (void)rows; (void)ts; (void)v_reg; (void)n; (void)off; (void)bs; (void)D;
  return 0;
#endif
}

/* "amx" V, to the cache: tokens o, o+1 (both present) interleaved per 16-column group. */
static void amx_v_pair(const uint16_t *a, const uint16_t *b, uint16_t *v_reg, int64_t o, int64_t bs,
                       int64_t D) {
  for (int64_t g = 0; g < D / 16; ++g) {
    uint16_t *d = v_reg + g * bs * 16 + (o / 2) * 32;
    const uint16_t *x = a + g * 16, *y = b + g * 16;
#if defined(__SSE2__)
    int nt = ((uintptr_t)d % 16 == 0);
    __m128i x0 = _mm_loadu_si128((const __m128i *)x), y0 = _mm_loadu_si128((const __m128i *)y);
    __m128i x1 = _mm_loadu_si128((const __m128i *)(x + 8)), y1 = _mm_loadu_si128((const __m128i *)(y + 8));
    TILE_STORE(nt, d + 0, _mm_unpacklo_epi16(x0, y0));
    TILE_STORE(nt, d + 8, _mm_unpackhi_epi16(x0, y0));
    TILE_STORE(nt, d + 16, _mm_unpacklo_epi16(x1, y1));
    TILE_STORE(nt, d + 24, _mm_unpackhi_epi16(x1, y1));
#else
    for (int j = 0; j < 16; ++j) {
      d[2 * j] = x[j];
      d[2 * j + 1] = y[j];
    }
#endif
  }
}

/* One run of n tokens at block offsets off.. of one (layer, head), "amx" layout, 16-bit elements.
 * Rows are token rows (stride ts elements); K rows are read as element pairs (32-bit). */
static void amx_run(int to_cache, uint16_t *k_reg, uint16_t *v_reg, uint16_t *k_rows, uint16_t *v_rows,
                    int64_t ts, int64_t n, int64_t off, int64_t bs, int64_t D) {
  uint32_t *k_reg32 = (uint32_t *)k_reg, *k_rows32 = (uint32_t *)k_rows;
  for (int64_t t0 = 0; t0 < n;) {  /* K: a 16-token tile at a time */
    const int64_t o = off + t0, r0 = o % 16, cnt = (16 - r0 < n - t0) ? 16 - r0 : n - t0;
    uint32_t *tile = k_reg32 + (o / 16) * 8 * D + r0;  /* [D / 2][16] pairs */
    uint32_t *rows = k_rows32 + t0 * (ts / 2);
    if (!to_cache)
      transpose_u32(tile, 16, rows, ts / 2, D / 2, cnt);
    else if (cnt < 16 || !amx_k_tile16(rows, ts / 2, tile, D / 2))  /* partial or unaligned tile */
      transpose_u32(rows, ts / 2, tile, 16, cnt, D / 2);
    t0 += cnt;
  }
  if (to_cache && amx_v_run(v_rows, ts, v_reg, n, off, bs, D)) return;
  for (int64_t t = 0; t < n;) {  /* V: odd starts and lengths, and from the cache */
    const int64_t o = off + t;
    if (to_cache && o % 2 == 0 && t + 1 < n) {
      amx_v_pair(v_rows + t * ts, v_rows + (t + 1) * ts, v_reg, o, bs, D);
      t += 2;
      continue;
    }
    uint16_t *row = v_rows + t * ts;
    for (int64_t d = 0; d < D; ++d) {
      uint16_t *cell = v_reg + (d / 16) * bs * 16 + (o / 2) * 32 + (d % 16) * 2 + o % 2;
      if (to_cache)
        *cell = row[d];
      else
        row[d] = *cell;
    }
    t += 1;
  }
}

int cart_kv_abi_version(void) { return 7; }

enum { LAYOUT_K_TRANSPOSED = 0, LAYOUT_AMX_TILES = 1 };

/* One (layer, run) item: every head of one run of one layer. */
static void copy_item(int layout, int to_cache, int elem, char *const *caches, int64_t l, int64_t H, int64_t D,
                      int64_t bs, const int64_t *r) {
  const int64_t region = bs * D;
  char *obj = (char *)(intptr_t)r[0];
  const int64_t kv_stride = r[1], layer_stride = r[2], tok_stride = r[3];
  const int64_t a = r[4], e = r[5], blk = r[6], off = r[7], head_stride = r[8];
  const int64_t n = e - a;
  char *k_obj = obj + (l * layer_stride) * elem;
  char *v_obj = obj + (kv_stride + l * layer_stride) * elem;
  for (int64_t h = 0; h < H; ++h) {
    char *k_reg = caches[l] + ((blk * H + h) * 2) * region * elem;
    char *v_reg = k_reg + region * elem;
    char *k_rows = k_obj + (a * tok_stride + h * head_stride) * elem;
    char *v_rows = v_obj + (a * tok_stride + h * head_stride) * elem;
    if (layout == LAYOUT_AMX_TILES) {
      amx_run(to_cache, (uint16_t *)k_reg, (uint16_t *)v_reg, (uint16_t *)k_rows, (uint16_t *)v_rows,
              tok_stride, n, off, bs, D);
    } else if (to_cache) {
      transpose_any(elem, k_rows, tok_stride, k_reg + off * elem, bs, n, D);
      for (int64_t t = 0; t < n; ++t)
        copy_row(v_reg + (off + t) * D * elem, v_rows + t * tok_stride * elem, D * elem);
    } else {
      transpose_any(elem, k_reg + off * elem, bs, k_rows, tok_stride, D, n);
      for (int64_t t = 0; t < n; ++t)
        copy_row(v_rows + t * tok_stride * elem, v_reg + (off + t) * D * elem, D * elem);
    }
  }
}

/* items calls of fn(ctx, it), split over `threads` OpenMP threads when threads > 1 (torch's own
 * runtime in a process that loaded torch: see cart_kv_copy); each thread fences its streaming
 * stores, so they are visible before the caller (and attention) reads. One thread never enters
 * an OpenMP region: with vLLM's GOMP_CPU_AFFINITY, libgomp binds a thread that starts a team (even
 * a team of one) to the first place, which would pin the plugin's reader threads (which convert
 * chunks one thread each) to the worker's first core. */
typedef void (*item_fn)(const void *ctx, int64_t it);
static void run_items(int64_t items, int threads, item_fn fn, const void *ctx) {
  if (threads <= 1) {
    for (int64_t it = 0; it < items; ++it) fn(ctx, it);
#if defined(__SSE2__)
    _mm_sfence();
#endif
    return;
  }
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
#endif
  {
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
    for (int64_t it = 0; it < items; ++it) fn(ctx, it);
#if defined(__SSE2__)
    _mm_sfence();
#endif
  }
}

struct copy_ctx {
  int layout, to_cache, elem;
  char *const *caches;
  int64_t H, D, bs;
  const int64_t *runs;
  int64_t nruns;
};

static void copy_one(const void *p, int64_t it) {
  const struct copy_ctx *c = p;
  copy_item(c->layout, c->to_cache, c->elem, c->caches, it / c->nruns, c->H, c->D, c->bs, c->runs + 9 * (it % c->nruns));
}

/* Each run is 9 int64: (obj, kv_stride, layer_stride, tok_stride, token_start, token_end, block,
 * offset, head_stride): a memory object's base address, its strides in elements, and a stretch of
 * its tokens that sits at consecutive slots of one block. For every layer l and run:
 *   obj K rows  = obj + (0 * kv_stride + l * layer_stride + t * tok_stride + h * head_stride) * elem
 *   obj V rows  = obj + (1 * kv_stride + l * layer_stride + t * tok_stride + h * head_stride) * elem
 *   K region    = caches[l] + ((block * H + h) * 2 + 0) * bs * D * elem
 *   V region    = caches[l] + ((block * H + h) * 2 + 1) * bs * D * elem
 * (the regions' interior as `layout` says). head_stride is head_dim for a token-major (`KV_2LTD`)
 * object; a cartridge's packed by-head payload, encoded in place into an engine-blocks object,
 * has its heads a whole [2][L][T][D] apart. to_cache != 0 copies objects -> caches, else
 * caches -> objects. Runs of several memory objects go in one call (one retrieve = one call).
 *
 * threads > 1 splits the (layer, run) items over that many OpenMP threads. Built with -fopenmp in
 * a process that has loaded torch, this is torch's own OpenMP runtime (same soname, loaded once),
 * so a call from vLLM's worker thread runs on the worker's thread pool, bound to the cores vLLM
 * gave it: vLLM's own writer runs there too, and a one-thread copy loses to it on a many-core
 * worker. Items never write the same bytes (runs hold distinct slots), so any split is correct.
 * Without OpenMP the call is single-threaded. Returns 0, -1 on a bad element size, -2 on shapes
 * the layout does not cover. */
int cart_kv_copy(int layout, int to_cache, int elem, char *const *caches, int64_t L, int64_t H,
                 int64_t D, int64_t bs, const int64_t *runs, int64_t nruns, int threads) {
  if (elem != 1 && elem != 2 && elem != 4 && elem != 8) return -1;
  if (layout == LAYOUT_AMX_TILES) {
    if (elem != 2 || D % 16 || bs % 16) return -2;
    for (int64_t i = 0; i < nruns; ++i)  /* K rows are read as 32-bit pairs */
      if (runs[9 * i] % 4 || runs[9 * i + 1] % 2 || runs[9 * i + 2] % 2 || runs[9 * i + 3] % 2 ||
          runs[9 * i + 8] % 2)
        return -2;
  } else if (layout != LAYOUT_K_TRANSPOSED) {
    return -2;
  }
  (void)cart_kv_simd(-1);  /* detected here, once, before any thread reads it */
  const struct copy_ctx ctx = {layout, to_cache, elem, caches, H, D, bs, runs, nruns};
  run_items(L * nruns, threads, copy_one, &ctx);
  return 0;
}

/* Whole blocks between vLLM's paged caches and memory objects that already hold them in the
 * cache's own layout (cpu_kv's "engine blocks"). Each row is 3 int64: (obj, layer_bytes, block):
 * for every layer l, the block_bytes at obj + l * layer_bytes and at caches[l] + block *
 * block_bytes are copied (to_cache != 0: object -> cache); block < 0 (tokens vLLM already holds)
 * is skipped. A block is every head's K and V region, one contiguous range on both sides, so this
 * is a scattered memcpy; streaming stores (the destination is not read again before attention)
 * make it faster here than a plain memcpy of the same bytes. Rows of several objects go in one
 * call; threads as in cart_kv_copy. Returns 0. */
struct blocks_ctx {
  int to_cache;
  char *const *caches;
  int64_t block_bytes;
  const int64_t *rows;
  int64_t nrows;
};

static void blocks_one(const void *p, int64_t it) {
  const struct blocks_ctx *b = p;
  const int64_t l = it / b->nrows, *r = b->rows + 3 * (it % b->nrows);
  if (r[2] < 0) return;
  char *c = b->caches[l] + r[2] * b->block_bytes;
  char *o = (char *)(intptr_t)r[0] + l * r[1];
  if (b->to_cache)
    copy_row(c, o, b->block_bytes);
  else
    copy_row(o, c, b->block_bytes);
}

int cart_kv_blocks(int to_cache, char *const *caches, int64_t L, int64_t block_bytes, const int64_t *rows,
                   int64_t nrows, int threads) {
  const struct blocks_ctx ctx = {to_cache, caches, block_bytes, rows, nrows};
  run_items(L * nrows, threads, blocks_one, &ctx);
  return 0;
}

/* 1 if this build splits copies over OpenMP threads, else 0. */
int cart_kv_openmp(void) {
#if defined(_OPENMP)
  return 1;
#else
  return 0;
#endif
}

