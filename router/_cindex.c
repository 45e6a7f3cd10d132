/* _cindex: the router's global index (router.native.NativeIndex) in C.
 *
 * Every known block key is one entry of a pool: its 16-byte key, the pool
 * index of its parent (or ROOT), how many known entries continue it, and
 * the set of holder slots holding it, a bitmap (slots 0-63 inline, further
 * words in a side array allocated only for entries held by a slot >= 64).
 * An open-addressing table (linear probing on a mix of the key's words,
 * deletion by backward shift) maps a key to its entry. No Python object is
 * held per key, so the collector never walks the index.
 *
 * A holder slot is one incarnation of a worker (router/native.py maps
 * workers to slots). Retiring a slot (a clear, a removed worker) is O(1):
 * the slot's bit leaves the live mask, so no query sees its entries, and
 * `sweep` later clears its bits in bounded slices, scanning the pool once
 * for every slot retired before the pass began; a slot is reused only once
 * swept. An entry with no bit and no child is freed, then its parent if that
 * leaves it unheld and childless (a hole left by a removal mid-chain).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define ROOT 0xFFFFFFFFu
#define FREE 0xFFFFFFFEu
#define SCAN_PER_SWEEP 65536 /* pool entries one sweep call visits at most */
#define SHARD_BITS 10 /* the table is 1024 tables, each grown on its own: one
                         growth rehashes 1/1024 of the keys, never all */
#define SHARDS (1u << SHARD_BITS)
#define CHUNK_BITS 16 /* the pool grows by chunks of 65,536 entries: no realloc
                         ever copies it (a 40 MB copy is a stall of ~10 ms) */
#define CHUNK (1u << CHUNK_BITS)
#define AT(ix, i) (&(ix)->chunks[(i) >> CHUNK_BITS][(i) & (CHUNK - 1)])
#define HUGE (2u << 20) /* pool chunks are aligned to huge pages */
#define PREFETCH 16 /* query keys looked ahead of the walk (table slots; entries at half) */

enum { S_FREE = 0, S_LIVE = 1, S_DEAD = 2, S_SWEEPING = 3 };

typedef struct {
    uint64_t k0, k1;
    uint64_t bits;  /* slots 0-63 */
    uint64_t *ext;  /* NULL, or ext[0] = n words for slots 64.., then the words */
    uint32_t parent; /* pool index, ROOT, or FREE (a free pool entry; next free in children) */
    uint32_t children;
} Entry;

typedef struct {
    PyObject_HEAD
    Entry **chunks; /* the pool: CHUNK entries each, never moved */
    uint32_t nchunks, pool_len, free_head, count;
    uint64_t *table[SHARDS]; /* (low 32 bits of the hash) << 32 | pool index + 1; 0: empty */
    uint32_t table_mask[SHARDS], table_count[SHARDS];
    uint8_t *state;  /* per slot */
    int64_t *size;   /* per slot: blocks held (live) or stale bits left (dead, sweeping) */
    uint32_t nslots;
    uint64_t *live, *sweeping; /* masks, nwords each */
    uint32_t nwords;
    uint32_t cursor; /* the sweep pass's position */
    int64_t sweep_left; /* stale bits of the sweeping slots still set */
    int64_t stale;      /* stale bits of every dead or sweeping slot */
} Index;

static inline uint64_t mix(uint64_t k0, uint64_t k1) {
    uint64_t h = k0 ^ (k1 * 0x9E3779B97F4A7C15ull);
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    return h ^ (h >> 29);
}

static inline uint64_t word_of(const Entry *e, uint32_t w) {
    if (w == 0) return e->bits;
    return (e->ext && w < e->ext[0] + 1) ? e->ext[w] : 0;
}

static inline int has_bit(const Entry *e, uint32_t slot) {
    return (word_of(e, slot >> 6) >> (slot & 63)) & 1;
}

static int any_bit(const Entry *e) {
    if (e->bits) return 1;
    if (e->ext)
        for (uint64_t w = 1; w <= e->ext[0]; w++)
            if (e->ext[w]) return 1;
    return 0;
}

static int set_bit(Entry *e, uint32_t slot) { /* 1 if newly set, -1 no memory */
    uint32_t w = slot >> 6;
    uint64_t b = 1ull << (slot & 63);
    uint64_t *word = &e->bits;
    if (w > 0) {
        uint64_t have = e->ext ? e->ext[0] : 0;
        if (w > have) {
            uint64_t *ext = realloc(e->ext, (w + 1) * sizeof(uint64_t));
            if (!ext) return -1;
            memset(ext + have + 1, 0, (w - have) * sizeof(uint64_t));
            ext[0] = w;
            e->ext = ext;
        }
        word = &e->ext[w];
    }
    if (*word & b) return 0;
    *word |= b;
    return 1;
}

static void clear_bit(Entry *e, uint32_t slot) {
    uint32_t w = slot >> 6;
    uint64_t b = ~(1ull << (slot & 63));
    if (w == 0)
        e->bits &= b;
    else if (e->ext && w <= e->ext[0])
        e->ext[w] &= b;
}

static inline uint32_t shard_of(uint64_t h) { return (uint32_t)(h >> (64 - SHARD_BITS)); }

static uint32_t lookup_h(const Index *ix, uint64_t k0, uint64_t k1, uint64_t h) {
    const uint64_t *table = ix->table[shard_of(h)];
    if (!table) return ROOT;
    uint32_t mask = ix->table_mask[shard_of(h)], i = (uint32_t)h & mask;
    uint64_t tag = h << 32;
    for (;;) {
        uint64_t v = table[i];
        if (!v) return ROOT;
        if ((v & 0xFFFFFFFF00000000ull) == tag) {
            const Entry *e = AT(ix, (uint32_t)v - 1);
            if (e->k0 == k0 && e->k1 == k1) return (uint32_t)v - 1;
        }
        i = (i + 1) & mask;
    }
}

static inline uint32_t lookup(const Index *ix, uint64_t k0, uint64_t k1) {
    return lookup_h(ix, k0, k1, mix(k0, k1));
}

/* Prefetch the home table slot of hash h (a walk asks for it later). */
static inline void prefetch_slot(const Index *ix, uint64_t h) {
    const uint64_t *table = ix->table[shard_of(h)];
    if (table) __builtin_prefetch(&table[(uint32_t)h & ix->table_mask[shard_of(h)]]);
}

/* Prefetch the pool entry the home slot of hash h names, if it is h's. */
static inline void prefetch_entry(const Index *ix, uint64_t h) {
    const uint64_t *table = ix->table[shard_of(h)];
    if (!table) return;
    uint64_t v = table[(uint32_t)h & ix->table_mask[shard_of(h)]];
    if (v && (v >> 32) == (uint32_t)h) __builtin_prefetch(AT(ix, (uint32_t)v - 1));
}

static void table_put(uint64_t *table, uint32_t mask, uint64_t v) {
    uint32_t i = (uint32_t)(v >> 32) & mask;
    while (table[i]) i = (i + 1) & mask;
    table[i] = v;
}

static int grow_shard(Index *ix, uint32_t s) {
    uint64_t *old = ix->table[s];
    uint32_t cap = old ? (ix->table_mask[s] + 1) * 2 : 16;
    uint64_t *table = calloc(cap, sizeof(uint64_t));
    if (!table) return -1;
    for (uint32_t i = 0; old && i <= ix->table_mask[s]; i++)
        if (old[i]) table_put(table, cap - 1, old[i]);
    free(old);
    ix->table[s] = table;
    ix->table_mask[s] = cap - 1;
    return 0;
}

static void table_delete(Index *ix, uint32_t idx) {
    uint64_t h = mix(AT(ix, idx)->k0, AT(ix, idx)->k1);
    uint32_t s = shard_of(h), mask = ix->table_mask[s], i = (uint32_t)h & mask;
    uint64_t *table = ix->table[s];
    while ((uint32_t)table[i] != idx + 1) i = (i + 1) & mask;
    uint32_t j = i;
    for (;;) { /* backward shift: no tombstones */
        j = (j + 1) & mask;
        uint64_t v = table[j];
        if (!v) break;
        uint32_t home = (uint32_t)(v >> 32) & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            table[i] = v;
            i = j;
        }
    }
    table[i] = 0;
    ix->table_count[s]--;
}

static uint32_t new_entry(Index *ix, uint64_t k0, uint64_t k1, uint32_t parent) {
    uint64_t h = mix(k0, k1);
    uint32_t s = shard_of(h);
    if (!ix->table[s] || (uint64_t)(ix->table_count[s] + 1) * 10 > (uint64_t)(ix->table_mask[s] + 1) * 7)
        if (grow_shard(ix, s) < 0) return FREE;
    uint32_t idx;
    if (ix->free_head != ROOT) {
        idx = ix->free_head;
        ix->free_head = AT(ix, idx)->children;
    } else {
        if (ix->pool_len == ix->nchunks * CHUNK) {
            if (ix->pool_len >= FREE - CHUNK) return FREE; /* 2^32 - 2 entries at most */
            Entry **chunks = realloc(ix->chunks, (ix->nchunks + 1) * sizeof(Entry *));
            if (!chunks) return FREE;
            ix->chunks = chunks;
            void *chunk = NULL;
            if (posix_memalign(&chunk, HUGE, CHUNK * sizeof(Entry))) return FREE;
#ifdef MADV_HUGEPAGE
            madvise(chunk, CHUNK * sizeof(Entry) / HUGE * HUGE, MADV_HUGEPAGE); /* a hint: fewer TLB misses */
#endif
            chunks[ix->nchunks] = chunk;
            ix->nchunks++;
        }
        idx = ix->pool_len++;
    }
    Entry *e = AT(ix, idx);
    e->k0 = k0;
    e->k1 = k1;
    e->bits = 0;
    e->ext = NULL;
    e->parent = parent;
    e->children = 0;
    if (parent != ROOT) AT(ix, parent)->children++;
    table_put(ix->table[s], ix->table_mask[s], (h << 32) | (idx + 1));
    ix->table_count[s]++;
    ix->count++;
    return idx;
}

/* Free `idx` and then each ancestor left unheld and childless. */
static void prune(Index *ix, uint32_t idx) {
    while (idx != ROOT) {
        Entry *e = AT(ix, idx);
        if (e->children || any_bit(e)) return;
        uint32_t up = e->parent;
        table_delete(ix, idx);
        free(e->ext);
        e->ext = NULL;
        e->parent = FREE;
        e->children = ix->free_head;
        ix->free_head = idx;
        ix->count--;
        if (up != ROOT) AT(ix, up)->children--;
        idx = up;
    }
}

static int key_of(PyObject *o, uint64_t *k0, uint64_t *k1) {
    if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) != 16) {
        PyErr_SetString(PyExc_ValueError, "a block key is 16 bytes");
        return -1;
    }
    const char *p = PyBytes_AS_STRING(o);
    memcpy(k0, p, 8);
    memcpy(k1, p + 8, 8);
    return 0;
}

/* A sequence of keys as pairs of words (PyMem_Free it); NULL on error. */
static uint64_t *keys_of(PyObject *seq, Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(seq, "keys must be a sequence");
    if (!fast) return NULL;
    *n = PySequence_Fast_GET_SIZE(fast);
    uint64_t *keys = PyMem_Malloc((size_t)(*n ? *n : 1) * 16);
    if (!keys) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < *n; i++)
        if (key_of(items[i], &keys[2 * i], &keys[2 * i + 1]) < 0) {
            PyMem_Free(keys);
            Py_DECREF(fast);
            return NULL;
        }
    Py_DECREF(fast);
    return keys;
}

static int ensure_slot(Index *ix, uint32_t slot) {
    if (slot < ix->nslots) return 0;
    uint32_t n = ix->nslots ? ix->nslots : 64;
    while (n <= slot) n *= 2;
    uint8_t *state = realloc(ix->state, n);
    if (state) ix->state = state;
    int64_t *size = realloc(ix->size, n * sizeof(int64_t));
    if (size) ix->size = size;
    uint32_t words = n / 64;
    uint64_t *live = realloc(ix->live, words * sizeof(uint64_t));
    if (live) ix->live = live;
    uint64_t *sweeping = realloc(ix->sweeping, words * sizeof(uint64_t));
    if (sweeping) ix->sweeping = sweeping;
    if (!state || !size || !live || !sweeping) {
        PyErr_NoMemory();
        return -1;
    }
    memset(ix->state + ix->nslots, S_FREE, n - ix->nslots);
    memset(ix->size + ix->nslots, 0, (n - ix->nslots) * sizeof(int64_t));
    memset(ix->live + ix->nwords, 0, (words - ix->nwords) * sizeof(uint64_t));
    memset(ix->sweeping + ix->nwords, 0, (words - ix->nwords) * sizeof(uint64_t));
    ix->nslots = n;
    ix->nwords = words;
    return 0;
}

static int slot_arg(Index *ix, PyObject *o, uint32_t *slot, int live) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || (uint64_t)v >= ix->nslots || (live && ix->state[v] != S_LIVE)) {
        PyErr_Format(PyExc_ValueError, "slot %ld is not a live slot", v);
        return -1;
    }
    *slot = (uint32_t)v;
    return 0;
}


/* new_slot() -> the lowest free slot, made live with nothing held. */
static PyObject *Index_new_slot(Index *ix, PyObject *unused) {
    uint32_t slot = 0;
    while (slot < ix->nslots && ix->state[slot] != S_FREE) slot++;
    if (ensure_slot(ix, slot) < 0) return NULL;
    ix->state[slot] = S_LIVE;
    ix->size[slot] = 0;
    ix->live[slot >> 6] |= 1ull << (slot & 63);
    return PyLong_FromUnsignedLong(slot);
}

/* retire(slot): O(1); its entries go stale until swept. */
static PyObject *Index_retire(Index *ix, PyObject *arg) {
    uint32_t slot;
    if (slot_arg(ix, arg, &slot, 1) < 0) return NULL;
    ix->live[slot >> 6] &= ~(1ull << (slot & 63));
    ix->stale += ix->size[slot];
    ix->state[slot] = ix->size[slot] ? S_DEAD : S_FREE;
    Py_RETURN_NONE;
}

/* store(slot, keys, parent) -> the slot's size, or -1: a key is known under
 * another parent or repeated (nothing changed). The caller checked `parent`. */
static PyObject *Index_store(Index *ix, PyObject *args) {
    PyObject *slot_o, *seq, *parent_o;
    if (!PyArg_ParseTuple(args, "OOO", &slot_o, &seq, &parent_o)) return NULL;
    uint32_t slot, pidx = ROOT;
    if (slot_arg(ix, slot_o, &slot, 1) < 0) return NULL;
    if (parent_o != Py_None) {
        uint64_t p0, p1;
        if (key_of(parent_o, &p0, &p1) < 0) return NULL;
        pidx = lookup(ix, p0, p1);
        if (pidx == ROOT || !has_bit(AT(ix, pidx), slot)) {
            PyErr_SetString(PyExc_ValueError, "the parent is not held by the slot");
            return NULL;
        }
    }
    Py_ssize_t n;
    uint64_t *keys = keys_of(seq, &n);
    if (!keys) return NULL;
    uint32_t *found = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    uint32_t smask = 1;
    while (smask < 2 * (uint64_t)n) smask <<= 1;
    uint32_t *seen = PyMem_Calloc(smask, sizeof(uint32_t)); /* i + 1 of the run's keys */
    long result = -1;
    if (!found || !seen) {
        PyErr_NoMemory();
        goto done;
    }
    smask--;
    uint32_t expected = pidx; /* ROOT also: the previous key is new */
    int prev_new = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) prefetch_slot(ix, mix(keys[2 * (i + PREFETCH)], keys[2 * (i + PREFETCH) + 1]));
        if (i + PREFETCH / 2 < n)
            prefetch_entry(ix, mix(keys[2 * (i + PREFETCH / 2)], keys[2 * (i + PREFETCH / 2) + 1]));
        uint64_t k0 = keys[2 * i], k1 = keys[2 * i + 1];
        uint32_t h = (uint32_t)mix(k0, k1) & smask;
        for (; seen[h]; h = (h + 1) & smask) {
            uint32_t j = seen[h] - 1;
            if (keys[2 * j] == k0 && keys[2 * j + 1] == k1) goto done; /* repeated */
        }
        seen[h] = (uint32_t)i + 1;
        uint32_t idx = lookup(ix, k0, k1);
        if (idx != ROOT && (prev_new || AT(ix, idx)->parent != expected)) goto done;
        found[i] = idx;
        prev_new = idx == ROOT;
        expected = idx;
    }
    uint32_t up = pidx;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t idx = found[i];
        if (idx == ROOT) idx = new_entry(ix, keys[2 * i], keys[2 * i + 1], up);
        int added = idx == FREE ? -1 : set_bit(AT(ix, idx), slot);
        if (added < 0) { /* out of memory: the keys stored so far stay */
            PyErr_NoMemory();
            goto done;
        }
        ix->size[slot] += added;
        up = idx;
    }
    result = (long)ix->size[slot];
done:
    PyMem_Free(keys);
    PyMem_Free(found);
    PyMem_Free(seen);
    if (result < 0 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(result);
}

/* remove(slot, keys) -> the slot's size, or -1: it does not hold one of them. */
static PyObject *Index_remove(Index *ix, PyObject *args) {
    PyObject *slot_o, *seq;
    if (!PyArg_ParseTuple(args, "OO", &slot_o, &seq)) return NULL;
    uint32_t slot;
    if (slot_arg(ix, slot_o, &slot, 1) < 0) return NULL;
    Py_ssize_t n;
    uint64_t *keys = keys_of(seq, &n);
    if (!keys) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t idx = lookup(ix, keys[2 * i], keys[2 * i + 1]);
        if (idx == ROOT || !has_bit(AT(ix, idx), slot)) {
            PyMem_Free(keys);
            return PyLong_FromLong(-1);
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t idx = lookup(ix, keys[2 * i], keys[2 * i + 1]);
        if (idx == ROOT || !has_bit(AT(ix, idx), slot)) continue; /* repeated */
        clear_bit(AT(ix, idx), slot);
        ix->size[slot]--;
        prune(ix, idx);
    }
    PyMem_Free(keys);
    return PyLong_FromLongLong(ix->size[slot]);
}

/* holds(slot, key) -> bool */
static PyObject *Index_holds(Index *ix, PyObject *args) {
    PyObject *slot_o, *key;
    uint64_t k0, k1;
    uint32_t slot;
    if (!PyArg_ParseTuple(args, "OO", &slot_o, &key) || slot_arg(ix, slot_o, &slot, 1) < 0 ||
        key_of(key, &k0, &k1) < 0)
        return NULL;
    uint32_t idx = lookup(ix, k0, k1);
    return PyBool_FromLong(idx != ROOT && has_bit(AT(ix, idx), slot));
}

static PyObject *key_bytes(const Entry *e) {
    char buf[16];
    memcpy(buf, &e->k0, 8);
    memcpy(buf + 8, &e->k1, 8);
    return PyBytes_FromStringAndSize(buf, 16);
}

/* parent_of(key) -> (known, parent key or None) */
static PyObject *Index_parent_of(Index *ix, PyObject *key) {
    uint64_t k0, k1;
    if (key_of(key, &k0, &k1) < 0) return NULL;
    uint32_t idx = lookup(ix, k0, k1);
    if (idx == ROOT) return Py_BuildValue("(OO)", Py_False, Py_None);
    uint32_t up = AT(ix, idx)->parent;
    if (up == ROOT) return Py_BuildValue("(OO)", Py_True, Py_None);
    PyObject *p = key_bytes(AT(ix, up));
    return p ? Py_BuildValue("(ON)", Py_True, p) : NULL;
}

typedef struct {
    uint64_t k0, k1, h;
} Ahead;

/* Read query key j into ring[j % 64] and prefetch its table slot. */
static inline int look_ahead(const Index *ix, PyObject **items, Py_ssize_t j, Ahead *ring) {
    Ahead *a = &ring[j & 63];
    if (key_of(items[j], &a->k0, &a->k1) < 0) return -1;
    a->h = mix(a->k0, a->k1);
    prefetch_slot(ix, a->h);
    return 0;
}

/* Prefetch the pool entry of ring[j % 64] if its home slot names it. */
static inline void entry_ahead(const Index *ix, const Ahead *ring, Py_ssize_t j) {
    prefetch_entry(ix, ring[j & 63].h);
}

/* find(keys, names, early_exit) -> {names[slot]: score} for the live slots
 * holding keys[0] (a root block): how many leading keys, each continuing
 * the one before, they hold. With early_exit the walk stops once at most
 * one slot still matches (its score then a lower bound). */
static PyObject *Index_find(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "find(keys, names: list, early_exit)");
        return NULL;
    }
    PyObject *seq = args[0], *names = args[1];
    int early = PyObject_IsTrue(args[2]);
    if (early < 0) return NULL;
    PyObject *fast = PySequence_Fast(seq, "keys must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyDict_New();
    uint32_t nw = ix->nwords ? ix->nwords : 1;
    uint64_t one = 0, *active = nw > 1 ? PyMem_Calloc(nw, sizeof(uint64_t)) : &one;
    Py_ssize_t few[64], *scores = nw > 1 ? PyMem_Malloc(64 * (size_t)nw * sizeof(Py_ssize_t)) : few;
    uint32_t first = ROOT;
    uint64_t k0, k1;
    if (!out || !active || !scores) {
        if (out) PyErr_NoMemory();
        goto fail;
    }
    if (n && ix->nwords) {
        if (key_of(items[0], &k0, &k1) < 0) goto fail;
        first = lookup(ix, k0, k1);
        if (first != ROOT && AT(ix, first)->parent != ROOT) first = ROOT;
    }
    if (first == ROOT) goto finish;
    Py_ssize_t alive = 0, stop = n;
    uint32_t prev = first;
    for (uint32_t w = 0; w < nw; w++) {
        active[w] = word_of(AT(ix, first), w) & ix->live[w];
        alive += __builtin_popcountll(active[w]);
    }
    if (!alive) goto finish;
    if (early && alive <= 1) stop = 1;
    Ahead ring[64]; /* keys i+1 .. i+PREFETCH: table slots, then entries, fetched ahead */
    for (Py_ssize_t j = 1; j < stop && j <= PREFETCH; j++)
        if (look_ahead(ix, items, j, ring) < 0) goto fail;
    for (Py_ssize_t i = 1; i < stop; i++) {
        if (i + 2 * PREFETCH < stop) __builtin_prefetch(items[i + 2 * PREFETCH]);
        if (i + PREFETCH < stop && look_ahead(ix, items, i + PREFETCH, ring) < 0) goto fail;
        if (i + PREFETCH / 2 < stop) entry_ahead(ix, ring, i + PREFETCH / 2);
        const Ahead *a = &ring[i & 63];
        uint32_t idx = lookup_h(ix, a->k0, a->k1, a->h);
        const Entry *e = idx == ROOT ? NULL : AT(ix, idx);
        if (!e || e->parent != prev) {
            stop = i;
            break;
        }
        prev = idx;
        int drop = 0;
        for (uint32_t w = 0; w < nw; w++) {
            uint64_t dropped = active[w] & ~word_of(e, w);
            if (!dropped) continue;
            drop = 1;
            active[w] &= ~dropped;
            alive -= __builtin_popcountll(dropped);
            for (; dropped; dropped &= dropped - 1) scores[64 * w + __builtin_ctzll(dropped)] = i;
        }
        if (!alive) {
            stop = i;
            break;
        }
        if (drop && early && alive <= 1) {
            stop = i + 1;
            break;
        }
    }
    for (uint32_t w = 0; w < nw; w++) /* the slots still matching where the walk stopped */
        for (uint64_t left = active[w]; left; left &= left - 1)
            scores[64 * w + __builtin_ctzll(left)] = stop;
    for (uint32_t w = 0; w < nw; w++)
        for (uint64_t b = word_of(AT(ix, first), w) & ix->live[w]; b; b &= b - 1) {
            Py_ssize_t slot = 64 * (Py_ssize_t)w + __builtin_ctzll(b);
            if (slot >= PyList_GET_SIZE(names)) {
                PyErr_SetString(PyExc_IndexError, "names has no entry for a slot");
                goto fail;
            }
            PyObject *score = PyLong_FromSsize_t(scores[slot]);
            if (!score || PyDict_SetItem(out, PyList_GET_ITEM(names, slot), score) < 0) {
                Py_XDECREF(score);
                goto fail;
            }
            Py_DECREF(score);
        }
finish:
    if (nw > 1) {
        PyMem_Free(active);
        PyMem_Free(scores);
    }
    Py_DECREF(fast);
    return out;
fail:
    if (nw > 1) {
        PyMem_Free(active);
        PyMem_Free(scores);
    }
    Py_DECREF(fast);
    Py_XDECREF(out);
    return NULL;
}

/* sweep(max_bits) -> whether stale bits are left: clears up to max_bits bits
 * of retired slots, visiting at most SCAN_PER_SWEEP pool entries. */
static PyObject *Index_sweep(Index *ix, PyObject *arg) {
    long budget = PyLong_AsLong(arg);
    if (budget == -1 && PyErr_Occurred()) return NULL;
    if (budget < 0) {
        PyErr_SetString(PyExc_ValueError, "max_blocks must be >= 0");
        return NULL;
    }
    uint32_t scanned = 0;
    while (budget > 0 && scanned < SCAN_PER_SWEEP) {
        if (ix->sweep_left == 0) { /* start a pass: every slot retired so far */
            int any = 0;
            for (uint32_t s = 0; s < ix->nslots; s++) {
                if (ix->state[s] == S_SWEEPING) ix->state[s] = S_FREE;
                if (ix->state[s] == S_DEAD) {
                    ix->state[s] = S_SWEEPING;
                    ix->sweep_left += ix->size[s];
                    any = 1;
                }
            }
            memset(ix->sweeping, 0, ix->nwords * sizeof(uint64_t));
            for (uint32_t s = 0; s < ix->nslots; s++)
                if (ix->state[s] == S_SWEEPING) ix->sweeping[s >> 6] |= 1ull << (s & 63);
            ix->cursor = 0;
            if (!any) break;
        }
        if (ix->cursor >= ix->pool_len) { /* cannot happen while bits are left */
            PyErr_SetString(PyExc_RuntimeError, "router index: stale count out of step");
            return NULL;
        }
        Entry *e = AT(ix, ix->cursor);
        int done = 1;
        if (e->parent != FREE)
            for (uint32_t w = 0; w < ix->nwords; w++) {
                uint64_t b = word_of(e, w) & ix->sweeping[w];
                for (; b && budget > 0; b &= b - 1, budget--) {
                    uint32_t s = 64 * w + __builtin_ctzll(b);
                    clear_bit(e, s);
                    ix->size[s]--;
                    ix->sweep_left--;
                    ix->stale--;
                }
                if (b) done = 0;
            }
        scanned++;
        if (!done) break;
        uint32_t at = ix->cursor++;
        if (e->parent != FREE) prune(ix, at);
    }
    if (ix->sweep_left == 0)
        for (uint32_t s = 0; s < ix->nslots; s++)
            if (ix->state[s] == S_SWEEPING) ix->state[s] = S_FREE;
    return PyBool_FromLong(ix->stale > 0);
}

static PyObject *Index_stale(Index *ix, PyObject *unused) { return PyLong_FromLongLong(ix->stale); }

static PyObject *Index_size(Index *ix, PyObject *arg) {
    uint32_t slot;
    if (slot_arg(ix, arg, &slot, 1) < 0) return NULL;
    return PyLong_FromLongLong(ix->size[slot]);
}

/* entries() -> [(key, parent key or None, [live slots])], every known key
 * (stale bits left out), in pool order. */
static PyObject *Index_entries(Index *ix, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (uint32_t i = 0; out && i < ix->pool_len; i++) {
        const Entry *e = AT(ix, i);
        if (e->parent == FREE) continue;
        PyObject *slots = PyList_New(0), *key = key_bytes(e), *up = NULL;
        if (slots && key) {
            up = e->parent == ROOT ? Py_NewRef(Py_None) : key_bytes(AT(ix, e->parent));
            for (uint32_t w = 0; up && w < ix->nwords; w++)
                for (uint64_t b = word_of(e, w) & ix->live[w]; b; b &= b - 1) {
                    PyObject *s = PyLong_FromLong(64 * (long)w + __builtin_ctzll(b));
                    if (!s || PyList_Append(slots, s) < 0) Py_CLEAR(up);
                    Py_XDECREF(s);
                    if (!up) break;
                }
        }
        PyObject *row = up ? PyTuple_Pack(3, key, up, slots) : NULL;
        Py_XDECREF(slots);
        Py_XDECREF(key);
        Py_XDECREF(up);
        if (!row || PyList_Append(out, row) < 0) Py_CLEAR(out);
        Py_XDECREF(row);
    }
    return out;
}

/* load(key, parent key or None, slots): one entry of a checked dump, its
 * parent loaded before it. */
static PyObject *Index_load(Index *ix, PyObject *args) {
    PyObject *key, *parent_o, *slots;
    uint64_t k0, k1, p0, p1;
    if (!PyArg_ParseTuple(args, "OOO!", &key, &parent_o, &PyList_Type, &slots)) return NULL;
    if (key_of(key, &k0, &k1) < 0) return NULL;
    uint32_t up = ROOT;
    if (parent_o != Py_None) {
        if (key_of(parent_o, &p0, &p1) < 0) return NULL;
        up = lookup(ix, p0, p1);
        if (up == ROOT) {
            PyErr_SetString(PyExc_ValueError, "the parent is not loaded");
            return NULL;
        }
    }
    if (lookup(ix, k0, k1) != ROOT) {
        PyErr_SetString(PyExc_ValueError, "the key is already loaded");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(slots);
    uint32_t slot, *checked = PyMem_Malloc((size_t)(n + 1) * sizeof(uint32_t));
    if (!checked) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        if (slot_arg(ix, PyList_GET_ITEM(slots, i), &slot, 1) < 0) {
            PyMem_Free(checked);
            return NULL;
        }
        checked[i] = slot;
    }
    uint32_t idx = new_entry(ix, k0, k1, up);
    for (Py_ssize_t i = 0; idx != FREE && i < n; i++) {
        int added = set_bit(AT(ix, idx), checked[i]);
        if (added < 0) idx = FREE;
        else ix->size[checked[i]] += added;
    }
    PyMem_Free(checked);
    if (idx == FREE) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* memory() -> bytes the index has allocated (pool, table, side words). */
static PyObject *Index_memory(Index *ix, PyObject *unused) {
    size_t total = (size_t)ix->nchunks * CHUNK * sizeof(Entry);
    for (uint32_t s = 0; s < SHARDS; s++)
        total += ix->table[s] ? (size_t)(ix->table_mask[s] + 1) * sizeof(uint64_t) : 0;
    for (uint32_t i = 0; i < ix->pool_len; i++)
        if (AT(ix, i)->parent != FREE && AT(ix, i)->ext)
            total += (AT(ix, i)->ext[0] + 1) * sizeof(uint64_t);
    return PyLong_FromSize_t(total);
}

static PyObject *Index_len(Index *ix, PyObject *unused) { return PyLong_FromUnsignedLong(ix->count); }

static void Index_dealloc(Index *ix) {
    for (uint32_t i = 0; i < ix->pool_len; i++)
        if (AT(ix, i)->parent != FREE) free(AT(ix, i)->ext);
    for (uint32_t c = 0; c < ix->nchunks; c++) free(ix->chunks[c]);
    free(ix->chunks);
    for (uint32_t s = 0; s < SHARDS; s++) free(ix->table[s]);
    free(ix->state);
    free(ix->size);
    free(ix->live);
    free(ix->sweeping);
    Py_TYPE(ix)->tp_free((PyObject *)ix);
}

static PyObject *Index_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "Index() takes no arguments");
        return NULL;
    }
    Index *ix = (Index *)type->tp_alloc(type, 0);
    if (ix) ix->free_head = ROOT;
    return (PyObject *)ix;
}

static PyMethodDef Index_methods[] = {
    {"new_slot", (PyCFunction)Index_new_slot, METH_NOARGS, "The lowest free slot, made live."},
    {"retire", (PyCFunction)Index_retire, METH_O, "Retire a live slot (O(1))."},
    {"store", (PyCFunction)Index_store, METH_VARARGS, "store(slot, keys, parent) -> size or -1."},
    {"remove", (PyCFunction)Index_remove, METH_VARARGS, "remove(slot, keys) -> size or -1."},
    {"holds", (PyCFunction)Index_holds, METH_VARARGS, "holds(slot, key) -> bool."},
    {"parent_of", (PyCFunction)Index_parent_of, METH_O, "(known, parent key or None)."},
    {"find", (PyCFunction)(void (*)(void))Index_find, METH_FASTCALL, "find(keys, names, early_exit) -> scores."},
    {"sweep", (PyCFunction)Index_sweep, METH_O, "sweep(max_bits) -> whether stale bits are left."},
    {"stale", (PyCFunction)Index_stale, METH_NOARGS, "Stale bits not swept yet."},
    {"size", (PyCFunction)Index_size, METH_O, "Blocks a live slot holds."},
    {"entries", (PyCFunction)Index_entries, METH_NOARGS, "Every known key, pool order."},
    {"load", (PyCFunction)Index_load, METH_VARARGS, "load(key, parent, slots)."},
    {"memory", (PyCFunction)Index_memory, METH_NOARGS, "Bytes allocated."},
    {"known", (PyCFunction)Index_len, METH_NOARGS, "Known keys."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router._cindex.Index",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The router's index: block keys -> holder slots (see router/native.py).",
    .tp_new = Index_new,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_cindex", .m_size = -1};

PyMODINIT_FUNC PyInit__cindex(void) {
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddObjectRef(m, "Index", (PyObject *)&IndexType) < 0) Py_CLEAR(m);
    return m;
}
