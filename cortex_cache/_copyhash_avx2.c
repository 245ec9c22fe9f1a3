/* The AVX2 build of copy_hash's loop (_copyhash.h).  _fastpath.c calls it only where the CPU reports AVX2;
 * everywhere else (other CPUs, other architectures, compilers without GCC's target pragma) this file
 * compiles to nothing and the baseline build runs. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2")
#include <stdint.h>
#include <string.h>
#define XXH_INLINE_ALL
#include "xxhash.h"
#define COPY_HASH_NAME cortex_copy_hash_avx2
#include "_copyhash.h"
#else
typedef int cortex_copy_hash_avx2_unused; /* ISO C wants something in a translation unit */
#endif
