/* Chained block keys with keyed BLAKE2b-128, written from RFC 7693.
 *
 * One call hashes a whole chain: key_i = BLAKE2b(key, digest 16)(key_{i-1} || block_i),
 * starting from a given parent digest. chain_tokens does the same straight from an
 * engine's int64 or int32 token ids, range-checking and narrowing them as it goes.
 * The pure-Python fallback in contract/blocks.py
 * computes the same bytes with hashlib; tests/test_blocks.py checks they agree.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLOCKBYTES 128
#define OUTBYTES 16
#define MAXKEYBYTES 64

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static inline uint64_t load64_le(const uint8_t *p) {
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
           ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) |
           ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline void store64_le(uint8_t *p, uint64_t w) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(w >> (8 * i));
}

static inline uint64_t rotr64(uint64_t w, unsigned c) { return (w >> c) | (w << (64 - c)); }

#define G(a, b, c, d, x, y)         \
    do {                            \
        a = a + b + (x);            \
        d = rotr64(d ^ a, 32);      \
        c = c + d;                  \
        b = rotr64(b ^ c, 24);      \
        a = a + b + (y);            \
        d = rotr64(d ^ a, 16);      \
        c = c + d;                  \
        b = rotr64(b ^ c, 63);      \
    } while (0)

/* One round; its arguments are the round's row of the message schedule SIGMA
 * (RFC 7693 section 2.7), as word numbers. */
#define ROUND(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15) \
    do {                                                                           \
        G(v0, v4, v8, v12, m##s0, m##s1);                                          \
        G(v1, v5, v9, v13, m##s2, m##s3);                                          \
        G(v2, v6, v10, v14, m##s4, m##s5);                                         \
        G(v3, v7, v11, v15, m##s6, m##s7);                                         \
        G(v0, v5, v10, v15, m##s8, m##s9);                                         \
        G(v1, v6, v11, v12, m##s10, m##s11);                                       \
        G(v2, v7, v8, v13, m##s12, m##s13);                                        \
        G(v3, v4, v9, v14, m##s14, m##s15);                                        \
    } while (0)

/* RFC 7693 section 3.2: compression F(h, m, t, f). t < 2**64 here, so its high word is 0.
 * State and message are plain locals, not arrays: the compiler keeps them in registers
 * (spilling what does not fit) instead of storing vectors and reloading words from them,
 * ~15% faster here than the array form. Rounds 10 and 11 repeat rows 0 and 1. */
static void compress(uint64_t h[8], const uint64_t m[16], uint64_t t, int last) {
    uint64_t m0 = m[0], m1 = m[1], m2 = m[2], m3 = m[3], m4 = m[4], m5 = m[5], m6 = m[6],
             m7 = m[7], m8 = m[8], m9 = m[9], m10 = m[10], m11 = m[11], m12 = m[12],
             m13 = m[13], m14 = m[14], m15 = m[15];
    uint64_t v0 = h[0], v1 = h[1], v2 = h[2], v3 = h[3], v4 = h[4], v5 = h[5], v6 = h[6],
             v7 = h[7];
    uint64_t v8 = IV[0], v9 = IV[1], v10 = IV[2], v11 = IV[3], v12 = IV[4] ^ t, v13 = IV[5],
             v14 = last ? ~IV[6] : IV[6], v15 = IV[7];
    ROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    ROUND(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);
    ROUND(11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4);
    ROUND(7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8);
    ROUND(9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13);
    ROUND(2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9);
    ROUND(12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11);
    ROUND(13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10);
    ROUND(6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5);
    ROUND(10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0);
    ROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    ROUND(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);
    h[0] ^= v0 ^ v8;
    h[1] ^= v1 ^ v9;
    h[2] ^= v2 ^ v10;
    h[3] ^= v3 ^ v11;
    h[4] ^= v4 ^ v12;
    h[5] ^= v5 ^ v13;
    h[6] ^= v6 ^ v14;
    h[7] ^= v7 ^ v15;
}

/* compress on a block of bytes (its words little-endian). */
static void compress_bytes(uint64_t h[8], const uint8_t block[BLOCKBYTES], uint64_t t, int last) {
    uint64_t m[16];
    for (int i = 0; i < 16; i++) m[i] = load64_le(block + 8 * i);
    compress(h, m, t, last);
}

/* BLAKE2b of a non-empty message msg[0:len], continuing from state h0 after t0 bytes
 * (the key block, if any). Writes the 16-byte digest to out. */
static void finish(const uint64_t h0[8], uint64_t t0, const uint8_t *msg, size_t len,
                   uint8_t out[OUTBYTES]) {
    uint64_t h[8];
    uint8_t pad[BLOCKBYTES];
    uint64_t t = t0;
    memcpy(h, h0, sizeof(h));
    while (len > BLOCKBYTES) {
        t += BLOCKBYTES;
        compress_bytes(h, msg, t, 0);
        msg += BLOCKBYTES;
        len -= BLOCKBYTES;
    }
    memset(pad, 0, sizeof(pad));
    memcpy(pad, msg, len);
    t += len;
    compress_bytes(h, pad, t, 1);
    store64_le(out, h[0]);
    store64_le(out + 8, h[1]);
}

/* Parameter block for digest length 16 and the given key length; the key, if any,
 * is compressed as the first (non-final) block, because every message here is non-empty. */
static uint64_t keyed_state(uint64_t h[8], const uint8_t *key, size_t keylen) {
    uint8_t block[BLOCKBYTES];
    memcpy(h, IV, sizeof(IV));
    h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ OUTBYTES;
    if (keylen == 0) return 0;
    memset(block, 0, sizeof(block));
    memcpy(block, key, keylen);
    compress_bytes(h, block, BLOCKBYTES, 0);
    return BLOCKBYTES;
}

/* The id at tokens[i] of `itemsize` (4 or 8) bytes, read as unsigned: a negative id of a
 * signed type reads as a huge one, so one comparison checks both ends of the range. */
static inline uint64_t token_at(const uint8_t *tokens, Py_ssize_t itemsize, Py_ssize_t i) {
    if (itemsize == 8) {
        uint64_t v;
        memcpy(&v, tokens + i * 8, 8);
        return v;
    }
    uint32_t v;
    memcpy(&v, tokens + i * 4, 4);
    return v;
}

/* hash_chain's loop for blocks of per_block token ids that fit one compression block
 * with their parent (per_block <= 28; engines use 16): the message words are built
 * straight from the parent digest's words and the narrowed ids, with no byte buffer. */
static void chain_short_tokens(const uint8_t *src, Py_ssize_t n, Py_ssize_t itemsize,
                               Py_ssize_t per_block, const uint64_t h0[8], uint64_t t0,
                               const uint8_t parent[OUTBYTES], uint8_t *out) {
    uint64_t t = t0 + OUTBYTES + 4 * (uint64_t)per_block;
    uint64_t p0 = load64_le(parent), p1 = load64_le(parent + 8);
    for (Py_ssize_t b = 0; b < n; b++) {
        uint64_t m[16] = {p0, p1};
        for (Py_ssize_t j = 0; j < per_block; j++) {
            uint64_t v = (uint32_t)token_at(src, itemsize, b * per_block + j);
            m[2 + j / 2] |= v << (32 * (j & 1));
        }
        uint64_t h[8];
        memcpy(h, h0, sizeof(h));
        compress(h, m, t, 1);
        p0 = h[0], p1 = h[1];
        store64_le(out + b * OUTBYTES, p0);
        store64_le(out + b * OUTBYTES + 8, p1);
    }
}

/* hash_chain's loop for every other case: raw bytes (itemsize 0), or blocks of ids too
 * long for one compression. msg holds OUTBYTES + block_bytes: the parent key, then the
 * block as bytes. */
static void chain_blocks(const uint8_t *src, Py_ssize_t n, Py_ssize_t itemsize,
                         Py_ssize_t block_bytes, const uint64_t h0[8], uint64_t t0,
                         const uint8_t parent[OUTBYTES], uint8_t *msg, uint8_t *out) {
    Py_ssize_t per_block = block_bytes / 4;
    memcpy(msg, parent, OUTBYTES);
    for (Py_ssize_t b = 0; b < n; b++) {
        uint8_t *dst = msg + OUTBYTES;
        if (itemsize == 0) {
            memcpy(dst, src + b * block_bytes, (size_t)block_bytes);
        } else {
            for (Py_ssize_t i = b * per_block; i < (b + 1) * per_block; i++, dst += 4) {
                uint32_t v = (uint32_t)token_at(src, itemsize, i);
                dst[0] = (uint8_t)v, dst[1] = (uint8_t)(v >> 8);
                dst[2] = (uint8_t)(v >> 16), dst[3] = (uint8_t)(v >> 24);
            }
        }
        finish(h0, t0, msg, (size_t)(OUTBYTES + block_bytes), out + b * OUTBYTES);
        memcpy(msg, out + b * OUTBYTES, OUTBYTES);
    }
}

/* The keys of n blocks of src, each hashed as block_bytes bytes after its parent key.
 * itemsize 0: a block is block_bytes bytes of src as they are; 4 or 8: a block is
 * block_bytes / 4 native integers of that size, hashed as little-endian int32. */
static PyObject *hash_chain(const uint8_t *src, Py_ssize_t n, Py_ssize_t itemsize,
                            Py_ssize_t block_bytes, const Py_buffer *key,
                            const Py_buffer *parent) {
    if (key->len > MAXKEYBYTES) {
        PyErr_Format(PyExc_ValueError, "key must be at most %d bytes", MAXKEYBYTES);
        return NULL;
    }
    if (parent->len != OUTBYTES) {
        PyErr_Format(PyExc_ValueError, "parent must be %d bytes", OUTBYTES);
        return NULL;
    }
    int short_tokens = itemsize != 0 && OUTBYTES + block_bytes <= BLOCKBYTES;
    PyObject *result = PyBytes_FromStringAndSize(NULL, n * OUTBYTES);
    uint8_t *msg = short_tokens ? NULL : PyMem_Malloc((size_t)(OUTBYTES + block_bytes));
    if (msg == NULL && !short_tokens) {
        Py_XDECREF(result);
        return PyErr_NoMemory();
    }
    if (result == NULL) {
        PyMem_Free(msg);
        return NULL;
    }
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    Py_BEGIN_ALLOW_THREADS
    uint64_t h0[8];
    uint64_t t0 = keyed_state(h0, key->buf, (size_t)key->len);
    if (short_tokens)
        chain_short_tokens(src, n, itemsize, block_bytes / 4, h0, t0, parent->buf, out);
    else
        chain_blocks(src, n, itemsize, block_bytes, h0, t0, parent->buf, msg, out);
    Py_END_ALLOW_THREADS
    PyMem_Free(msg);
    return result;
}

static PyObject *chain(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data, key, parent;
    Py_ssize_t block_bytes;
    if (!PyArg_ParseTuple(args, "y*ny*y*", &data, &block_bytes, &key, &parent)) return NULL;
    PyObject *result = NULL;
    if (block_bytes <= 0)
        PyErr_SetString(PyExc_ValueError, "block_bytes must be positive");
    else
        result = hash_chain(data.buf, data.len / block_bytes, 0, block_bytes, &key, &parent);
    PyBuffer_Release(&data);
    PyBuffer_Release(&key);
    PyBuffer_Release(&parent);
    return result;
}

static PyObject *chain_tokens(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data, key, parent;
    Py_ssize_t itemsize, per_block;
    if (!PyArg_ParseTuple(args, "y*nny*y*", &data, &itemsize, &per_block, &key, &parent))
        return NULL;
    PyObject *result = NULL;
    const uint8_t *tokens = data.buf;
    int whole = (itemsize == 4 || itemsize == 8) && data.len % itemsize == 0;
    Py_ssize_t count = whole ? data.len / itemsize : 0;
    int in_range = 1;
    for (Py_ssize_t i = 0; i < count; i++) in_range &= token_at(tokens, itemsize, i) <= 0x7fffffffu;
    if (!whole)
        PyErr_SetString(PyExc_ValueError, "tokens must be whole ids of 4 or 8 bytes");
    else if (per_block <= 0)
        PyErr_SetString(PyExc_ValueError, "tokens_per_block must be positive");
    else if (!in_range)
        PyErr_SetString(PyExc_OverflowError, "a token id is outside [0, 2**31 - 1]");
    else
        result = hash_chain(tokens, count / per_block, itemsize, 4 * per_block, &key, &parent);
    PyBuffer_Release(&data);
    PyBuffer_Release(&key);
    PyBuffer_Release(&parent);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(data, block_bytes, key, parent) -> bytes\n\n"
     "Keys of the len(data) // block_bytes full blocks of data: key_i is keyed\n"
     "BLAKE2b with a 16-byte digest of key_{i-1} || block_i, key_{-1} = parent."},
    {"chain_tokens", chain_tokens, METH_VARARGS,
     "chain_tokens(tokens, itemsize, tokens_per_block, key, parent) -> bytes\n\n"
     "chain() over tokens_per_block token ids a block, hashed as little-endian int32,\n"
     "read from a buffer of native integers of itemsize (4 or 8) bytes, so no int32\n"
     "copy is made first. OverflowError if any id (tail included) is outside\n"
     "[0, 2**31 - 1]; negative ids of signed types count as outside."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blake2chain", "Chained keyed BLAKE2b-128 block keys.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__blake2chain(void) { return PyModule_Create(&module); }
