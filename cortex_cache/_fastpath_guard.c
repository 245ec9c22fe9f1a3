/* Guard: a mapping fenced against SIGBUS.
 *
 * Another process that can write a pool's segment can truncate it (ftruncate), and a pool made with
 * --no-reserve faults when /dev/shm fills: either way the next access to a page past the end raises SIGBUS,
 * which kills the process -- an engine, for another user's mistake.  A Guard registers one mapping; the
 * SIGBUS handler, for a fault inside a registered mapping, maps private zero pages over the rest of it
 * (from the faulting page on) and marks the Guard `gone`, so the faulting access completes and every
 * later call of that pool handle fails cleanly (Core.locked and the fast path check `gone`).  A fault
 * anywhere else goes to the handler that was there before (faulthandler, or the default: the process
 * dies as it would have). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <signal.h>
#include <string.h>
#include <sys/mman.h>

#include "_fastpath.h"

struct guard_slot guards[MAX_GUARDS];
static struct sigaction previous_sigbus;
static volatile int have_previous_sigbus;

static void on_sigbus(int sig, siginfo_t *si, void *ctx) {
    char *a = (char *)si->si_addr;
    if (si->si_code > 0) { /* a fault (not a kill(2)): is it in one of ours? */
        for (int k = 0; k < MAX_GUARDS; k++) {
            char *b = guards[k].base;
            if (b == NULL || a < b || a >= b + guards[k].len) continue;
            char *page = (char *)((uintptr_t)a & ~(uintptr_t)4095);
            void *m = mmap(page, (size_t)(b + guards[k].len - page), PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (m != MAP_FAILED) {
                guards[k].gone = 1;
                return; /* the access runs again, on zeros */
            }
            break;
        }
    }
    /* Not ours: the previous disposition, and the access faults again under it. */
    if (have_previous_sigbus) {
        sigaction(SIGBUS, &previous_sigbus, NULL);
    } else {
        signal(SIGBUS, SIG_DFL);
    }
    if (si->si_code <= 0) raise(sig);
}

/* Ours on top, whoever installed theirs since (faulthandler.enable(), an engine's own). */
static int install_sigbus(void) {
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) < 0) return -1;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus) return 0;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&ours.sa_mask);
    previous_sigbus = now;
    have_previous_sigbus = 1;
    return sigaction(SIGBUS, &ours, NULL);
}

static int Guard_init(Guard *self, PyObject *args, PyObject *kwds) {
    PyObject *buffer;
    self->slot = -1;
    if (!PyArg_ParseTuple(args, "O", &buffer)) return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE) < 0) return -1;
    char *base = view.buf;
    size_t len = (size_t)view.len;
    PyBuffer_Release(&view); /* the caller keeps the mapping, and closes the Guard before unmapping it */
    if (install_sigbus() < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    for (int k = 0; k < MAX_GUARDS; k++) {
        char *expected = NULL;
        if (guards[k].base != NULL) continue;
        guards[k].len = len;
        guards[k].gone = 0;
        if (__atomic_compare_exchange_n(&guards[k].base, &expected, base, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            self->slot = k;
            return 0;
        }
    }
    return 0; /* more mappings than slots: this one goes unguarded */
}

static void guard_close(Guard *self) {
    if (self->slot >= 0) {
        __atomic_store_n(&guards[self->slot].base, NULL, __ATOMIC_SEQ_CST);
        self->slot = -1;
    }
}

static PyObject *Guard_close(Guard *self, PyObject *unused) {
    guard_close(self);
    Py_RETURN_NONE;
}

static PyObject *Guard_gone(Guard *self, void *unused) {
    return PyBool_FromLong(self->slot >= 0 && guards[self->slot].gone);
}

static PyObject *Guard_guarded(Guard *self, void *unused) { return PyBool_FromLong(self->slot >= 0); }

static void Guard_dealloc(Guard *self) {
    guard_close(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Guard_methods[] = {
    {"close", (PyCFunction)Guard_close, METH_NOARGS, "stop guarding (before the mapping is unmapped)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Guard_getset[] = {
    {"gone", (getter)Guard_gone, NULL, "a SIGBUS in the mapping was met: its bytes are gone for this process", NULL},
    {"guarded", (getter)Guard_guarded, NULL, "the mapping is registered with the SIGBUS handler", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject GuardType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cortex_cache._fastpath.Guard",
    .tp_basicsize = sizeof(Guard),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A mapping fenced against SIGBUS (see _fastpath_guard.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Guard_init,
    .tp_dealloc = (destructor)Guard_dealloc,
    .tp_methods = Guard_methods,
    .tp_getset = Guard_getset,
};
