/* Copy between token-major KV rows (LMCache's KV_2LTD chunks) and vLLM-CPU's paged KV blocks in
 * the layout of its "vec"/"vec16" attention writers: per (block, head) a K region stored
 * transposed, [head_dim][block_size], followed by a V region [block_size][head_dim].
 *
 * Why a kernel: the K transpose is the whole cost of injection on vLLM's CPU backend. torch's
 * strided copy (and vLLM's own per-token writer) move it at a fraction of memory speed; a tiled
 * transpose with 8x8 (16-bit) / 4x4 (32-bit) SSE2 register transposes runs near a plain copy.
 * The layout itself is not decided here: lmcache_cartridge/vllm/cpu_layout.py derives it from
 * vLLM's writer op and only calls this kernel for a layout it proved equal to this one.
 *
 * Where it runs: in the vLLM worker process, on the thread LMCache calls the connector from
 * (ctypes releases the GIL). It owns no memory: it reads and writes what the caller passes.
 * Build: `make native` (cc -O3 -shared -fPIC); lmcache_cartridge/vllm/native.py loads it and
 * falls back to pure torch when it is absent.
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* dst[c * ds + r] = src[r * ss + c] for r < rows, c < cols (strides in elements). */
static void transpose_u16(const uint16_t *src, int64_t ss, uint16_t *dst, int64_t ds,
                          int64_t rows, int64_t cols) {
  int64_t r0 = 0;
#if defined(__SSE2__)
  for (; r0 + 8 <= rows; r0 += 8) {
    int64_t c0 = 0;
    for (; c0 + 8 <= cols; c0 += 8) {
      const uint16_t *s = src + r0 * ss + c0;
      uint16_t *d = dst + c0 * ds + r0;
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
      __m128i c0_ = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);
      __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);
      __m128i c4 = _mm_unpacklo_epi32(b4, b6), c5 = _mm_unpackhi_epi32(b4, b6);
      __m128i c6 = _mm_unpacklo_epi32(b5, b7), c7 = _mm_unpackhi_epi32(b5, b7);
      _mm_storeu_si128((__m128i *)(d + 0 * ds), _mm_unpacklo_epi64(c0_, c4));
      _mm_storeu_si128((__m128i *)(d + 1 * ds), _mm_unpackhi_epi64(c0_, c4));
      _mm_storeu_si128((__m128i *)(d + 2 * ds), _mm_unpacklo_epi64(c1, c5));
      _mm_storeu_si128((__m128i *)(d + 3 * ds), _mm_unpackhi_epi64(c1, c5));
      _mm_storeu_si128((__m128i *)(d + 4 * ds), _mm_unpacklo_epi64(c2, c6));
      _mm_storeu_si128((__m128i *)(d + 5 * ds), _mm_unpackhi_epi64(c2, c6));
      _mm_storeu_si128((__m128i *)(d + 6 * ds), _mm_unpacklo_epi64(c3, c7));
      _mm_storeu_si128((__m128i *)(d + 7 * ds), _mm_unpackhi_epi64(c3, c7));
    }
    for (; c0 < cols; ++c0)
      for (int64_t r = r0; r < r0 + 8; ++r) dst[c0 * ds + r] = src[r * ss + c0];
  }
#endif
  for (; r0 < rows; ++r0)
    for (int64_t c = 0; c < cols; ++c) dst[c * ds + r0] = src[r0 * ss + c];
}

static void transpose_u32(const uint32_t *src, int64_t ss, uint32_t *dst, int64_t ds,
                          int64_t rows, int64_t cols) {
  int64_t r0 = 0;
#if defined(__SSE2__)
  for (; r0 + 4 <= rows; r0 += 4) {
    int64_t c0 = 0;
    for (; c0 + 4 <= cols; c0 += 4) {
      const uint32_t *s = src + r0 * ss + c0;
      uint32_t *d = dst + c0 * ds + r0;
      __m128i a0 = _mm_loadu_si128((const __m128i *)(s + 0 * ss));
      __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 1 * ss));
      __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 2 * ss));
      __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 3 * ss));
      __m128i b0 = _mm_unpacklo_epi32(a0, a1), b1 = _mm_unpackhi_epi32(a0, a1);
      __m128i b2 = _mm_unpacklo_epi32(a2, a3), b3 = _mm_unpackhi_epi32(a2, a3);
      _mm_storeu_si128((__m128i *)(d + 0 * ds), _mm_unpacklo_epi64(b0, b2));
      _mm_storeu_si128((__m128i *)(d + 1 * ds), _mm_unpackhi_epi64(b0, b2));
      _mm_storeu_si128((__m128i *)(d + 2 * ds), _mm_unpacklo_epi64(b1, b3));
      _mm_storeu_si128((__m128i *)(d + 3 * ds), _mm_unpackhi_epi64(b1, b3));
    }
    for (; c0 < cols; ++c0)
      for (int64_t r = r0; r < r0 + 4; ++r) dst[c0 * ds + r] = src[r * ss + c0];
  }
#endif
  for (; r0 < rows; ++r0)
    for (int64_t c = 0; c < cols; ++c) dst[c * ds + r0] = src[r0 * ss + c];
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

int cart_kv_abi_version(void) { return 1; }

/* For every layer l and run (token_start, token_end, block, offset):
 *   obj K rows  = obj + (0 * kv_stride + l * layer_stride + t * tok_stride + h * D) * elem
 *   obj V rows  = obj + (1 * kv_stride + l * layer_stride + t * tok_stride + h * D) * elem
 *   K region    = caches[l] + ((block * H + h) * 2 + 0) * bs * D * elem, [D][bs]
 *   V region    = caches[l] + ((block * H + h) * 2 + 1) * bs * D * elem, [bs][D]
 * to_cache != 0 copies obj -> caches, else caches -> obj. Returns 0, or -1 on a bad element size. */
int cart_kv_copy(int to_cache, int elem, char *obj, int64_t kv_stride, int64_t layer_stride,
                 int64_t tok_stride, char *const *caches, int64_t L, int64_t H, int64_t D,
                 int64_t bs, const int64_t *runs, int64_t nruns) {
  if (elem != 1 && elem != 2 && elem != 4 && elem != 8) return -1;
  const int64_t region = bs * D;
  for (int64_t l = 0; l < L; ++l) {
    char *k_obj = obj + (l * layer_stride) * elem;
    char *v_obj = obj + (kv_stride + l * layer_stride) * elem;
    for (int64_t i = 0; i < nruns; ++i) {
      const int64_t a = runs[4 * i], e = runs[4 * i + 1], blk = runs[4 * i + 2], off = runs[4 * i + 3];
      const int64_t n = e - a;
      for (int64_t h = 0; h < H; ++h) {
        char *k_reg = caches[l] + ((blk * H + h) * 2) * region * elem;
        char *v_reg = k_reg + region * elem;
        char *k_rows = k_obj + (a * tok_stride + h * D) * elem;
        char *v_rows = v_obj + (a * tok_stride + h * D) * elem;
        if (to_cache) {
          transpose_any(elem, k_rows, tok_stride, k_reg + off * elem, bs, n, D);
          for (int64_t t = 0; t < n; ++t)
            memcpy(v_reg + (off + t) * D * elem, v_rows + t * tok_stride * elem, (size_t)(D * elem));
        } else {
          transpose_any(elem, k_reg + off * elem, bs, k_rows, tok_stride, D, n);
          for (int64_t t = 0; t < n; ++t)
            memcpy(v_rows + t * tok_stride * elem, v_reg + (off + t) * D * elem, (size_t)(D * elem));
        }
      }
    }
  }
  return 0;
}
