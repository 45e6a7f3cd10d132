/* _hotindex: the CPU tier's ready blocks, published in shared memory.
 *
 * One writer (the sidecar's loop thread) and any number of readers (engine
 * processes, mapping the segment read-only). The segment:
 *
 *   header   8 x u64: magic, capacity (entries, a power of two), num_slots,
 *            seq (the table's seqlock), alive (CLOCK_MONOTONIC ns of the
 *            writer's last stamp), flags, token, reserved
 *   gens     u64[num_slots]: a slot's generation, bumped whenever the slot
 *            stops holding the block it held (freed, or retired from a
 *            geometry); never decreases
 *   back     u64[num_slots]: the writer's own map, slot -> entry + 1 (0: none)
 *   entries  capacity x {k0, k1, slot + 1 (0: empty), gen}: open addressing
 *            with linear probing on k0 (keys are hashes), deletion by
 *            backward shift, so there are no tombstones
 *
 * Every change of the table is one write section: seq is made odd, entries
 * change, seq is made even again. A reader probes one key between two reads
 * of seq and retries if they differ or were odd, so it never acts on a torn
 * entry. An entry (key, slot, gen) is a hit only while gens[slot] == gen:
 * the writer bumps gens[slot] before it erases the entry, and before the
 * slot can be given to anyone else, so a reader that copied a slot's bytes
 * and then finds its generation unchanged copied the block it looked up.
 *
 * Memory order: the writer's stores are release, the reader's loads of seq
 * and gens acquire, with an acquire fence between the data it read (entry
 * fields, or a block's bytes copied by someone else) and the re-check.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define MAGIC 0x6b76686f74696478ULL /* "kvhotidx" */
#define HEADER_WORDS 8
#define H_MAGIC 0
#define H_CAPACITY 1
#define H_SLOTS 2
#define H_SEQ 3
#define H_ALIVE 4
#define H_FLAGS 5
#define H_TOKEN 6
#define MAX_SPINS 200000 /* a writer stuck mid-section (killed): give up, a miss */

typedef struct {
    uint64_t k0, k1, slot1, gen;
} Entry;

typedef struct {
    uint64_t *header;
    uint64_t *gens;
    uint64_t *back;
    Entry *entries;
    uint64_t mask;
    uint64_t num_slots;
} Table;

#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define LOAD_ACQ(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define STORE_REL(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static Py_ssize_t segment_bytes(uint64_t capacity, uint64_t num_slots) {
    return (Py_ssize_t)(8 * HEADER_WORDS + 16 * num_slots + sizeof(Entry) * capacity);
}

/* Map a buffer onto a Table; -1 (with an exception) if it is not a segment. */
static int table_of(Py_buffer *buf, Table *t) {
    if (buf->len < 8 * HEADER_WORDS || ((uintptr_t)buf->buf & 7)) {
        PyErr_SetString(PyExc_ValueError, "not a hot index segment (too small or unaligned)");
        return -1;
    }
    uint64_t *h = (uint64_t *)buf->buf;
    uint64_t capacity = LOAD(&h[H_CAPACITY]), slots = LOAD(&h[H_SLOTS]);
    if (LOAD(&h[H_MAGIC]) != MAGIC || capacity == 0 || (capacity & (capacity - 1)) ||
        capacity > ((uint64_t)1 << 40) || slots > ((uint64_t)1 << 40) ||
        segment_bytes(capacity, slots) > buf->len) {
        PyErr_SetString(PyExc_ValueError, "not a hot index segment (bad header)");
        return -1;
    }
    t->header = h;
    t->gens = h + HEADER_WORDS;
    t->back = t->gens + slots;
    t->entries = (Entry *)(t->back + slots);
    t->mask = capacity - 1;
    t->num_slots = slots;
    return 0;
}

static inline void key_of(const char *p, uint64_t *k0, uint64_t *k1) {
    memcpy(k0, p, 8);
    memcpy(k1, p + 8, 8);
}

/* ---- writer ------------------------------------------------------------------ */

static inline void begin(Table *t) {
    __atomic_fetch_add(&t->header[H_SEQ], 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE); /* seq odd before any entry changes */
}

static inline void end(Table *t) { __atomic_fetch_add(&t->header[H_SEQ], 1, __ATOMIC_RELEASE); }

static void erase(Table *t, uint64_t i) {
    Entry *e = t->entries;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        uint64_t s1 = e[j].slot1;
        if (s1 == 0) break;
        uint64_t home = e[j].k0 & t->mask;
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (stays) continue;
        STORE(&e[i].k0, e[j].k0);
        STORE(&e[i].k1, e[j].k1);
        STORE(&e[i].gen, e[j].gen);
        STORE(&e[i].slot1, s1);
        t->back[s1 - 1] = i + 1;
        i = j;
    }
    STORE(&e[i].slot1, 0);
}

static PyObject *py_init(PyObject *self, PyObject *args) {
    Py_buffer buf;
    unsigned long long capacity, slots, flags, token;
    if (!PyArg_ParseTuple(args, "w*KKKK", &buf, &capacity, &slots, &flags, &token)) return NULL;
    PyObject *out = NULL;
    if (capacity == 0 || (capacity & (capacity - 1)) || capacity < 2 * slots ||
        segment_bytes(capacity, slots) > buf.len || ((uintptr_t)buf.buf & 7)) {
        PyErr_SetString(PyExc_ValueError, "capacity must be a power of two >= 2 x slots, "
                                          "and the buffer large enough");
        goto done;
    }
    uint64_t *h = (uint64_t *)buf.buf;
    memset(buf.buf, 0, (size_t)segment_bytes(capacity, slots));
    h[H_CAPACITY] = capacity;
    h[H_SLOTS] = slots;
    h[H_FLAGS] = flags;
    h[H_TOKEN] = token;
    STORE_REL(&h[H_MAGIC], MAGIC);
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&buf);
    return out;
}

static PyObject *py_segment_bytes(PyObject *self, PyObject *args) {
    unsigned long long capacity, slots;
    if (!PyArg_ParseTuple(args, "KK", &capacity, &slots)) return NULL;
    return PyLong_FromSsize_t(segment_bytes(capacity, slots));
}

/* Parse (segment, keys bytes?, slots int64 buffer); checks lengths and slot range. */
static int writer_args(Py_buffer *buf, Py_buffer *slots, Table *t) {
    if (table_of(buf, t) < 0) return -1;
    if (slots->len % 8) {
        PyErr_SetString(PyExc_ValueError, "slots must be int64");
        return -1;
    }
    const int64_t *s = (const int64_t *)slots->buf;
    for (Py_ssize_t k = 0; k < slots->len / 8; k++) {
        if (s[k] < 0 || (uint64_t)s[k] >= t->num_slots) {
            PyErr_Format(PyExc_ValueError, "slot %lld out of range", (long long)s[k]);
            return -1;
        }
    }
    return 0;
}

static PyObject *py_publish(PyObject *self, PyObject *args) {
    Py_buffer buf, keys, slots;
    if (!PyArg_ParseTuple(args, "w*y*y*", &buf, &keys, &slots)) return NULL;
    PyObject *out = NULL;
    Table t;
    if (writer_args(&buf, &slots, &t) < 0) goto done;
    Py_ssize_t n = slots.len / 8;
    if (keys.len != 16 * n) {
        PyErr_SetString(PyExc_ValueError, "one 16-byte key per slot");
        goto done;
    }
    const int64_t *s = (const int64_t *)slots.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t k0, k1, slot = (uint64_t)s[k];
        key_of((const char *)keys.buf + 16 * k, &k0, &k1);
        begin(&t);
        uint64_t stale = t.back[slot];
        if (stale) { /* defensive: the slot's old entry, had it not been vacated */
            erase(&t, stale - 1);
            t.back[slot] = 0;
        }
        uint64_t i = k0 & t.mask;
        for (uint64_t probes = 0; probes <= t.mask; probes++, i = (i + 1) & t.mask) {
            Entry *e = &t.entries[i];
            if (e->slot1 && (e->k0 != k0 || e->k1 != k1)) continue;
            if (e->slot1) t.back[e->slot1 - 1] = 0; /* the key moves to this slot */
            STORE(&e->k0, k0);
            STORE(&e->k1, k1);
            STORE(&e->gen, LOAD(&t.gens[slot]));
            STORE(&e->slot1, slot + 1);
            t.back[slot] = i + 1;
            break;
        }
        end(&t);
    }
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&slots);
    return out;
}

static PyObject *py_vacate(PyObject *self, PyObject *args) {
    Py_buffer buf, slots;
    if (!PyArg_ParseTuple(args, "w*y*", &buf, &slots)) return NULL;
    PyObject *out = NULL;
    Table t;
    if (writer_args(&buf, &slots, &t) < 0) goto done;
    const int64_t *s = (const int64_t *)slots.buf;
    for (Py_ssize_t k = 0; k < slots.len / 8; k++) {
        uint64_t slot = (uint64_t)s[k];
        begin(&t);
        STORE_REL(&t.gens[slot], t.gens[slot] + 1); /* before anyone may reuse it */
        if (t.back[slot]) {
            erase(&t, t.back[slot] - 1);
            t.back[slot] = 0;
        }
        end(&t);
    }
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&slots);
    return out;
}

static PyObject *py_move(PyObject *self, PyObject *args) {
    Py_buffer buf, src, dst;
    if (!PyArg_ParseTuple(args, "w*y*y*", &buf, &src, &dst)) return NULL;
    PyObject *out = NULL;
    Table t;
    if (writer_args(&buf, &src, &t) < 0 || writer_args(&buf, &dst, &t) < 0) goto done;
    if (src.len != dst.len) {
        PyErr_SetString(PyExc_ValueError, "src and dst differ in length");
        goto done;
    }
    const int64_t *s = (const int64_t *)src.buf, *d = (const int64_t *)dst.buf;
    for (Py_ssize_t k = 0; k < src.len / 8; k++) {
        uint64_t from = (uint64_t)s[k], to = (uint64_t)d[k], i1 = t.back[from];
        if (!i1) continue;
        Entry *e = &t.entries[i1 - 1];
        begin(&t);
        STORE(&e->gen, LOAD(&t.gens[to]));
        STORE(&e->slot1, to + 1);
        t.back[from] = 0;
        t.back[to] = i1;
        end(&t);
    }
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return out;
}

static uint64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static PyObject *py_stamp(PyObject *self, PyObject *args) {
    Py_buffer buf;
    unsigned long long flags;
    if (!PyArg_ParseTuple(args, "w*K", &buf, &flags)) return NULL;
    Table t;
    PyObject *out = NULL;
    if (table_of(&buf, &t) == 0) {
        STORE_REL(&t.header[H_FLAGS], flags);
        STORE_REL(&t.header[H_ALIVE], monotonic_ns());
        out = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&buf);
    return out;
}

/* Close the table for good: every generation bumped (a reader's copy in
 * flight fails its check), then the flags cleared (no new lookup trusts it). */
static PyObject *py_withdraw(PyObject *self, PyObject *args) {
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "w*", &buf)) return NULL;
    Table t;
    PyObject *out = NULL;
    if (table_of(&buf, &t) == 0) {
        /* The table is dead from here on: seq is made odd and left so, and
         * no reader trusts an entry again. begin/end would make it even for
         * the loop below, and a writer killed inside a section (seq odd) may
         * have left an entry torn: its key with another slot. */
        if (!(LOAD(&t.header[H_SEQ]) & 1)) begin(&t);
        for (uint64_t s = 0; s < t.num_slots; s++) STORE_REL(&t.gens[s], t.gens[s] + 1);
        STORE_REL(&t.header[H_FLAGS], 0);
        out = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&buf);
    return out;
}

/* ---- reader ------------------------------------------------------------------ */

/* Find one key: 1 and its (slot, gen) if present with its generation
 * current, 0 if absent or stale, -1 if the writer kept the table busy. */
static int find(Table *t, uint64_t k0, uint64_t k1, uint64_t *slot, uint64_t *gen) {
    for (int spins = 0; spins < MAX_SPINS; spins++) {
        uint64_t seq = LOAD_ACQ(&t->header[H_SEQ]);
        if (seq & 1) {
            cpu_relax();
            continue;
        }
        int found = 0;
        uint64_t s1 = 0, g = 0, i = k0 & t->mask;
        for (uint64_t probes = 0; probes <= t->mask; probes++, i = (i + 1) & t->mask) {
            Entry *e = &t->entries[i];
            s1 = LOAD(&e->slot1);
            if (s1 == 0) break;
            if (LOAD(&e->k0) == k0 && LOAD(&e->k1) == k1) {
                g = LOAD(&e->gen);
                found = 1;
                break;
            }
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (LOAD(&t->header[H_SEQ]) != seq) continue;
        if (!found || s1 - 1 >= t->num_slots || LOAD_ACQ(&t->gens[s1 - 1]) != g) return 0;
        *slot = s1 - 1;
        *gen = g;
        return 1;
    }
    return -1;
}

static PyObject *py_probe(PyObject *self, PyObject *args) {
    Py_buffer buf, keys, slots = {0}, gens = {0};
    PyObject *slots_obj = Py_None, *gens_obj = Py_None;
    if (!PyArg_ParseTuple(args, "y*y*|OO", &buf, &keys, &slots_obj, &gens_obj)) return NULL;
    PyObject *out = NULL;
    Table t;
    if (table_of(&buf, &t) < 0) goto done;
    Py_ssize_t n = keys.len / 16;
    if (keys.len % 16) {
        PyErr_SetString(PyExc_ValueError, "keys must be 16 bytes each");
        goto done;
    }
    int want = slots_obj != Py_None;
    if (want) {
        if (PyObject_GetBuffer(slots_obj, &slots, PyBUF_WRITABLE) < 0) goto done;
        if (PyObject_GetBuffer(gens_obj, &gens, PyBUF_WRITABLE) < 0) goto done;
        if (slots.len < 8 * n || gens.len < 8 * n) {
            PyErr_SetString(PyExc_ValueError, "out arrays need 8 bytes per key");
            goto done;
        }
    }
    Py_ssize_t k = 0;
    for (; k < n; k++) {
        uint64_t k0, k1, slot, gen;
        key_of((const char *)keys.buf + 16 * k, &k0, &k1);
        if (find(&t, k0, k1, &slot, &gen) != 1) break;
        if (want) {
            ((int64_t *)slots.buf)[k] = (int64_t)slot;
            ((uint64_t *)gens.buf)[k] = gen;
        }
    }
    out = PyLong_FromSsize_t(k);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&keys);
    if (slots.obj) PyBuffer_Release(&slots);
    if (gens.obj) PyBuffer_Release(&gens);
    return out;
}

static PyObject *py_check(PyObject *self, PyObject *args) {
    Py_buffer buf, slots, gens;
    if (!PyArg_ParseTuple(args, "y*y*y*", &buf, &slots, &gens)) return NULL;
    PyObject *out = NULL;
    Table t;
    if (table_of(&buf, &t) < 0) goto done;
    if (slots.len % 8 || slots.len != gens.len) {
        PyErr_SetString(PyExc_ValueError, "slots and gens: int64 / uint64 of one length");
        goto done;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copies' reads before these */
    const int64_t *s = (const int64_t *)slots.buf;
    const uint64_t *g = (const uint64_t *)gens.buf;
    Py_ssize_t k = 0;
    for (; k < slots.len / 8; k++) {
        if (s[k] < 0 || (uint64_t)s[k] >= t.num_slots || LOAD_ACQ(&t.gens[s[k]]) != g[k]) break;
    }
    out = PyLong_FromSsize_t(k);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&gens);
    return out;
}

static PyObject *py_state(PyObject *self, PyObject *args) {
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*", &buf)) return NULL;
    Table t;
    PyObject *out = NULL;
    if (table_of(&buf, &t) == 0) {
        uint64_t alive = LOAD_ACQ(&t.header[H_ALIVE]), now = monotonic_ns();
        double age = alive > now ? 0.0 : (double)(now - alive) / 1e9;
        out = Py_BuildValue("(KdK)", (unsigned long long)LOAD_ACQ(&t.header[H_FLAGS]), age,
                            (unsigned long long)LOAD(&t.header[H_TOKEN]));
    }
    PyBuffer_Release(&buf);
    return out;
}

static PyMethodDef methods[] = {
    {"segment_bytes", py_segment_bytes, METH_VARARGS, "(capacity, slots) -> segment size"},
    {"init", py_init, METH_VARARGS, "(segment, capacity, slots, flags, token): a new table"},
    {"publish", py_publish, METH_VARARGS, "(segment, keys, slots): make blocks visible"},
    {"vacate", py_vacate, METH_VARARGS, "(segment, slots): bump generations, drop entries"},
    {"move", py_move, METH_VARARGS, "(segment, src, dst): entries follow moved blocks"},
    {"withdraw", py_withdraw, METH_VARARGS, "(segment): every generation bumped, flags cleared"},
    {"stamp", py_stamp, METH_VARARGS, "(segment, flags): set flags, stamp the writer alive"},
    {"probe", py_probe, METH_VARARGS,
     "(segment, keys[, slots_out, gens_out]) -> leading keys present and current"},
    {"check", py_check, METH_VARARGS, "(segment, slots, gens) -> leading still current"},
    {"state", py_state, METH_VARARGS, "(segment) -> (flags, seconds since stamp, token)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hotindex", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hotindex(void) { return PyModule_Create(&module); }
