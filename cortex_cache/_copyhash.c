/* copy_hash for Python, and the baseline build of its loop (_copyhash.h, _copyhash_loop.h).
 *
 * xxh3_64 comes from xxHash (third_party/xxhash, vendored): built here for the baseline instruction set
 * (SSE2 on x86-64) and in _copyhash_avx2.c for AVX2; copy_hash_pick chooses at import. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "_fastpath.h"

#define XXH_INLINE_ALL
#include "xxhash.h"
#define COPY_HASH_NAME cortex_copy_hash_base
#include "_copyhash_loop.h"

copy_hash_fn copy_hash_impl = cortex_copy_hash_base;
const char *copy_hash_isa = "baseline";

void copy_hash_pick(void) {
#ifdef COPY_HASH_HAVE_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        copy_hash_impl = cortex_copy_hash_avx2;
        copy_hash_isa = "avx2";
    }
#endif
}

PyObject *copy_hash(PyObject *module, PyObject *args) {
    Py_buffer dst, src, head = {0};
    if (!PyArg_ParseTuple(args, "w*y*|y*:copy_hash", &dst, &src, &head)) return NULL;
    PyObject *r = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy_hash: dst holds %zd bytes, src %zd", dst.len, src.len);
    } else {
        uint64_t h;
        struct copy_piece one = {dst.buf, src.buf, (size_t)src.len};
        if (src.len >= COPY_HASH_GIL_FREE) {
            Py_BEGIN_ALLOW_THREADS
            h = copy_hash_impl(&one, 1, head.buf, (size_t)head.len);
            Py_END_ALLOW_THREADS
        } else {
            h = copy_hash_impl(&one, 1, head.buf, (size_t)head.len);
        }
        r = PyLong_FromUnsignedLongLong(h);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    if (head.obj != NULL) PyBuffer_Release(&head);
    return r;
}

/* copy_hash_many(dsts, srcs, head=b'') -> int: copy srcs[i] into dsts[i] (each pair the same length), and
 * the xxh3_64 of head followed by every copy in order -- a value gathered from (or scattered to) pieces
 * elsewhere in memory, with one GIL release for all of them. */
PyObject *copy_hash_many(PyObject *module, PyObject *args) {
    PyObject *dsts, *srcs;
    Py_buffer head = {0};
    if (!PyArg_ParseTuple(args, "OO|y*:copy_hash_many", &dsts, &srcs, &head)) return NULL;
    PyObject *r = NULL, *dseq = NULL, *sseq = NULL;
    Py_buffer *bufs = NULL; /* dst 0, src 0, dst 1, src 1, ... */
    struct copy_piece *pieces = NULL;
    Py_ssize_t n = 0, got = 0, total = 0;
    dseq = PySequence_Fast(dsts, "copy_hash_many: dsts must be a sequence of buffers");
    if (dseq == NULL) goto done;
    sseq = PySequence_Fast(srcs, "copy_hash_many: srcs must be a sequence of buffers");
    if (sseq == NULL) goto done;
    n = PySequence_Fast_GET_SIZE(dseq);
    if (PySequence_Fast_GET_SIZE(sseq) != n) {
        PyErr_Format(PyExc_ValueError, "copy_hash_many: %zd dsts, %zd srcs", n, PySequence_Fast_GET_SIZE(sseq));
        goto done;
    }
    bufs = PyMem_Calloc((size_t)(2 * n + 1), sizeof(Py_buffer));
    if (bufs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* Every buffer taken and every length checked before a byte is copied: a bad pair changes nothing. */
    for (; got < n; got++) {
        Py_buffer *d = &bufs[2 * got], *s = &bufs[2 * got + 1];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(dseq, got), d, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            if (PyErr_ExceptionMatches(PyExc_BufferError)) { /* as copy_hash (and the Python loop) say it */
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "copy_hash_many: dst %zd is read-only", got);
            }
            goto done;
        }
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(sseq, got), s, PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(d);
            goto done;
        }
        if (d->len != s->len) {
            PyErr_Format(PyExc_ValueError, "copy_hash_many: dst %zd holds %zd bytes, src %zd", got, d->len, s->len);
            PyBuffer_Release(d);
            PyBuffer_Release(s);
            goto done;
        }
        total += s->len;
    }
    pieces = PyMem_Calloc((size_t)n + 1, sizeof(struct copy_piece));
    if (pieces == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        pieces[i] = (struct copy_piece){bufs[2 * i].buf, bufs[2 * i + 1].buf, (size_t)bufs[2 * i].len};
    {
        uint64_t h;
        if (total >= COPY_HASH_GIL_FREE) {
            Py_BEGIN_ALLOW_THREADS
            h = copy_hash_impl(pieces, (size_t)n, head.buf, (size_t)head.len);
            Py_END_ALLOW_THREADS
        } else {
            h = copy_hash_impl(pieces, (size_t)n, head.buf, (size_t)head.len);
        }
        r = PyLong_FromUnsignedLongLong(h);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) {
        PyBuffer_Release(&bufs[2 * i]);
        PyBuffer_Release(&bufs[2 * i + 1]);
    }
    PyMem_Free(bufs);
    PyMem_Free(pieces);
    Py_XDECREF(dseq);
    Py_XDECREF(sseq);
    if (head.obj != NULL) PyBuffer_Release(&head);
    return r;
}

/* gather_hash(dst, src, offsets, lengths, sums) -> int: copy the pieces src[offsets[i] : offsets[i] + lengths[i]]
 * into dst back to back and put each piece's own xxh3_64 into sums[i] (offsets, lengths, sums: buffers of
 * native u64, one per piece); the bytes copied.  A persist's gather of many small values out of a pool (or a
 * pack) into one buffer to write, each value's checksum taken from the copy, with one call and one GIL
 * release for thousands of them.  Every piece is checked against src's and dst's sizes first: a bad one
 * copies nothing (ValueError). */
PyObject *gather_hash(PyObject *module, PyObject *args) {
    Py_buffer dst, src, offs, lens, sums;
    if (!PyArg_ParseTuple(args, "w*y*y*y*w*:gather_hash", &dst, &src, &offs, &lens, &sums)) return NULL;
    PyObject *r = NULL;
    size_t n = (size_t)offs.len / 8, total = 0;
    if ((size_t)offs.len % 8 || (size_t)lens.len != n * 8 || (size_t)sums.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "gather_hash: offsets, lengths and sums must be u64 buffers of one length");
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        uint64_t off, len;
        memcpy(&off, (const char *)offs.buf + 8 * i, 8);
        memcpy(&len, (const char *)lens.buf + 8 * i, 8);
        if (off > (uint64_t)src.len || len > (uint64_t)src.len - off || len > (uint64_t)dst.len - total) {
            PyErr_Format(PyExc_ValueError, "gather_hash: piece %zu (%llu bytes at %llu) is outside src or dst", i,
                         (unsigned long long)len, (unsigned long long)off);
            goto done;
        }
        total += (size_t)len;
    }
    {
        const char *s = src.buf, *o = offs.buf, *l = lens.buf;
        char *d = dst.buf, *out = sums.buf;
        Py_BEGIN_ALLOW_THREADS
        size_t at = 0;
        for (size_t i = 0; i < n; i++) {
            uint64_t off, len, h;
            memcpy(&off, o + 8 * i, 8);
            memcpy(&len, l + 8 * i, 8);
            struct copy_piece one = {d + at, s + off, (size_t)len};
            h = copy_hash_impl(&one, 1, NULL, 0);
            memcpy(out + 8 * i, &h, 8);
            at += (size_t)len;
        }
        Py_END_ALLOW_THREADS
    }
    r = PyLong_FromSize_t(total);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&sums);
    return r;
}

/* use_copy_hash_isa(name) -> str: run copy_hash on "baseline" or "avx2" (if built and the CPU has it) from
 * now on; the previous name.  For tests, so that a machine with AVX2 checks the baseline build too. */
PyObject *use_copy_hash_isa(PyObject *module, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    PyObject *was = PyUnicode_FromString(copy_hash_isa);
    if (was == NULL) return NULL;
    if (strcmp(name, "baseline") == 0) {
        copy_hash_impl = cortex_copy_hash_base;
        copy_hash_isa = "baseline";
        return was;
    }
#ifdef COPY_HASH_HAVE_AVX2
    if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2")) {
        copy_hash_impl = cortex_copy_hash_avx2;
        copy_hash_isa = "avx2";
        return was;
    }
#endif
    Py_DECREF(was);
    PyErr_Format(PyExc_ValueError, "use_copy_hash_isa: %R is not built or not supported by this CPU", arg);
    return NULL;
}
