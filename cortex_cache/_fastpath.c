/* The hot read paths of a pool in C (docs/internals.md, "The fast path").
 *
 * One `Fast` object per attached Core.  It takes the same OFD lock and follows
 * the same dirty-mark protocol as core.py (docs/design.md, "Invariants"), over
 * the same segment layout, so processes using it and processes on the pure
 * Python path share pools freely.  It does only the common case -- a lookup,
 * a hit counted, a copy or a pin -- and answers SLOW whenever anything else is
 * needed (a dirty mark to repair, an expired entry, a busy lock to wait for,
 * a full pin table, a buffer too small): the caller then runs the Python path,
 * which handles every case.  SLOW is always answered before anything changed.
 *
 * Values larger than `copy_in_lock` are copied outside the lock without a pin,
 * seqlock style: the entry's state and insert_seq are read under the lock,
 * the bytes copied without it, then state and insert_seq read again; a value
 * whose slot was freed, reused or overwritten meanwhile fails that check and
 * is read again.  Every writer changes one of the two before it changes the
 * bytes (a slot is freed before its blocks are reused; an in-place overwrite
 * clears insert_seq first), and x86-64's store order makes that visible in
 * the same order.  core.py enables the seqlock copy only on x86-64.
 *
 * Layout knowledge (offsets, widths) comes from Python (layout.py) at
 * construction; nothing here hard-codes a field offset.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <time.h>

/* xxh3_64 (third_party/xxhash, vendored), for copy_hash: the baseline build here, the AVX2 one in
 * _copyhash_avx2.c; PyInit picks.  Both give the xxhash package's xxh3_64, bit for bit. */
#define XXH_INLINE_ALL
#include "xxhash.h"
#define COPY_HASH_NAME cortex_copy_hash_base
#include "_copyhash.h"
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
uint64_t cortex_copy_hash_avx2(const struct copy_piece *pieces, size_t n, const void *head, size_t head_len);
#define HAVE_AVX2_BUILD 1
#endif
/* Values this small are copied with the GIL held: letting it go and taking it back costs more. */
#define COPY_HASH_GIL_FREE (16 * 1024)
typedef uint64_t (*copy_hash_fn)(const struct copy_piece *, size_t, const void *, size_t);
static copy_hash_fn copy_hash_impl = cortex_copy_hash_base;
static const char *copy_hash_isa = "baseline";

#define FREE 0
#define SEALED 2
#define ZOMBIE 3
#define KEY_CELL 32
#define SPIN 20        /* non-blocking lock attempts before answering SLOW */
#define SEQ_RETRIES 3  /* seqlock copies tried before answering SLOW */
/* A load from the segment that the compiler may not repeat: a field another process may change is loaded
 * once into a local and only the local checked and used (find()). */
#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)

enum { POL_LRU, POL_LFU, POL_FIFO, POL_PRIORITY, POL_TTL, POL_SIZE };
/* The queue policies (queues.py), by what a hit does: count the read (s3fifo, auto), or move the entry
 * from queue 0 to queue 1 (arc). */
enum { Q_NONE, Q_COUNT_READS, Q_PROMOTE };
/* ... and how a ghost hit moves queue 0's target (QueuePolicy.adapt): not, ARC's p, auto's share. */
enum { ADAPT_NONE, ADAPT_ARC, ADAPT_AUTO };

/* A ghost ring (queues.Ghosts): places of key hashes chained by hash, and its live count in the header. */
typedef struct {
    uint64_t *hash;
    int32_t *next, *bkt;
    uint64_t n, mask;
    uint64_t *live, *head, *tail;
    uint64_t factor; /* the window: factor x the entries */
} GhostRing;

static PyObject *SLOW;  /* the module's sentinel */

typedef struct {
    PyObject_HEAD
    Py_buffer buf;
    int have_buf;
    int closing;          /* close() was called while calls were in flight: the last one releases */
    Py_ssize_t inflight;  /* calls running (they may let the GIL go while copying) */
    char *base;
    int fd;
    struct flock lk, unlk;
    PyObject *thread_acquire, *thread_release; /* a threading.Lock's methods (multi-threaded handles) */
    PyObject *on_score_change;                 /* VictimCache.on_score_change (non-monotone policies) */
    PyObject *on_unpin;                        /* VictimCache.on_unpin */
    PyObject *free_entry;                      /* Core's free of a slot (a zombie's last unpin) */
    PyObject *late_unpin;                      /* unpin(pin, slot) for a Pin whose last user went */
    int guard; /* this mapping's Guard slot (guards[]), -1 none */
    int policy, monotone, seqlock, verify; /* verify: check each value copied out against its checksum */
    uint64_t bs, n_blocks, n_slots, mask, n_pins, data_off, keys_off, n_kcells, copy_in_lock;
    uint32_t pid;
    uint64_t pstart, pin_hint;
    /* header words */
    volatile uint32_t *dirty, *cand_valid;
    uint64_t *seq, *hits, *misses, *ops, *lfu_epoch, *lfu_period, *cand_max_secondary;
    double *cand_max_primary, *cand_next_expiry;
    /* slot columns */
    volatile uint32_t *state;
    uint32_t *pins, *klen;
    int32_t *next, *buckets;
    uint64_t *khash, *vlen, *first, *nblk, *cks, *aseq, *acount, *lfuep, *kcell;
    volatile uint64_t *iseq;
    double *lastacc, *expiry;
    int64_t *prio;
    /* pin records: u32 pid, i32 slot, u64 start; pin_size bytes each */
    char *pinrec;
    uint64_t pin_size, pin_off_pid, pin_off_slot, pin_off_start;
    /* the write path (_fastpath_put.h): allocation words and maps, the columns only a put writes */
    int64_t *free_slot;
    uint64_t *alloc_hint, *used_blocks, *key_hint, *used_kcells, *n_entries, *puts, *gone_seq;
    uint8_t *bmap, *kmap;
    uint32_t *flags_col, *opid;
    uint64_t *ostart;
    double *created;
    uint64_t put_in_lock;      /* values up to this size are put in one lock hold (core.COPY_IN_LOCK) */
    PyObject *reserve_hook;    /* Core.reserve_or_corrupt: a reservation C leaves to Python, lock held */
    PyObject *evict_hook;      /* Core.evict_or_corrupt: evict one victim by policy, lock held */
    PyObject *err_base, *err_corrupt; /* CortexCacheError, SegmentCorrupt */
    /* queue policies (queues.py): the queue columns, the header's two queue counts, target and clock,
     * the second victim list's next expiry, the two ghost rings */
    int qkind, qadapt;
    uint8_t *queue, *qfreq;
    uint64_t *qseq, *qcount, *qclock;
    double *qtarget, *cand1_next_expiry;
    GhostRing ghost[2];
    /* auto's regime and its two rates (queues.QueueVictims._auto_admit) */
    uint32_t *qregime;
    double *qghost_rate, *qhit_rate;
    uint64_t *qhits_seen;
} Fast;


/* ------------------------------------------------------------------ Guard: a mapping fenced against SIGBUS */

/* Another process that can write a pool's segment can truncate it (ftruncate), and a pool made with
 * --no-reserve faults when /dev/shm fills: either way the next access to a page past the end raises SIGBUS,
 * which kills the process -- an engine, for another user's mistake.  A Guard registers one mapping; the
 * SIGBUS handler, for a fault inside a registered mapping, maps private zero pages over the rest of it
 * (from the faulting page on) and marks the Guard `gone`, so the faulting access completes and every
 * later call of that pool handle fails cleanly (Core.locked and the fast path check `gone`).  A fault
 * anywhere else goes to the handler that was there before (faulthandler, or the default: the process
 * dies as it would have). */
#define MAX_GUARDS 4096

struct guard_slot {
    char *volatile base; /* NULL: free */
    size_t len;
    volatile int gone;
};
static struct guard_slot guards[MAX_GUARDS];
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

typedef struct {
    PyObject_HEAD
    int slot; /* index into guards, -1 none */
} Guard;

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

static PyTypeObject GuardType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cortex_cache._fastpath.Guard",
    .tp_basicsize = sizeof(Guard),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A mapping fenced against SIGBUS (see the module source).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Guard_init,
    .tp_dealloc = (destructor)Guard_dealloc,
    .tp_methods = Guard_methods,
    .tp_getset = Guard_getset,
};

static inline int guard_gone(int slot) { return slot >= 0 && guards[slot].gone; }

/* ------------------------------------------------------------------ construction */

static int get_u64(PyObject *spec, const char *name, uint64_t *out) {
    PyObject *v = PyDict_GetItemString(spec, name);
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "fast path spec lacks %s", name);
        return -1;
    }
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = x;
    return 0;
}

static PyObject *get_obj(PyObject *spec, const char *name) {
    PyObject *v = PyDict_GetItemString(spec, name);
    if (v == NULL || v == Py_None) return NULL;
    Py_INCREF(v);
    return v;
}

static int Fast_init(Fast *self, PyObject *args, PyObject *kwds) {
    PyObject *buffer, *spec;
    int fd;
    if (!PyArg_ParseTuple(args, "OiO!", &buffer, &fd, &PyDict_Type, &spec)) return -1;
    if (self->have_buf) {
        PyErr_SetString(PyExc_RuntimeError, "Fast is already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &self->buf, PyBUF_WRITABLE) < 0) return -1;
    self->have_buf = 1;
    self->base = (char *)self->buf.buf;
    self->fd = fd;
    uint64_t size = (uint64_t)self->buf.len;

    uint64_t lock_byte, policy, monotone, seqlock, verify, pid, n_buckets;
    uint64_t o_dirty, o_cand_valid, o_seq, o_hits, o_misses, o_ops, o_lfu_epoch, o_lfu_period;
    uint64_t o_cmax_p, o_cmax_s, o_cnext, o_buckets, o_pins_region;
    uint64_t c_state, c_pins, c_klen, c_next, c_khash, c_vlen, c_first, c_nblk, c_cks, c_lastacc;
    uint64_t c_expiry, c_iseq, c_aseq, c_acount, c_lfuep, c_prio, c_kcell;
    uint64_t o_free_slot, o_alloc_hint, o_used_blocks, o_key_hint, o_used_kcells, o_n_entries, o_puts, o_gone_seq;
    uint64_t o_bmap, o_kmap, c_flags, c_opid, c_ostart, c_created;
    struct { const char *name; uint64_t *out; } fields[] = {
        {"lock_byte", &lock_byte}, {"policy", &policy}, {"monotone", &monotone}, {"seqlock", &seqlock},
        {"verify", &verify},
        {"pid", &pid}, {"start", &self->pstart}, {"block_size", &self->bs}, {"n_blocks", &self->n_blocks},
        {"n_slots", &self->n_slots}, {"n_buckets", &n_buckets}, {"n_pins", &self->n_pins},
        {"data_off", &self->data_off}, {"keys_off", &self->keys_off}, {"n_kcells", &self->n_kcells},
        {"copy_in_lock", &self->copy_in_lock},
        {"h_dirty", &o_dirty}, {"h_cand_valid", &o_cand_valid}, {"h_seq", &o_seq}, {"h_hits", &o_hits},
        {"h_misses", &o_misses}, {"h_ops", &o_ops}, {"h_lfu_epoch", &o_lfu_epoch},
        {"h_lfu_period", &o_lfu_period}, {"h_cand_max_primary", &o_cmax_p},
        {"h_cand_max_secondary", &o_cmax_s}, {"h_cand_next_expiry", &o_cnext},
        {"buckets_off", &o_buckets}, {"pins_off", &o_pins_region}, {"pin_size", &self->pin_size},
        {"pin_pid", &self->pin_off_pid}, {"pin_slot", &self->pin_off_slot}, {"pin_start", &self->pin_off_start},
        {"state", &c_state}, {"pins", &c_pins}, {"key_len", &c_klen}, {"next", &c_next},
        {"key_hash", &c_khash}, {"value_len", &c_vlen}, {"first_block", &c_first}, {"n_blocks_col", &c_nblk},
        {"checksum", &c_cks}, {"last_access", &c_lastacc}, {"expiry", &c_expiry}, {"insert_seq", &c_iseq},
        {"access_seq", &c_aseq}, {"access_count", &c_acount}, {"lfu_epoch_col", &c_lfuep},
        {"priority", &c_prio}, {"key_cell", &c_kcell},
        {"h_free_slot", &o_free_slot}, {"h_alloc_hint", &o_alloc_hint}, {"h_used_blocks", &o_used_blocks},
        {"h_key_hint", &o_key_hint}, {"h_used_kcells", &o_used_kcells}, {"h_n_entries", &o_n_entries},
        {"h_puts", &o_puts}, {"h_gone_seq", &o_gone_seq}, {"blockmap_off", &o_bmap}, {"keymap_off", &o_kmap},
        {"flags", &c_flags}, {"owner_pid", &c_opid}, {"owner_start", &c_ostart}, {"created", &c_created},
        {"put_in_lock", &self->put_in_lock},
    };
    uint64_t qkind = 0, qadapt = 0, c_queue = 0, c_qfreq = 0, c_qseq = 0, o_qcount = 0, o_cnext1 = 0;
    uint64_t o_qtarget = 0, o_qclock = 0, g_n[2] = {0, 0}, g_hash[2] = {0, 0}, g_next[2] = {0, 0};
    uint64_t g_bkt[2] = {0, 0}, g_nb[2] = {0, 0}, g_live[2] = {0, 0}, g_head[2] = {0, 0}, g_tail[2] = {0, 0};
    uint64_t g_factor[2] = {0, 0}, o_qregime = 0, o_qgrate = 0, o_qhrate = 0, o_qhseen = 0;
    struct { const char *name; uint64_t *out; } qfields[] = {
        {"queue_col", &c_queue}, {"freq_col", &c_qfreq}, {"qseq_col", &c_qseq}, {"h_q_count0", &o_qcount},
        {"h_cand1_next_expiry", &o_cnext1}, {"h_q_target", &o_qtarget}, {"h_q_seq", &o_qclock},
        {"adapt", &qadapt}, {"g0_n", &g_n[0]}, {"g0_hash", &g_hash[0]}, {"g0_next", &g_next[0]},
        {"g0_buckets", &g_bkt[0]}, {"g0_n_buckets", &g_nb[0]}, {"h_g0_live", &g_live[0]}, {"g1_n", &g_n[1]},
        {"g1_hash", &g_hash[1]}, {"g1_next", &g_next[1]}, {"g1_buckets", &g_bkt[1]}, {"g1_n_buckets", &g_nb[1]},
        {"h_g1_live", &g_live[1]}, {"h_g0_head", &g_head[0]}, {"h_g0_tail", &g_tail[0]}, {"h_g1_head", &g_head[1]},
        {"h_g1_tail", &g_tail[1]}, {"g0_factor", &g_factor[0]}, {"g1_factor", &g_factor[1]},
        {"h_q_regime", &o_qregime}, {"h_q_ghost_rate", &o_qgrate}, {"h_q_hit_rate", &o_qhrate},
        {"h_q_hits_seen", &o_qhseen},
    };
    if (PyDict_GetItemString(spec, "queues") != NULL) {
        if (get_u64(spec, "queues", &qkind) < 0) return -1;
        if (qkind > Q_PROMOTE || qadapt > ADAPT_AUTO) {
            PyErr_SetString(PyExc_ValueError, "fast path: bad queue kind");
            return -1;
        }
        for (size_t k = 0; qkind && k < sizeof(qfields) / sizeof(qfields[0]); k++)
            if (get_u64(spec, qfields[k].name, qfields[k].out) < 0) return -1;
    }
    for (size_t k = 0; k < sizeof(fields) / sizeof(fields[0]); k++)
        if (get_u64(spec, fields[k].name, fields[k].out) < 0) return -1;

    /* Everything this object will touch must lie inside the mapping. */
    uint64_t n = self->n_slots;
    struct { uint64_t off, len; } regions[] = {
        {o_dirty, 4}, {o_cand_valid, 4}, {o_seq, 8}, {o_hits, 8}, {o_misses, 8}, {o_ops, 8},
        {o_lfu_epoch, 8}, {o_lfu_period, 8}, {o_cmax_p, 8}, {o_cmax_s, 8}, {o_cnext, 8},
        {o_buckets, n_buckets * 4}, {o_pins_region, self->n_pins * self->pin_size},
        {c_state, n * 4}, {c_pins, n * 4}, {c_klen, n * 4}, {c_next, n * 4}, {c_khash, n * 8},
        {c_vlen, n * 8}, {c_first, n * 8}, {c_nblk, n * 8}, {c_cks, n * 8}, {c_lastacc, n * 8},
        {c_expiry, n * 8}, {c_iseq, n * 8}, {c_aseq, n * 8}, {c_acount, n * 8}, {c_lfuep, n * 8},
        {c_prio, n * 8}, {c_kcell, n * 8}, {self->keys_off, self->n_kcells * KEY_CELL},
        {self->data_off, self->n_blocks * self->bs},
        {o_free_slot, 8}, {o_alloc_hint, 8}, {o_used_blocks, 8}, {o_key_hint, 8}, {o_used_kcells, 8},
        {o_n_entries, 8}, {o_puts, 8}, {o_gone_seq, 8}, {o_bmap, self->n_blocks}, {o_kmap, self->n_kcells},
        {c_flags, n * 4}, {c_opid, n * 4}, {c_ostart, n * 8}, {c_created, n * 8},
    };
    for (size_t k = 0; k < sizeof(regions) / sizeof(regions[0]); k++) {
        if (regions[k].off > size || regions[k].len > size - regions[k].off || regions[k].off % 4) {
            PyErr_SetString(PyExc_ValueError, "fast path: a region lies outside the segment");
            return -1;
        }
    }
    if (qkind) {
        struct { uint64_t off, len; } qregions[] = {
            {c_queue, n}, {c_qfreq, n}, {c_qseq, n * 8}, {o_qcount, 16}, {o_cnext1, 8}, {o_qtarget, 8},
            {o_qclock, 8}, {g_live[0], 8}, {g_live[1], 8}, {g_head[0], 8}, {g_head[1], 8}, {g_tail[0], 8},
            {g_tail[1], 8}, {o_qregime, 4}, {o_qgrate, 8}, {o_qhrate, 8}, {o_qhseen, 8},
            {g_hash[0], g_n[0] * 8}, {g_next[0], g_n[0] * 4}, {g_bkt[0], g_nb[0] * 4},
            {g_hash[1], g_n[1] * 8}, {g_next[1], g_n[1] * 4}, {g_bkt[1], g_nb[1] * 4},
        };
        for (size_t k = 0; k < sizeof(qregions) / sizeof(qregions[0]); k++) {
            if (qregions[k].off > size || qregions[k].len > size - qregions[k].off || qregions[k].off == 0) {
                PyErr_SetString(PyExc_ValueError, "fast path: a queue region lies outside the segment");
                return -1;
            }
        }
        for (int r = 0; r < 2; r++) {
            if (g_n[r] && (g_nb[r] < g_n[r] || (g_nb[r] & (g_nb[r] - 1)) || g_n[r] >= (1ULL << 31))) {
                PyErr_SetString(PyExc_ValueError, "fast path: bad ghost ring sizes");
                return -1;
            }
        }
    }
    if (n_buckets == 0 || (n_buckets & (n_buckets - 1)) || self->pin_size < 16 || self->n_pins == 0) {
        PyErr_SetString(PyExc_ValueError, "fast path: bad table sizes");
        return -1;
    }
    self->mask = n_buckets - 1;
    self->policy = (int)policy;
    self->monotone = (int)monotone;
    self->seqlock = (int)seqlock;
    self->verify = (int)verify;
    self->pid = (uint32_t)pid;
    self->pin_hint = 0;
    char *b = self->base;
    self->dirty = (volatile uint32_t *)(b + o_dirty);
    self->cand_valid = (volatile uint32_t *)(b + o_cand_valid);
    self->seq = (uint64_t *)(b + o_seq);
    self->hits = (uint64_t *)(b + o_hits);
    self->misses = (uint64_t *)(b + o_misses);
    self->ops = (uint64_t *)(b + o_ops);
    self->lfu_epoch = (uint64_t *)(b + o_lfu_epoch);
    self->lfu_period = (uint64_t *)(b + o_lfu_period);
    self->cand_max_primary = (double *)(b + o_cmax_p);
    self->cand_max_secondary = (uint64_t *)(b + o_cmax_s);
    self->cand_next_expiry = (double *)(b + o_cnext);
    self->buckets = (int32_t *)(b + o_buckets);
    self->pinrec = b + o_pins_region;
    self->state = (volatile uint32_t *)(b + c_state);
    self->pins = (uint32_t *)(b + c_pins);
    self->klen = (uint32_t *)(b + c_klen);
    self->next = (int32_t *)(b + c_next);
    self->khash = (uint64_t *)(b + c_khash);
    self->vlen = (uint64_t *)(b + c_vlen);
    self->first = (uint64_t *)(b + c_first);
    self->nblk = (uint64_t *)(b + c_nblk);
    self->cks = (uint64_t *)(b + c_cks);
    self->lastacc = (double *)(b + c_lastacc);
    self->expiry = (double *)(b + c_expiry);
    self->iseq = (volatile uint64_t *)(b + c_iseq);
    self->aseq = (uint64_t *)(b + c_aseq);
    self->acount = (uint64_t *)(b + c_acount);
    self->lfuep = (uint64_t *)(b + c_lfuep);
    self->prio = (int64_t *)(b + c_prio);
    self->kcell = (uint64_t *)(b + c_kcell);
    self->free_slot = (int64_t *)(b + o_free_slot);
    self->alloc_hint = (uint64_t *)(b + o_alloc_hint);
    self->used_blocks = (uint64_t *)(b + o_used_blocks);
    self->key_hint = (uint64_t *)(b + o_key_hint);
    self->used_kcells = (uint64_t *)(b + o_used_kcells);
    self->n_entries = (uint64_t *)(b + o_n_entries);
    self->puts = (uint64_t *)(b + o_puts);
    self->gone_seq = (uint64_t *)(b + o_gone_seq);
    self->bmap = (uint8_t *)(b + o_bmap);
    self->kmap = (uint8_t *)(b + o_kmap);
    self->flags_col = (uint32_t *)(b + c_flags);
    self->opid = (uint32_t *)(b + c_opid);
    self->ostart = (uint64_t *)(b + c_ostart);
    self->created = (double *)(b + c_created);
    self->qkind = (int)qkind;
    self->qadapt = (int)qadapt;
    if (qkind) {
        self->queue = (uint8_t *)(b + c_queue);
        self->qfreq = (uint8_t *)(b + c_qfreq);
        self->qseq = (uint64_t *)(b + c_qseq);
        self->qcount = (uint64_t *)(b + o_qcount);
        self->qclock = (uint64_t *)(b + o_qclock);
        self->qtarget = (double *)(b + o_qtarget);
        self->cand1_next_expiry = (double *)(b + o_cnext1);
        self->qregime = (uint32_t *)(b + o_qregime);
        self->qghost_rate = (double *)(b + o_qgrate);
        self->qhit_rate = (double *)(b + o_qhrate);
        self->qhits_seen = (uint64_t *)(b + o_qhseen);
        for (int r = 0; r < 2; r++) {
            GhostRing *g = &self->ghost[r];
            g->n = g_n[r];
            g->live = (uint64_t *)(b + g_live[r]);
            g->head = (uint64_t *)(b + g_head[r]);
            g->tail = (uint64_t *)(b + g_tail[r]);
            g->factor = g_factor[r];
            if (g->n) {
                g->hash = (uint64_t *)(b + g_hash[r]);
                g->next = (int32_t *)(b + g_next[r]);
                g->bkt = (int32_t *)(b + g_bkt[r]);
                g->mask = g_nb[r] - 1;
            }
        }
    }

    struct flock lk = {0};
    lk.l_type = F_WRLCK;
    lk.l_whence = SEEK_SET;
    lk.l_start = (off_t)lock_byte;
    lk.l_len = 1;
    self->lk = lk;
    lk.l_type = F_UNLCK;
    self->unlk = lk;

    self->guard = -1;
    PyObject *g = PyDict_GetItemString(spec, "guard");
    if (g != NULL && g != Py_None) {
        if (!Py_IS_TYPE(g, &GuardType)) {
            PyErr_SetString(PyExc_TypeError, "fast path spec: guard must be a Guard");
            return -1;
        }
        self->guard = ((Guard *)g)->slot;
    }
    PyObject *tl = PyDict_GetItemString(spec, "thread_lock");
    if (tl != NULL && tl != Py_None) {
        self->thread_acquire = PyObject_GetAttrString(tl, "acquire");
        self->thread_release = PyObject_GetAttrString(tl, "release");
        if (!self->thread_acquire || !self->thread_release) return -1;
    }
    self->on_score_change = get_obj(spec, "on_score_change");
    self->on_unpin = get_obj(spec, "on_unpin");
    self->free_entry = get_obj(spec, "free_entry");
    self->late_unpin = get_obj(spec, "late_unpin");
    self->reserve_hook = get_obj(spec, "reserve_hook");
    self->evict_hook = get_obj(spec, "evict_hook");
    self->err_base = get_obj(spec, "error");
    self->err_corrupt = get_obj(spec, "corrupt_error");
    if (!self->on_unpin || !self->free_entry || !self->late_unpin || !self->reserve_hook || !self->evict_hook || !self->err_base ||
        !self->err_corrupt) {
        PyErr_SetString(PyExc_ValueError,
                        "fast path spec needs on_unpin, free_entry, late_unpin, reserve_hook, evict_hook, error and corrupt_error");
        return -1;
    }
    return 0;
}

static void Fast_release_all(Fast *self) {
    Py_CLEAR(self->thread_acquire);
    Py_CLEAR(self->thread_release);
    Py_CLEAR(self->on_score_change);
    Py_CLEAR(self->on_unpin);
    Py_CLEAR(self->free_entry);
    Py_CLEAR(self->late_unpin);
    Py_CLEAR(self->reserve_hook);
    Py_CLEAR(self->evict_hook);
    Py_CLEAR(self->err_base);
    Py_CLEAR(self->err_corrupt);
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

static int Fast_traverse(Fast *self, visitproc visit, void *arg) {
    Py_VISIT(self->thread_acquire);
    Py_VISIT(self->thread_release);
    Py_VISIT(self->on_score_change);
    Py_VISIT(self->on_unpin);
    Py_VISIT(self->free_entry);
    Py_VISIT(self->late_unpin);
    Py_VISIT(self->reserve_hook);
    Py_VISIT(self->evict_hook);
    Py_VISIT(self->err_base);
    Py_VISIT(self->err_corrupt);
    return 0;
}

static int Fast_clear(Fast *self) {
    Py_CLEAR(self->thread_acquire);
    Py_CLEAR(self->thread_release);
    Py_CLEAR(self->on_score_change);
    Py_CLEAR(self->on_unpin);
    Py_CLEAR(self->free_entry);
    Py_CLEAR(self->late_unpin);
    Py_CLEAR(self->reserve_hook);
    Py_CLEAR(self->evict_hook);
    Py_CLEAR(self->err_base);
    Py_CLEAR(self->err_corrupt);
    return 0;
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

/* ------------------------------------------------------------------ lock */

/* 1: held, with the dirty mark set; 0: not taken (busy, or a dirty mark to repair: the caller's Python
 * path waits or repairs); -1: error, exception set. */
static int take(Fast *self) {
    if (guard_gone(self->guard)) return 0; /* the Python path raises */
    if (self->thread_acquire) {
        PyObject *r = PyObject_CallOneArg(self->thread_acquire, Py_False);
        if (r == NULL) return -1;
        int ok = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (ok <= 0) return ok;
    }
    for (int k = 0; k < SPIN; k++) {
        if (fcntl(self->fd, F_OFD_SETLK, &self->lk) == 0) {
            if (*self->dirty) { /* a holder died mid-change: Python repairs */
                fcntl(self->fd, F_OFD_SETLK, &self->unlk);
                break;
            }
            *self->dirty = 1;
            return 1;
        }
        if (errno != EAGAIN && errno != EACCES && errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            goto fail;
        }
    }
    if (self->thread_release) {
        PyObject *r = PyObject_CallNoArgs(self->thread_release);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
fail:
    if (self->thread_release) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyObject *r = PyObject_CallNoArgs(self->thread_release);
        Py_XDECREF(r);
        PyErr_Restore(t, v, tb);
    }
    return -1;
}

/* Let the lock go; `clean` clears the dirty mark (leave it after an error mid-change: the next holder
 * repairs).  Keeps any pending exception. */
static void give(Fast *self, int clean) {
    if (clean) *self->dirty = 0;
    fcntl(self->fd, F_OFD_SETLK, &self->unlk);
    if (self->thread_release) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyObject *r = PyObject_CallNoArgs(self->thread_release);
        Py_XDECREF(r);
        if (t) PyErr_Restore(t, v, tb);
    }
}

/* ------------------------------------------------------------------ entries (lock held) */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* What a lookup found: every field the read uses, each loaded once from the segment and checked, for the
 * copy (inside or outside the lock) and the Pin.  Nothing here is read from the segment again. */
typedef struct {
    int64_t slot;
    uint64_t off, len, iseq, cks;
} Found;

/* Key kb's sealed entry into *out: 1 found, 0 none, -1 if the metadata looks damaged (the Python path
 * reports and repairs).  Another process that can write the segment may change any field at any moment,
 * even while we hold the lock (docs/reliability.md, "Trust model"): each is loaded once (LOAD) into a
 * local, checked, and only that local used, so a field changed between the check and its use cannot
 * send a copy outside the data region or the caller's buffer. */
static int find(Fast *self, const char *kb, Py_ssize_t klen, uint64_t kh, Found *out) {
    int32_t i = LOAD(self->buckets[kh & self->mask]);
    uint64_t steps = 0;
    while (i >= 0) {
        if ((uint64_t)i >= self->n_slots) return -1;
        if (LOAD(self->khash[i]) == kh && LOAD(self->klen[i]) == (uint64_t)klen) {
            uint64_t kc = LOAD(self->kcell[i]);
            if (kc > self->n_kcells || ((uint64_t)klen + KEY_CELL - 1) / KEY_CELL > self->n_kcells - kc) return -1;
            if (memcmp(self->base + self->keys_off + kc * KEY_CELL, kb, (size_t)klen) == 0) {
                uint64_t f = LOAD(self->first[i]), nb = LOAD(self->nblk[i]), len = LOAD(self->vlen[i]);
                /* Inside the data region, and filling exactly its blocks (repair.py's rule). */
                if (f > self->n_blocks || nb > self->n_blocks - f || len > nb * self->bs ||
                    (nb > 0 && len <= (nb - 1) * self->bs))
                    return -1;
                out->slot = i;
                out->off = self->data_off + f * self->bs;
                out->len = len;
                out->iseq = LOAD(self->iseq[i]);
                out->cks = LOAD(self->cks[i]);
                return 1;
            }
        }
        i = LOAD(self->next[i]);
        if (++steps > self->n_slots) return -1;
    }
    return 0;
}

static inline int expired(Fast *self, int64_t i, double t) {
    double e = self->expiry[i];
    return e > 0 && e <= t;
}

/* eviction.py's primary_one for this pool's policy. */
static double primary(Fast *self, int64_t i) {
    switch (self->policy) {
    case POL_FIFO: return (double)self->iseq[i];
    case POL_LFU: {
        uint64_t age = *self->lfu_epoch - self->lfuep[i];
        return (double)(self->acount[i] >> (age < 63 ? age : 63));
    }
    case POL_PRIORITY: return (double)self->prio[i];
    case POL_TTL: return self->expiry[i] > 0 ? self->expiry[i] : INFINITY;
    case POL_SIZE: return -(double)self->vlen[i];
    default: return 0.0;
    }
}

/* Core.touch: count a hit on entry i.  -1 (exception set, metadata mid-change) if the victim list's
 * Python hook failed. */
static int touch(Fast *self, int64_t i, double t) {
    uint64_t seq = *self->seq + 1;
    *self->seq = seq;
    self->aseq[i] = seq;
    self->lastacc[i] = t;
    uint64_t ops = *self->ops + 1;
    *self->ops = ops;
    uint64_t period = *self->lfu_period;
    if (period && ops % period == 0) *self->lfu_epoch += 1;
    uint64_t epoch = *self->lfu_epoch;
    uint64_t age = epoch - self->lfuep[i];
    self->acount[i] = (self->acount[i] >> (age < 63 ? age : 63)) + 1;
    self->lfuep[i] = epoch;
    *self->hits += 1;
    if (self->qkind == Q_COUNT_READS) { /* QueueVictims.hit */
        if (self->qfreq[i] < 3) self->qfreq[i] += 1;
    } else if (self->qkind == Q_PROMOTE && self->queue[i] == 0) {
        self->queue[i] = 1;
        if (self->qcount[0]) self->qcount[0] -= 1;
        self->qcount[1] += 1;
        double e = self->expiry[i]; /* queue 1's list was filled without it (QueueVictims._move) */
        if (e > 0 && e < *self->cand1_next_expiry) *self->cand1_next_expiry = e;
    }
    /* VictimCache.on_score_change's fast exit, here; the rest in Python. */
    if (!self->monotone && *self->cand_valid && !(primary(self, i) > *self->cand_max_primary)) {
        PyObject *r = PyObject_CallFunction(self->on_score_change, "L", (long long)i);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
}

static inline uint32_t *pin_pid(Fast *self, uint64_t j) { return (uint32_t *)(self->pinrec + j * self->pin_size + self->pin_off_pid); }
static inline int32_t *pin_slot(Fast *self, uint64_t j) { return (int32_t *)(self->pinrec + j * self->pin_size + self->pin_off_slot); }
static inline uint64_t *pin_start(Fast *self, uint64_t j) { return (uint64_t *)(self->pinrec + j * self->pin_size + self->pin_off_start); }

/* Core.pin: a pin record for entry i, or -1 when none is free (Python reaps dead pins or says PoolBusy). */
static int64_t pin(Fast *self, int64_t i) {
    uint64_t j = self->pin_hint;
    if (j >= self->n_pins || *pin_pid(self, j) != 0) {
        uint64_t k;
        for (k = 0; k < self->n_pins; k++)
            if (*pin_pid(self, k) == 0) break;
        if (k == self->n_pins) return -1;
        j = k;
    }
    *pin_slot(self, j) = (int32_t)i;
    *pin_start(self, j) = self->pstart;
    *pin_pid(self, j) = self->pid;
    self->pins[i] += 1;
    self->pin_hint = (j + 1) % self->n_pins;
    return (int64_t)j;
}

/* Core.unpin.  -1 with an exception set if a Python hook failed. */
static int unpin(Fast *self, uint64_t j, int64_t i) {
    if (j >= self->n_pins || i < 0 || (uint64_t)i >= self->n_slots) return 0;
    if (*pin_pid(self, j) != self->pid || *pin_slot(self, j) != i) return 0; /* reclaimed by a repair */
    *pin_pid(self, j) = 0;
    *pin_slot(self, j) = -1;
    uint32_t p = self->pins[i];
    if (p > 0) {
        p -= 1;
        self->pins[i] = p;
    }
    if (p != 0) return 0;
    PyObject *hook = NULL;
    uint32_t st = LOAD(self->state[i]);
    if (st == ZOMBIE) {
        hook = self->free_entry;
    } else if (st == SEALED && self->qkind) {
        hook = self->on_unpin; /* QueueVictims.on_unpin: the list of the entry's queue decides */
    } else if (st == SEALED && *self->cand_valid) {
        /* VictimCache.on_unpin: nothing to do when the entry scores above the last listed victim
         * (it cannot belong in the list) and has not expired; then only its expiry matters. */
        double t = now(), p1 = primary(self, i), mp = *self->cand_max_primary;
        if (!expired(self, i, t) && (p1 > mp || (p1 == mp && self->aseq[i] >= *self->cand_max_secondary))) {
            double e = self->expiry[i];
            if (e > 0 && e < *self->cand_next_expiry) *self->cand_next_expiry = e;
            return 0;
        }
        hook = self->on_unpin;
    }
    if (hook == NULL) return 0;
    PyObject *r = PyObject_CallFunction(hook, "L", (long long)i);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* ------------------------------------------------------------------ Pin: a pinned value's bytes */

/* A pin on one entry that exports its value's bytes, read-only (an EntryView's memoryview is made from
 * it).  Whatever is made from that memoryview (slices, numpy arrays, tensors) keeps the Pin exported,
 * so an owner's release while such an object lives only marks the Pin: its last export's end unpins
 * (the `gpu.entry_tensor` rule, docs/python-api.md).  A Pin also holds its own export of the mapping,
 * so the pool's close() cannot unmap the bytes under a user. */
enum { PIN_HELD, PIN_DEFERRED, PIN_DONE };

typedef struct {
    PyObject_HEAD
    PyObject *fast; /* the Fast it came from (its late_unpin hook) */
    Py_buffer map;  /* an export of the mapping */
    int have_map, state;
    Py_ssize_t exports;
    uint64_t pin, off, len, checksum;
    int64_t slot;
} Pin;

static PyTypeObject PinType;

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

static PyTypeObject PinType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cortex_cache._fastpath.Pin",
    .tp_basicsize = sizeof(Pin),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A pinned entry exporting its value's bytes (see the module source).",
    .tp_dealloc = (destructor)Pin_dealloc,
    .tp_traverse = (traverseproc)Pin_traverse,
    .tp_as_buffer = &Pin_as_buffer,
    .tp_methods = Pin_methods,
    .tp_members = Pin_members,
};

static PyObject *new_pin(Fast *f, uint64_t j, int64_t slot, uint64_t off, uint64_t len, uint64_t cks) {
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

/* ------------------------------------------------------------------ reads */

/* Modes of a read: GET counts hits and misses; HITS counts hits, and a miss is SLOW (a tier below looks);
 * QUIET counts nothing and moves nothing in the eviction order (Pool.peek). */
enum { MODE_GET = 0, MODE_HITS = 1, MODE_QUIET = 2 };

/* Look key kb up, lock held: 1 found (counted and touched per mode, when `touch_now`), 0 absent (a miss
 * counted per mode), 2 SLOW (nothing changed), -1 error.  `room` < 0: no buffer limit.  `for_copy`: the
 * caller copies the value (without the seqlock, a large value is left to the Python path, which pins). */
static int lookup(Fast *self, const char *kb, Py_ssize_t klen, uint64_t kh, int mode, Py_ssize_t room, double t,
                  int touch_now, int for_copy, Found *out) {
    int rc = find(self, kb, klen, kh, out);
    if (rc < 0) return 2;
    if (rc == 1 && expired(self, out->slot, t)) {
        if (mode != MODE_QUIET) return 2; /* Python expires it and counts */
        rc = 0;
    }
    if (rc == 0) {
        if (mode == MODE_HITS) return 2;
        if (mode == MODE_GET) *self->misses += 1;
        return 0;
    }
    if (room >= 0 && (uint64_t)room < out->len) return 2; /* Python raises BufferTooSmall */
    if (for_copy && !self->seqlock && out->len > self->copy_in_lock) return 2;
    if (touch_now && mode != MODE_QUIET && touch(self, out->slot, t) < 0) return -1;
    return 1;
}

/* Is the entry still the one `f` found (the seqlock check after a copy outside the lock)? */
static inline int still(Fast *self, const Found *f) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return LOAD(self->state[f->slot]) == SEALED && LOAD(self->iseq[f->slot]) == f->iseq;
}

static void copy_out(char *dst, const char *src, uint64_t n) {
    if (n >= 65536) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, src, n);
        Py_END_ALLOW_THREADS
    } else {
        memcpy(dst, src, n);
    }
}

/* Does a value copied out match the checksum its entry records?  (Pool.open(verify_reads=True): a
 * slot whose fields point at other bytes, or bytes changed in place, is then refused, not returned.) */
static int matches(const char *p, uint64_t n, uint64_t cks) {
    uint64_t h;
    if (n >= 65536) {
        Py_BEGIN_ALLOW_THREADS
        h = XXH3_64bits(p, (size_t)n);
        Py_END_ALLOW_THREADS
    } else {
        h = XXH3_64bits(p, (size_t)n);
    }
    return h == cks;
}

static int parse_key(PyObject *kb, PyObject *kh, const char **p, Py_ssize_t *n, uint64_t *h) {
    if (!PyBytes_Check(kb)) {
        PyErr_SetString(PyExc_TypeError, "key must be bytes");
        return -1;
    }
    *p = PyBytes_AS_STRING(kb);
    *n = PyBytes_GET_SIZE(kb);
    *h = PyLong_AsUnsignedLongLong(kh);
    if (*h == (uint64_t)-1 && PyErr_Occurred()) return -1;
    return 0;
}

/* read(kb, kh, out, mode) -> bytes (out None) | int (bytes copied into out) | None (absent) | SLOW */
static PyObject *do_read(Fast *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "read(kb, kh, out, mode)");
        return NULL;
    }
    const char *kb;
    Py_ssize_t klen;
    uint64_t kh;
    if (parse_key(args[0], args[1], &kb, &klen, &kh) < 0) return NULL;
    int mode = (int)PyLong_AsLong(args[3]);
    if (mode == -1 && PyErr_Occurred()) return NULL;
    Py_buffer ob;
    int have_out = args[2] != Py_None;
    if (have_out && PyObject_GetBuffer(args[2], &ob, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *result = NULL;
    int counted = 0;
    for (int attempt = 0; attempt <= SEQ_RETRIES; attempt++) {
        int got = take(self);
        if (got <= 0) {
            result = got < 0 ? NULL : Py_NewRef(SLOW);
            break;
        }
        double t = now();
        Found f;
        /* A retry after a failed seqlock check has counted its hit already. */
        int rc = lookup(self, kb, klen, kh, counted ? MODE_QUIET : mode, have_out ? ob.len : -1, t, 1, 1, &f);
        if (rc != 1) {
            give(self, rc != -1);
            result = rc == -1 ? NULL : rc == 2 ? Py_NewRef(SLOW) : Py_NewRef(Py_None);
            break;
        }
        counted = 1;
        const char *src = self->base + f.off;
        /* A value that fails verification goes to the Python path, which refuses it (ValueCorrupt). */
        if (f.len <= self->copy_in_lock) {
            if (have_out) {
                memcpy(ob.buf, src, f.len);
                result = PyLong_FromUnsignedLongLong(f.len);
            } else {
                result = PyBytes_FromStringAndSize(src, (Py_ssize_t)f.len);
            }
            give(self, 1);
            if (result != NULL && (guard_gone(self->guard) || (self->verify &&
                !matches(have_out ? (const char *)ob.buf : PyBytes_AS_STRING(result), f.len, f.cks))))
                Py_SETREF(result, Py_NewRef(SLOW));
            break;
        }
        give(self, 1);
        if (have_out) {
            copy_out(ob.buf, src, f.len);
            if (guard_gone(self->guard)) { /* the copy met a truncated segment: the Python path raises */
                result = Py_NewRef(SLOW);
                break;
            }
            if (still(self, &f)) {
                result = !self->verify || matches(ob.buf, f.len, f.cks) ? PyLong_FromUnsignedLongLong(f.len)
                                                                       : Py_NewRef(SLOW);
                break;
            }
        } else {
            PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)f.len);
            if (b == NULL) break;
            copy_out(PyBytes_AS_STRING(b), src, f.len);
            if (guard_gone(self->guard)) {
                Py_DECREF(b);
                result = Py_NewRef(SLOW);
                break;
            }
            if (still(self, &f)) {
                if (self->verify && !matches(PyBytes_AS_STRING(b), f.len, f.cks)) {
                    Py_DECREF(b);
                    result = Py_NewRef(SLOW);
                } else {
                    result = b;
                }
                break;
            }
            Py_DECREF(b);
        }
        if (attempt == SEQ_RETRIES) result = Py_NewRef(SLOW);
    }
    if (have_out) PyBuffer_Release(&ob);
    return result;
}

/* read_many(keys: list[(kb, kh)], outs: list[buffer], mode) -> list of int | None | SLOW per key.
 * One lock hold for every lookup; copies outside it (seqlock-checked) or inside it for small values. */
static PyObject *do_read_many(Fast *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "read_many(keys: list, outs: list, mode)");
        return NULL;
    }
    PyObject *keys = args[0], *outs = args[1];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(outs) != n) {
        PyErr_SetString(PyExc_ValueError, "read_many: one buffer per key");
        return NULL;
    }
    int mode = (int)PyLong_AsLong(args[2]);
    if (mode == -1 && PyErr_Occurred()) return NULL;
    PyObject *result = PyList_New(n);
    if (result == NULL) return NULL;
    Py_buffer *bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    Found *found = PyMem_Calloc(n ? n : 1, sizeof(Found));
    char *status = PyMem_Calloc(n ? n : 1, 1); /* 0 done, 1 found: copy later, 2 copied: verify later */
    Py_ssize_t nbufs = 0;
    int ok = 0;
    if (!bufs || !found || !status) {
        PyErr_NoMemory();
        goto done;
    }
    for (; nbufs < n; nbufs++)
        if (PyObject_GetBuffer(PyList_GET_ITEM(outs, nbufs), &bufs[nbufs], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
    for (Py_ssize_t k = 0; k < n; k++) { /* parse every key before taking the lock */
        PyObject *pair = PyList_GET_ITEM(keys, k);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(pair, 0))) {
            PyErr_SetString(PyExc_TypeError, "read_many: keys are (bytes, int) pairs");
            goto done;
        }
    }
    int got = take(self);
    if (got < 0) goto done;
    if (got == 0) {
        for (Py_ssize_t k = 0; k < n; k++) PyList_SET_ITEM(result, k, Py_NewRef(SLOW));
        ok = 1;
        goto done;
    }
    double t = now();
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *pair = PyList_GET_ITEM(keys, k);
        const char *kb;
        Py_ssize_t klen;
        uint64_t kh;
        if (parse_key(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), &kb, &klen, &kh) < 0) {
            give(self, 0);
            goto done;
        }
        int rc = lookup(self, kb, klen, kh, mode, bufs[k].len, t, 1, 1, &found[k]);
        if (rc == -1) {
            give(self, 0);
            goto done;
        }
        if (rc == 1 && found[k].len <= self->copy_in_lock) {
            memcpy(bufs[k].buf, self->base + found[k].off, found[k].len);
            status[k] = self->verify ? 2 : 0; /* verified once the lock is let go */
            PyList_SET_ITEM(result, k, PyLong_FromUnsignedLongLong(found[k].len));
        } else if (rc == 1) {
            status[k] = 1;
        } else {
            PyList_SET_ITEM(result, k, Py_NewRef(rc == 2 ? SLOW : Py_None));
        }
    }
    give(self, 1);
    int gone = guard_gone(self->guard); /* an in-lock copy met a truncated segment */
    for (Py_ssize_t k = 0; k < n; k++) {
        if (gone && status[k] != 1 && PyLong_CheckExact(PyList_GET_ITEM(result, k))) status[k] = 3;
        if (status[k] == 3) { /* copied from a segment found gone: the Python path raises */
            PyObject *was = PyList_GET_ITEM(result, k);
            PyList_SET_ITEM(result, k, Py_NewRef(SLOW));
            Py_DECREF(was);
            continue;
        }
        if (status[k] != 1) {
            if (PyList_GET_ITEM(result, k) == NULL) goto done; /* PyLong_From... failed */
            if (status[k] == 2 && !matches(bufs[k].buf, found[k].len, found[k].cks)) {
                PyObject *was = PyList_GET_ITEM(result, k);
                PyList_SET_ITEM(result, k, Py_NewRef(SLOW));
                Py_DECREF(was);
            }
            continue;
        }
        copy_out(bufs[k].buf, self->base + found[k].off, found[k].len);
        /* A value changed under the copy (or failing verification): the Python path reads it again, pinned
         * (counting a second hit). */
        int ok_copy = !guard_gone(self->guard) && still(self, &found[k]) &&
                      (!self->verify || matches(bufs[k].buf, found[k].len, found[k].cks));
        PyList_SET_ITEM(result, k, ok_copy ? PyLong_FromUnsignedLongLong(found[k].len) : Py_NewRef(SLOW));
        if (PyList_GET_ITEM(result, k) == NULL) goto done;
    }
    ok = 1;
done:
    for (Py_ssize_t k = 0; k < nbufs; k++) PyBuffer_Release(&bufs[k]);
    PyMem_Free(bufs);
    PyMem_Free(found);
    PyMem_Free(status);
    if (!ok) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

/* pin_many(keys: list[(kb, kh)], mode) -> list of Pin | None | SLOW per
 * key, in one lock hold (the batched views).  None when the lock is busy (nothing done). */
static PyObject *do_pin_many(Fast *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "pin_many(keys: list, mode)");
        return NULL;
    }
    PyObject *keys = args[0];
    int mode = (int)PyLong_AsLong(args[1]);
    if (mode == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *pair = PyList_GET_ITEM(keys, k);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(pair, 0))) {
            PyErr_SetString(PyExc_TypeError, "pin_many: keys are (bytes, int) pairs");
            return NULL;
        }
    }
    PyObject *result = PyList_New(n);
    if (result == NULL) return NULL;
    int got = take(self);
    if (got <= 0) {
        Py_DECREF(result);
        if (got < 0) return NULL;
        Py_RETURN_NONE;
    }
    double t = now();
    Py_ssize_t k;
    for (k = 0; k < n; k++) {
        PyObject *pair = PyList_GET_ITEM(keys, k);
        const char *kb;
        Py_ssize_t klen;
        uint64_t kh;
        if (parse_key(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), &kb, &klen, &kh) < 0) break;
        Found f;
        /* Touch only once pinned: a key left to the Python path must be as it was. */
        int rc = lookup(self, kb, klen, kh, mode, -1, t, 0, 0, &f);
        if (rc == 1) {
            int64_t j = pin(self, f.slot);
            if (j < 0) {
                PyList_SET_ITEM(result, k, Py_NewRef(SLOW));
                continue;
            }
            if (mode != MODE_QUIET && touch(self, f.slot, t) < 0) {
                unpin(self, (uint64_t)j, f.slot);
                break;
            }
            PyObject *tup = new_pin(self, (uint64_t)j, f.slot, f.off, f.len, f.cks);
            if (tup == NULL) {
                unpin(self, (uint64_t)j, f.slot);
                break;
            }
            PyList_SET_ITEM(result, k, tup);
        } else if (rc == -1) {
            break;
        } else {
            PyList_SET_ITEM(result, k, Py_NewRef(rc == 2 ? SLOW : Py_None));
        }
    }
    if (k < n) { /* an error: undo this batch's pins, then raise */
        PyObject *t0, *v0, *tb0;
        PyErr_Fetch(&t0, &v0, &tb0);
        for (Py_ssize_t m = 0; m < k; m++) {
            PyObject *it = PyList_GET_ITEM(result, m);
            if (Py_IS_TYPE(it, &PinType)) {
                unpin(self, ((Pin *)it)->pin, ((Pin *)it)->slot);
                ((Pin *)it)->state = PIN_DONE;
            }
        }
        PyErr_Clear();
        PyErr_Restore(t0, v0, tb0);
        give(self, 0);
        for (Py_ssize_t m = k; m < n; m++) PyList_SET_ITEM(result, m, Py_NewRef(Py_None));
        Py_DECREF(result);
        return NULL;
    }
    give(self, 1);
    return result;
}

/* unpin_many(pins: list of Pin or (pin, slot)) -> True, or False when the lock is busy (nothing done). */
static PyObject *do_unpin_many(Fast *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "unpin_many(pins: list)");
        return NULL;
    }
    PyObject *pins = args[0];
    Py_ssize_t n = PyList_GET_SIZE(pins);
    uint64_t *js = PyMem_Malloc((n ? n : 1) * 2 * sizeof(uint64_t));
    if (js == NULL) return PyErr_NoMemory();
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *p = PyList_GET_ITEM(pins, k);
        if (Py_IS_TYPE(p, &PinType)) {
            js[2 * k] = ((Pin *)p)->pin;
            js[2 * k + 1] = (uint64_t)((Pin *)p)->slot;
            continue; /* marked done below, once unpinned */
        }
        PyObject *a = PySequence_GetItem(p, 0), *b = a ? PySequence_GetItem(p, 1) : NULL;
        if (b == NULL) {
            Py_XDECREF(a);
            PyMem_Free(js);
            return NULL;
        }
        js[2 * k] = PyLong_AsUnsignedLongLong(a);
        js[2 * k + 1] = PyLong_AsUnsignedLongLong(b);
        Py_DECREF(a);
        Py_DECREF(b);
        if (PyErr_Occurred()) {
            PyMem_Free(js);
            return NULL;
        }
    }
    int got = take(self);
    if (got <= 0) {
        PyMem_Free(js);
        if (got < 0) return NULL;
        Py_RETURN_FALSE;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *p = PyList_GET_ITEM(pins, k);
        if (Py_IS_TYPE(p, &PinType)) ((Pin *)p)->state = PIN_DONE;
        if (unpin(self, js[2 * k], (int64_t)js[2 * k + 1]) < 0) {
            /* A hook failed: the remaining pins go with this process (or the next repair). */
            PyMem_Free(js);
            give(self, 0);
            return NULL;
        }
    }
    PyMem_Free(js);
    give(self, 1);
    Py_RETURN_TRUE;
}

/* probe(kb, kh) -> (slot, insert_seq) of the key's live entry, or None; counts nothing.  With still(),
 * for tests: what a seqlock reader records under the lock, and its check after the copy. */
static PyObject *do_probe(Fast *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "probe(kb, kh)");
        return NULL;
    }
    const char *kb;
    Py_ssize_t klen;
    uint64_t kh;
    if (parse_key(args[0], args[1], &kb, &klen, &kh) < 0) return NULL;
    int got = take(self);
    if (got <= 0) return got < 0 ? NULL : Py_NewRef(SLOW);
    Found f;
    int rc = lookup(self, kb, klen, kh, MODE_QUIET, -1, now(), 0, 0, &f);
    give(self, 1);
    if (rc != 1) return Py_NewRef(rc == 2 ? SLOW : Py_None);
    return Py_BuildValue("(LK)", (long long)f.slot, (unsigned long long)f.iseq);
}

static PyObject *do_still(Fast *self, PyObject *const *args, Py_ssize_t nargs) {
    Found f = {0};
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "still(slot, insert_seq)");
        return NULL;
    }
    f.slot = PyLong_AsLongLong(args[0]);
    f.iseq = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (f.slot < 0 || (uint64_t)f.slot >= self->n_slots) {
        PyErr_SetString(PyExc_IndexError, "no such slot");
        return NULL;
    }
    return PyBool_FromLong(still(self, &f));
}

/* populate(off, len) -> bool: map [off, off+len) of the segment into this process's page tables
 * (MADV_POPULATE_WRITE, Linux >= 5.14), the GIL released; False where the kernel cannot. */
static PyObject *do_populate(Fast *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "populate(off, len)");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(args[0]), len = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (off < 0 || len < 0 || off % 4096 || len > self->buf.len - off) {
        PyErr_SetString(PyExc_ValueError, "populate: a page-aligned range inside the segment");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = len ? madvise(self->base + off, (size_t)len, 23 /* MADV_POPULATE_WRITE */) : 0;
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(rc == 0);
}

#include "_fastpath_load.h"

#include "_fastpath_put.h"

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
     "load_many(keys, outs, tag, digests, mode, verify, workers) -> (outcomes, leftover pins) | SLOW"},
    {"put", (PyCFunction)(void (*)(void))Fast_put, METH_FASTCALL,
     "put(kb, kh, flags, value, nblk, ttl, prio) -> slot | SLOW | (slot, checksum): seal it, the lock was busy"},
    {"put_many", (PyCFunction)(void (*)(void))Fast_put_many, METH_FASTCALL,
     "put_many(items, ttl, prio) -> list of None | error | SLOW, or SLOW if busy: values up to put_in_lock"},
    {"reserve_many", (PyCFunction)(void (*)(void))Fast_reserve_many, METH_FASTCALL,
     "reserve_many(items) -> list of (slot, offset) | error, or SLOW if busy"},
    {"seal_many", (PyCFunction)(void (*)(void))Fast_seal_many, METH_FASTCALL,
     "seal_many(items) -> list of True | False (taken back) | SLOW, or SLOW if busy"},
    {"close", (PyCFunction)Fast_close, METH_NOARGS, "release the mapping"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FastType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cortex_cache._fastpath.Fast",
    .tp_basicsize = sizeof(Fast),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The hot read paths of one attached pool (see the module source).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Fast_init,
    .tp_dealloc = (destructor)Fast_dealloc,
    .tp_traverse = (traverseproc)Fast_traverse,
    .tp_clear = (inquiry)Fast_clear,
    .tp_methods = Fast_methods,
};

/* ------------------------------------------------------------------ copy_hash */


static PyObject *copy_hash(PyObject *module, PyObject *args) {
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
static PyObject *copy_hash_many(PyObject *module, PyObject *args) {
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

/* use_copy_hash_isa(name) -> str: run copy_hash on "baseline" or "avx2" (if built and the CPU has it) from
 * now on; the previous name.  For tests, so that a machine with AVX2 checks the baseline build too. */
static PyObject *use_copy_hash_isa(PyObject *module, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    PyObject *was = PyUnicode_FromString(copy_hash_isa);
    if (was == NULL) return NULL;
    if (strcmp(name, "baseline") == 0) {
        copy_hash_impl = cortex_copy_hash_base;
        copy_hash_isa = "baseline";
        return was;
    }
#ifdef HAVE_AVX2_BUILD
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

static PyMethodDef module_methods[] = {
    {"copy_hash", copy_hash, METH_VARARGS,
     "copy_hash(dst, src, head=b'') -> int: copy src into dst (same length), and the xxh3_64 of head followed "
     "by the bytes copied, each step hashed while in the CPU cache"},
    {"copy_hash_many", copy_hash_many, METH_VARARGS,
     "copy_hash_many(dsts, srcs, head=b'') -> int: copy each src into its dst, and the xxh3_64 of head "
     "followed by all the copies in order"},
    {"use_copy_hash_isa", use_copy_hash_isa, METH_O,
     "use_copy_hash_isa(name) -> str: run copy_hash on 'baseline' or 'avx2' from now on (tests); the previous"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT, "_fastpath", "The hot read paths of a pool, in C (core.py uses them).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastpath(void) {
    if (PyType_Ready(&FastType) < 0 || PyType_Ready(&PinType) < 0 || PyType_Ready(&GuardType) < 0) return NULL;
    PyObject *m = PyModule_Create(&fastpath_module);
    if (m == NULL) return NULL;
#ifdef HAVE_AVX2_BUILD
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        copy_hash_impl = cortex_copy_hash_avx2;
        copy_hash_isa = "avx2";
    }
#endif
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
