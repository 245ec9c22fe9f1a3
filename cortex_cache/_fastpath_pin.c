/* Pin: a pinned value's bytes.
 *
 * A pin on one entry that exports its value's bytes, read-only (an EntryView's memoryview is made from
 * it).  Whatever is made from that memoryview (slices, numpy arrays, tensors) keeps the Pin exported,
 * so an owner's release while such an object lives only marks the Pin: its last export's end unpins
 * (the `gpu.entry_tensor` rule, docs/python-api.md).  A Pin also holds its own export of the mapping,
 * so the pool's close() cannot unmap the bytes under a user. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "_fastpath.h"

static void pin_unpin_late(Pin *self) {
    Fast *f = (Fast *)self->fast;
    self->state = PIN_DONE;
    if (f == NULL || f->late_unpin == NULL) return; /* the pool is closed: the pin goes with the process */
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyObject *r = PyObject_CallFunction(f->late_unpin, "KL", (unsigned long long)self->pin, (long long)self->slot);
    if (r == NULL)
        PyErr_WriteUnraisable((PyObject *)self);
    Py_XDECREF(r);
    PyErr_Restore(t, v, tb);
}

static int Pin_getbuffer(Pin *self, Py_buffer *view, int flags) {
    if (!self->have_map || self->state == PIN_DONE) {
        PyErr_SetString(PyExc_BufferError, "this view was released");
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, (char *)self->map.buf + self->off, (Py_ssize_t)self->len, 1,
                          flags) < 0)
        return -1;
    self->exports++;
    return 0;
}

static void Pin_releasebuffer(Pin *self, Py_buffer *view) {
    if (--self->exports == 0 && self->state == PIN_DEFERRED) pin_unpin_late(self);
}

static void Pin_dealloc(Pin *self) {
    PyObject_GC_UnTrack(self);
    if (self->state == PIN_HELD) pin_unpin_late(self); /* dropped without a release */
    if (self->have_map) {
        self->have_map = 0;
        PyBuffer_Release(&self->map);
    }
    Py_CLEAR(self->fast);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Pin_traverse(Pin *self, visitproc visit, void *arg) {
    Py_VISIT(self->fast);
    return 0;
}

/* drop() -> True: nothing uses the bytes, unpin now (the caller does, with release_pins); False: in use,
 * the last user's end unpins; None: already dropped. */
static PyObject *Pin_drop(Pin *self, PyObject *unused) {
    if (self->state != PIN_HELD) Py_RETURN_NONE;
    if (self->exports > 0) {
        self->state = PIN_DEFERRED;
        Py_RETURN_FALSE;
    }
    self->state = PIN_DONE;
    Py_RETURN_TRUE;
}

static PyObject *Pin_view(Pin *self, PyObject *unused) { return PyMemoryView_FromObject((PyObject *)self); }

static PyMethodDef Pin_methods[] = {
    {"drop", (PyCFunction)Pin_drop, METH_NOARGS, "True: unpin now; False: its last user will; None: done"},
    {"view", (PyCFunction)Pin_view, METH_NOARGS, "a read-only memoryview of the value"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Pin_members[] = {
    {"pin", T_ULONGLONG, offsetof(Pin, pin), READONLY, "the pin record"},
    {"slot", T_LONGLONG, offsetof(Pin, slot), READONLY, "the entry's slot"},
    {"offset", T_ULONGLONG, offsetof(Pin, off), READONLY, "of the value in the segment"},
    {"length", T_ULONGLONG, offsetof(Pin, len), READONLY, "of the value"},
    {"checksum", T_ULONGLONG, offsetof(Pin, checksum), READONLY, "xxh3_64 of the value, taken at put"},
    {NULL, 0, 0, 0, NULL},
};

static PyBufferProcs Pin_as_buffer = {(getbufferproc)Pin_getbuffer, (releasebufferproc)Pin_releasebuffer};

PyTypeObject PinType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cortex_cache._fastpath.Pin",
    .tp_basicsize = sizeof(Pin),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A pinned entry exporting its value's bytes (see _fastpath_pin.c).",
    .tp_dealloc = (destructor)Pin_dealloc,
    .tp_traverse = (traverseproc)Pin_traverse,
    .tp_as_buffer = &Pin_as_buffer,
    .tp_methods = Pin_methods,
    .tp_members = Pin_members,
};

PyObject *new_pin(Fast *f, uint64_t j, int64_t slot, uint64_t off, uint64_t len, uint64_t cks) {
    Pin *p = PyObject_GC_New(Pin, &PinType);
    if (p == NULL) return NULL;
    p->fast = NULL;
    p->have_map = 0;
    p->state = PIN_DONE; /* until complete: a failed construction unpins nothing */
    p->exports = 0;
    p->pin = j;
    p->slot = slot;
    p->off = off;
    p->len = len;
    p->checksum = cks;
    if (PyObject_GetBuffer(f->buf.obj, &p->map, PyBUF_SIMPLE) < 0) {
        Py_DECREF(p);
        return NULL;
    }
    p->have_map = 1;
    p->fast = Py_NewRef((PyObject *)f);
    p->state = PIN_HELD;
    PyObject_GC_Track(p);
    return (PyObject *)p;
}
