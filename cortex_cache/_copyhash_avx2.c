/* The AVX2 build of copy_hash's loop (_copyhash_loop.h).  copy_hash_pick (_copyhash.c) points at it only
 * where the CPU reports AVX2; everywhere else (other CPUs, other architectures, compilers without GCC's
 * target pragma) this file compiles to nothing and the baseline build runs. */
#include "_copyhash.h"
#ifdef COPY_HASH_HAVE_AVX2
#pragma GCC target("avx2")
#include <string.h>
#define XXH_INLINE_ALL
#include "xxhash.h"
#define COPY_HASH_NAME cortex_copy_hash_avx2
#include "_copyhash_loop.h"
#else
typedef int cortex_copy_hash_avx2_unused; /* ISO C wants something in a translation unit */
#endif
