/* _cindex.h: the data of router/_cindex.c (see its opening comment), shared
 * by the table and pool (_cindex_core.c) and the Python methods (_cindex.c). */
#ifndef KVS_CINDEX_H
#define KVS_CINDEX_H
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

static inline int any_bit(const Entry *e) {
    if (e->bits) return 1;
    if (e->ext)
        for (uint64_t w = 1; w <= e->ext[0]; w++)
            if (e->ext[w]) return 1;
    return 0;
}

static inline int set_bit(Entry *e, uint32_t slot) { /* 1 if newly set, -1 no memory */
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

static inline void clear_bit(Entry *e, uint32_t slot) {
    uint32_t w = slot >> 6;
    uint64_t b = ~(1ull << (slot & 63));
    if (w == 0)
        e->bits &= b;
    else if (e->ext && w <= e->ext[0])
        e->ext[w] &= b;
}

static inline uint32_t shard_of(uint64_t h) { return (uint32_t)(h >> (64 - SHARD_BITS)); }

static inline uint32_t lookup_h(const Index *ix, uint64_t k0, uint64_t k1, uint64_t h) {
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

/* A block key (16 bytes) as two words; -1 (ValueError) if it is not one. */
static inline int cindex_key_of(PyObject *o, uint64_t *k0, uint64_t *k1) {
    if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) != 16) {
        PyErr_SetString(PyExc_ValueError, "a block key is 16 bytes");
        return -1;
    }
    const char *p = PyBytes_AS_STRING(o);
    memcpy(k0, p, 8);
    memcpy(k1, p + 8, 8);
    return 0;
}

/* _cindex_core.c: the table and the pool. */
uint32_t cindex_new_entry(Index *ix, uint64_t k0, uint64_t k1, uint32_t parent);
void cindex_prune(Index *ix, uint32_t idx);
uint64_t *cindex_keys_of(PyObject *seq, Py_ssize_t *n);
int cindex_ensure_slot(Index *ix, uint32_t slot);
int cindex_slot_arg(Index *ix, PyObject *o, uint32_t *slot, int live);

#endif
