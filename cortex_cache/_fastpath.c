/* The module cortex_cache._fastpath: the hot paths of a pool in C (docs/internals.md, "The fast path";
 * _fastpath.h says what each file holds).  Here: the Fast type's lifecycle and method table, and the
 * module's init. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "_fastpath.h"

PyObject *SLOW;

/* ------------------------------------------------------------------ lifecycle */

#define CLEAR_FIELD(name) Py_CLEAR(self->name);
#define VISIT_FIELD(name) Py_VISIT(self->name);

static int Fast_clear(Fast *self) {
    FAST_OBJECTS(CLEAR_FIELD)
    return 0;
}

static int Fast_traverse(Fast *self, visitproc visit, void *arg) {
    FAST_OBJECTS(VISIT_FIELD)
    return 0;
}

static void Fast_release_all(Fast *self) {
    Fast_clear(self);
    if (self->have_buf) {
        self->have_buf = 0;
        PyBuffer_Release(&self->buf);
    }
}

static void Fast_dealloc(Fast *self) {
    PyObject_GC_UnTrack(self);
    Fast_release_all(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Fast_close(Fast *self, PyObject *unused) {
    self->closing = 1;
    if (self->inflight == 0) Fast_release_all(self);
    Py_RETURN_NONE;
}

static int check_open(Fast *self) {
    if (!self->have_buf || self->closing) {
        PyErr_SetString(PyExc_ValueError, "fast path is closed");
        return -1;
    }
    return 0;
}

/* Every call is counted in flight, so that a close() from another thread (while this one copies without
 * the GIL, or runs a Python hook) cannot unmap the memory under it. */
#define GUARDED(name)                                                                   \
    static PyObject *Fast_##name(Fast *self, PyObject *const *args, Py_ssize_t nargs) { \
        if (check_open(self) < 0) return NULL;                                          \
        self->inflight++;                                                               \
        PyObject *r = do_##name(self, args, nargs);                                     \
        if (--self->inflight == 0 && self->closing) Fast_release_all(self);             \
        return r;                                                                       \
    }
GUARDED(read)
GUARDED(read_many)
GUARDED(pin_many)
GUARDED(unpin_many)
GUARDED(probe)
GUARDED(still)
GUARDED(populate)
GUARDED(put)
GUARDED(put_many)
GUARDED(reserve_many)
GUARDED(seal_many)
GUARDED(load_many)
GUARDED(evicted)
GUARDED(fill_reserve)
GUARDED(fill_copy)
GUARDED(fill_seal)

static PyMethodDef Fast_methods[] = {
    {"evicted", (PyCFunction)(void (*)(void))Fast_evicted, METH_FASTCALL,
     "evicted(slot) -> None: QueueVictims.evicted, lock held by the caller"},
    {"read", (PyCFunction)(void (*)(void))Fast_read, METH_FASTCALL,
     "read(kb, kh, out, mode) -> bytes | int | None | SLOW"},
    {"read_many", (PyCFunction)(void (*)(void))Fast_read_many, METH_FASTCALL,
     "read_many(keys, outs, mode) -> list of int | None | SLOW"},
    {"pin_many", (PyCFunction)(void (*)(void))Fast_pin_many, METH_FASTCALL,
     "pin_many(keys, mode) -> list of Pin | None | SLOW, or None if busy"},
    {"unpin_many", (PyCFunction)(void (*)(void))Fast_unpin_many, METH_FASTCALL,
     "unpin_many(pins) -> True, or False if the lock was busy"},
    {"probe", (PyCFunction)(void (*)(void))Fast_probe, METH_FASTCALL,
     "probe(kb, kh) -> (slot, insert_seq) | None: what a seqlock read records (tests)"},
    {"still", (PyCFunction)(void (*)(void))Fast_still, METH_FASTCALL,
     "still(slot, insert_seq) -> bool: the seqlock check after a copy (tests)"},
    {"populate", (PyCFunction)(void (*)(void))Fast_populate, METH_FASTCALL,
     "populate(off, len) -> bool: map that range of the segment into this process, the GIL released"},
    {"load_many", (PyCFunction)(void (*)(void))Fast_load_many, METH_FASTCALL,
     "load_many(keys, outs, header, key_ids, mode, verify, workers) -> (outcomes, leftover pins) | SLOW"},
    {"put", (PyCFunction)(void (*)(void))Fast_put, METH_FASTCALL,
     "put(kb, kh, flags, value, nblk, ttl, prio) -> slot | SLOW | (slot, checksum): seal it, the lock was busy"},
    {"put_many", (PyCFunction)(void (*)(void))Fast_put_many, METH_FASTCALL,
     "put_many(items, ttl, prio) -> list of None | error | SLOW, or SLOW if busy: values up to put_in_lock"},
    {"reserve_many", (PyCFunction)(void (*)(void))Fast_reserve_many, METH_FASTCALL,
     "reserve_many(items) -> list of (slot, offset) | error, or SLOW if busy"},
    {"seal_many", (PyCFunction)(void (*)(void))Fast_seal_many, METH_FASTCALL,
     "seal_many(items) -> list of True | False (taken back) | SLOW, or SLOW if busy"},
    {"fill_reserve", (PyCFunction)(void (*)(void))Fast_fill_reserve, METH_FASTCALL,
     "fill_reserve(blob, key_off, key_len, flags, length, expiry, start, first_pos, now, kh_out, slot_out, off_out)"
     " -> index stopped at: a fill batch's reservations, lock held by the caller (_fastpath_fill.c)"},
    {"fill_copy", (PyCFunction)(void (*)(void))Fast_fill_copy, METH_FASTCALL,
     "fill_copy(values, src, length, slot, dst, checksum, ok_out) -> written: check and write a fill batch's values"},
    {"fill_seal", (PyCFunction)(void (*)(void))Fast_fill_seal, METH_FASTCALL,
     "fill_seal(blob, key_off, key_len, kh, slot, ok, start, stop, first_pos, meta, counts) -> index stopped at: "
     "seal a fill batch, lock held by the caller"},
    {"close", (PyCFunction)Fast_close, METH_NOARGS, "release the mapping"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Fast_members[] = {
    {"spill", T_INT, offsetof(Fast, spill), 0,
     "nonzero while a tier sees each victim first (Core.on_evict): victims are then evicted in Python"},
    {"evicted_in_c", T_ULONGLONG, offsetof(Fast, evicted_in_c), READONLY,
     "victims this handle chose and evicted in C (tests)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject FastType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cortex_cache._fastpath.Fast",
    .tp_basicsize = sizeof(Fast),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The hot paths of one attached pool (see _fastpath.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Fast_init,
    .tp_dealloc = (destructor)Fast_dealloc,
    .tp_traverse = (traverseproc)Fast_traverse,
    .tp_clear = (inquiry)Fast_clear,
    .tp_methods = Fast_methods,
    .tp_members = Fast_members,
};

static PyMethodDef module_methods[] = {
    {"copy_hash", copy_hash, METH_VARARGS,
     "copy_hash(dst, src, head=b'') -> int: copy src into dst (same length), and the xxh3_64 of head followed "
     "by the bytes copied, each step hashed while in the CPU cache"},
    {"copy_hash_many", copy_hash_many, METH_VARARGS,
     "copy_hash_many(dsts, srcs, head=b'') -> int: copy each src into its dst, and the xxh3_64 of head "
     "followed by all the copies in order"},
    {"gather_hash", gather_hash, METH_VARARGS,
     "gather_hash(dst, src, offsets, lengths, sums) -> int: copy each piece src[offsets[i]:+lengths[i]] into dst "
     "back to back and its xxh3_64 into sums[i] (u64 buffers); the bytes copied"},
    {"use_copy_hash_isa", use_copy_hash_isa, METH_O,
     "use_copy_hash_isa(name) -> str: run copy_hash on 'baseline' or 'avx2' from now on (tests); the previous"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT, "_fastpath", "The hot paths of a pool, in C (core_fast.py binds them).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastpath(void) {
    if (PyType_Ready(&FastType) < 0 || PyType_Ready(&PinType) < 0 || PyType_Ready(&GuardType) < 0) return NULL;
    PyObject *m = PyModule_Create(&fastpath_module);
    if (m == NULL) return NULL;
    copy_hash_pick();
    if (PyModule_AddStringConstant(m, "COPY_HASH_ISA", copy_hash_isa) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    SLOW = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    if (SLOW == NULL || PyModule_AddObjectRef(m, "SLOW", SLOW) < 0 ||
        PyModule_AddObjectRef(m, "Fast", (PyObject *)&FastType) < 0 ||
        PyModule_AddObjectRef(m, "Pin", (PyObject *)&PinType) < 0 ||
        PyModule_AddObjectRef(m, "Guard", (PyObject *)&GuardType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
