/* The C fast path's shared declarations (docs/internals.md, "The fast path").
 *
 * One `Fast` object per attached Core.  It takes the same OFD lock and follows the same dirty-mark
 * protocol as core.py (docs/design.md, "Invariants"), over the same segment layout, so processes using it
 * and processes on the pure Python path share pools freely.  It does only the common case -- a lookup, a
 * hit counted, a copy, a pin, a put -- and answers SLOW whenever anything else is needed (a dirty mark to
 * repair, an expired entry, a busy lock to wait for, a full pin table, a buffer too small): the caller
 * then runs the Python path, which handles every case.  SLOW is always answered before anything changed.
 *
 * Layout knowledge (offsets, widths) comes from Python (layout.py) at construction (_fastpath_spec.c);
 * nothing here hard-codes a field offset, and no integration's value format is known here either.
 *
 * The extension's compilation units, each including this header:
 *   _fastpath.c          the module: the Fast type's lifecycle and method table, PyInit
 *   _fastpath_spec.c     Fast.__init__: the layout spec from layout.py, checked against the mapping
 *   _fastpath_guard.c    Guard: a mapping fenced against SIGBUS
 *   _fastpath_pin.c      Pin: a pinned value's bytes, exported read-only
 *   _fastpath_read.c     read, read_many, pin_many, unpin_many (and probe, still, populate)
 *   _fastpath_put.c      put, put_many, reserve_many, seal_many, evicted
 *   _fastpath_evict.c    victim choice: the victim lists, the queue policies' next_victim, evict_one
 *   _fastpath_load.c     load_many: a batch pinned, checked against caller-given headers, copied
 *   _fastpath_fill.c     fill_reserve, fill_copy, fill_seal: a background fill's batches (fill_columns.py)
 *   _copyhash.c          copy_hash (and gather_hash) for Python, its baseline build, and the pick of the build the CPU runs
 *   _copyhash_avx2.c     copy_hash's AVX2 build (_copyhash.h, _copyhash_loop.h)
 * and _fastpath_entries.h, included by read, put and load: the lock, and what every path does under it
 * (find, lookup, touch, pin, unpin), static inline.
 * Everything but PyInit is hidden (-fvisibility=hidden): these names stay inside the module. */
#ifndef CORTEX_FASTPATH_H
#define CORTEX_FASTPATH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <fcntl.h>
#include <stdint.h>
#include <string.h>

#include "_copyhash.h"

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
/* ... and how a ghost hit moves queue 0's target (QueuePolicy.adapt): not, ARC's p, a share of entries. */
enum { ADAPT_NONE, ADAPT_ARC, ADAPT_AUTO };
/* Modes of a read: GET counts hits and misses; HITS counts hits, and a miss is SLOW (a tier below looks);
 * QUIET counts nothing and moves nothing in the eviction order (Pool.peek). */
enum { MODE_GET = 0, MODE_HITS = 1, MODE_QUIET = 2 };

/* A ghost ring (queues.Ghosts): places of key hashes chained by hash, and its live count in the header. */
typedef struct {
    uint64_t *hash;
    int32_t *next, *bkt;
    uint64_t n, mask;
    uint64_t *live, *head, *tail;
    uint64_t factor; /* the window: factor x the entries */
} GhostRing;

/* A victim list (eviction.VictimCache): its header words (layout.VICTIM_LIST_WORDS) and its rows. */
typedef struct {
    volatile uint32_t *valid;
    uint32_t *count, *pos;
    double *next_expiry, *max_primary;
    uint64_t *max_secondary, *epoch;
    int32_t *slot;
    uint64_t *ident, *sec;
    double *prim;
    uint32_t rows;
} VList;

extern PyObject *SLOW; /* the module's sentinel */

/* The Python objects a Fast holds, listed once: close(), tp_clear and tp_traverse go over this list. */
#define FAST_OBJECTS(X)                                                                                  \
    X(thread_acquire) X(thread_release) X(on_unpin) X(free_entry) X(late_unpin)        \
    X(reserve_hook) X(evict_hook) X(refill_hook) X(err_base) X(err_corrupt)

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
    /* the write path (_fastpath_put.c): allocation words and maps, the columns only a put writes */
    int64_t *free_slot;
    uint64_t *alloc_hint, *used_blocks, *key_hint, *used_kcells, *n_entries, *puts, *gone_seq;
    uint8_t *bmap, *kmap;
    uint32_t *flags_col, *opid;
    uint64_t *ostart;
    double *created;
    uint64_t put_in_lock;      /* values up to this size are put in one lock hold (core.COPY_IN_LOCK) */
    PyObject *reserve_hook;    /* Core.reserve_or_corrupt: a reservation C leaves to Python, lock held */
    PyObject *evict_hook;      /* Core.evict_or_corrupt: evict one victim by policy, lock held */
    PyObject *refill_hook;     /* Core.refill_or_corrupt(q): fill victim list q again, lock held */
    /* victim choice (_fastpath_evict.c): the lists (two for a queue policy), the policy's identity
     * column, the eviction counters; `spill`: a tier sees each victim (Core.on_evict), so Python evicts */
    VList vl[2];
    uint64_t *ident, *expirations, *evictions, *bytes_evicted;
    int spill;
    int no_evict; /* set by the fill for its reservations (_fastpath_fill.c): evict_one finds no victim */
    /* a background fill's gone marks (gone.py): a byte per position, hash marks in the first n_slots */
    uint8_t *gone;
    uint64_t gone_len;
    unsigned long long evicted_in_c; /* victims this handle evicted in C (tests) */
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

/* ------------------------------------------------------------------ Guard (_fastpath_guard.c) */

#define MAX_GUARDS 4096

struct guard_slot {
    char *volatile base; /* NULL: free */
    size_t len;
    volatile int gone;
};
extern struct guard_slot guards[MAX_GUARDS];
extern PyTypeObject GuardType;

typedef struct {
    PyObject_HEAD
    int slot; /* index into guards, -1 none */
} Guard;

/* Did the mapping of Guard slot `slot` meet a SIGBUS (its bytes are zeros now)?  Asked after every copy. */
static inline int guard_gone(int slot) { return slot >= 0 && guards[slot].gone; }

/* ------------------------------------------------------------------ Fast (_fastpath_spec.c) */

int Fast_init(Fast *self, PyObject *args, PyObject *kwds);

/* ------------------------------------------------------------------ Pin (_fastpath_pin.c) */

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

extern PyTypeObject PinType;
PyObject *new_pin(Fast *f, uint64_t j, int64_t slot, uint64_t off, uint64_t len, uint64_t cks);

/* ------------------------------------------------------------------ the methods, by file */

#define FAST_METHOD(name) PyObject *do_##name(Fast *self, PyObject *const *args, Py_ssize_t nargs)
/* _fastpath_read.c */
FAST_METHOD(read);
FAST_METHOD(read_many);
FAST_METHOD(pin_many);
FAST_METHOD(unpin_many);
FAST_METHOD(probe);
FAST_METHOD(still);
FAST_METHOD(populate);
/* _fastpath_put.c */
FAST_METHOD(put);
FAST_METHOD(put_many);
FAST_METHOD(reserve_many);
FAST_METHOD(seal_many);
FAST_METHOD(evicted);
void ghost_add(GhostRing *g, uint64_t kh, uint64_t entries);
int remove_entry(Fast *s, int64_t i);
/* ... and the steps of a put the fill reuses (lock held) */
int reserve_in_c(Fast *s, const char *kb, uint64_t klen, uint64_t kh, uint32_t flags, uint64_t vlen, uint64_t nblk,
                 int64_t *slot, uint64_t *off);
void stamp(Fast *s, int64_t i, uint64_t cks, double ttl, int64_t prio, double t);
void chain_in(Fast *s, int64_t i, uint64_t kh);
void give_slot(Fast *s, int64_t i);
void give_kcells(Fast *s, uint64_t kf, uint64_t k);
void free_room(Fast *s, int64_t i, uint64_t f, uint64_t n, uint64_t kf, uint64_t k);
/* _fastpath_evict.c */
int evict_one(Fast *s, uint64_t *first, uint64_t *n);
/* _fastpath_load.c */
FAST_METHOD(load_many);
/* _fastpath_fill.c */
FAST_METHOD(fill_reserve);
FAST_METHOD(fill_copy);
FAST_METHOD(fill_seal);

/* _copyhash.c: the module's functions */
PyObject *copy_hash(PyObject *module, PyObject *args);
PyObject *copy_hash_many(PyObject *module, PyObject *args);
PyObject *gather_hash(PyObject *module, PyObject *args);
PyObject *use_copy_hash_isa(PyObject *module, PyObject *arg);

#endif
