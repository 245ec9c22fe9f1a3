/* copy_hash's loop (_copyhash.h): copy pieces of memory and return the xxh3_64 of `head` followed by all
 * the copied bytes, in order, reading each source byte from memory once.
 *
 * Large pieces go through a bounce buffer that stays in L1: a step of the source is copied into it, hashed
 * there, and streamed from it into the destination with non-temporal stores, which write memory without
 * first reading the destination's lines into the cache (the read-for-ownership that makes a plain copy into
 * cold memory cost two passes).  The checksum is of the bounce buffer's bytes, which are exactly the bytes
 * stored, so a caller that changes its source during the copy gets a stored value whose checksum matches it
 * (the value may be torn, the entry is never corrupt).  Small pieces, and CPUs without SSE2, take a plain
 * copy a step at a time, hashed where it landed while still in the cache.  Measured on one 1 MiB value into
 * a 64 MiB ring of shared memory: plain memcpy 62 us, the old copy-then-hash loop 85-108 us, this 51 us.
 *
 * Included after xxhash.h with COPY_HASH_NAME defined, once per instruction set: _copyhash.c builds the
 * baseline (SSE2 on x86-64), _copyhash_avx2.c the AVX2 one, and the module picks at import what the CPU
 * runs.  Called with the GIL released: it touches no Python object. */
#include "_copyhash.h"

#if defined(__SSE2__)
#include <immintrin.h>
#define COPY_HASH_CAN_STREAM 1
#endif

#ifdef COPY_HASH_CAN_STREAM
#if defined(__AVX2__)
typedef __m256i copy_vec;
#define VLOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VSTORE(p, x) _mm256_store_si256((__m256i *)(p), (x))
#define VSTREAM(p, x) _mm256_stream_si256((__m256i *)(p), (x))
#else
typedef __m128i copy_vec;
#define VLOAD(p) _mm_loadu_si128((const __m128i *)(p))
#define VSTORE(p, x) _mm_store_si128((__m128i *)(p), (x))
#define VSTREAM(p, x) _mm_stream_si128((__m128i *)(p), (x))
#endif
#define VW sizeof(copy_vec)

/* Copy n bytes from `src` (any alignment) into the aligned bounce buffer with vector loads and stores:
 * glibc's memcpy of a few KiB uses `rep movsb`, which runs at half speed or worse when the two buffers
 * are not equally aligned (measured: 1 MiB from a source 16 bytes off a cache line, 53 -> 73 us). */
static inline void copy_hash_fill(char *bounce, const char *src, size_t n) {
    size_t i = 0;
    for (; i + 4 * VW <= n; i += 4 * VW) {
        copy_vec a = VLOAD(src + i), b = VLOAD(src + i + VW), c = VLOAD(src + i + 2 * VW), d = VLOAD(src + i + 3 * VW);
        VSTORE(bounce + i, a);
        VSTORE(bounce + i + VW, b);
        VSTORE(bounce + i + 2 * VW, c);
        VSTORE(bounce + i + 3 * VW, d);
    }
    memcpy(bounce + i, src + i, n - i);
}

/* Copy n bytes from `src` (in L1) to `dst` with non-temporal stores (the caller fences). */
static inline void copy_hash_stream(char *dst, const char *src, size_t n) {
    size_t i = (VW - ((uintptr_t)dst & (VW - 1))) & (VW - 1); /* up to dst's alignment */
    if (i > n) i = n;
    memcpy(dst, src, i);
    for (; i + 4 * VW <= n; i += 4 * VW) {
        copy_vec a = VLOAD(src + i), b = VLOAD(src + i + VW), c = VLOAD(src + i + 2 * VW), d = VLOAD(src + i + 3 * VW);
        VSTREAM(dst + i, a);
        VSTREAM(dst + i + VW, b);
        VSTREAM(dst + i + 2 * VW, c);
        VSTREAM(dst + i + 3 * VW, d);
    }
    memcpy(dst + i, src + i, n - i);
}
#undef VLOAD
#undef VSTORE
#undef VSTREAM
#undef VW
#endif

__attribute__((visibility("hidden"))) uint64_t COPY_HASH_NAME(const struct copy_piece *pieces, size_t n,
                                                              const void *head, size_t head_len) {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    if (head_len) XXH3_64bits_update(&state, head, head_len);
#ifdef COPY_HASH_CAN_STREAM
    char bounce[COPY_HASH_BOUNCE] __attribute__((aligned(64)));
    int streamed = 0;
#endif
    for (size_t i = 0; i < n; i++) {
        const struct copy_piece *p = &pieces[i];
#ifdef COPY_HASH_CAN_STREAM
        /* Overlapping pieces keep memmove's meaning on the plain path. */
        int apart = p->dst + p->len <= p->src || p->src + p->len <= p->dst;
        if (p->len >= COPY_HASH_STREAM_MIN && apart) {
            for (size_t off = 0; off < p->len; off += COPY_HASH_BOUNCE) {
                size_t len = p->len - off < COPY_HASH_BOUNCE ? p->len - off : COPY_HASH_BOUNCE;
                copy_hash_fill(bounce, p->src + off, len);
                XXH3_64bits_update(&state, bounce, len);
                copy_hash_stream(p->dst + off, bounce, len);
            }
            streamed = 1;
            continue;
        }
#endif
        for (size_t off = 0; off < p->len; off += COPY_HASH_STEP) {
            size_t len = p->len - off < COPY_HASH_STEP ? p->len - off : COPY_HASH_STEP;
            memmove(p->dst + off, p->src + off, len);
            XXH3_64bits_update(&state, p->dst + off, len);
        }
    }
#ifdef COPY_HASH_CAN_STREAM
    /* Non-temporal stores are weakly ordered: fence them before whatever the caller stores next (a seal
     * that makes the value visible to other processes). */
    if (streamed) _mm_sfence();
#endif
    return XXH3_64bits_digest(&state);
}
