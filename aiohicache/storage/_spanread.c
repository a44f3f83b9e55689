/* Reading a span of adjacent file-store records into the callers' buffers and checking
 * them, with the GIL released for the whole span (aiohicache.storage._spanread).
 *
 * Why native: for small pages (64 KiB) the Python reader holds the GIL for about as long
 * as the kernel takes to copy a page (header checks, the checksum, the iovec list), so the
 * I/O threads take turns instead of copying side by side, and each turn is a GIL hand-off.
 * Here a thread takes the GIL once to enter and once to leave a span.
 *
 * Records that fit a chunk are read several per `preadv` (headers into a scratch buffer,
 * payloads straight into their buffers) and checked while the chunk is in cache; a larger
 * record is read a chunk at a time into its buffer and hashed piece by piece.
 *
 * The checksum is xxh3-64 from the `xxhash` package the store already uses: the addresses
 * of its public functions are bound once (`bind`) by the Python side (`_native.py`), which
 * checks them against the package's own binding first. Nothing of xxhash is built here.
 *
 * Layout of a record (storage/base.py): a 64-byte header, then the payload. The header's
 * first 48 bytes are fixed per format (magic .. payload length), bytes 48..55 hold the
 * payload's checksum, 56..63 the key id, which is also the checksum's seed (little-endian).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#define HEADER_SIZE 64
#define PREFIX_SIZE 48
#define VALUE_AT 48
#define KEY_ID_AT 56

#ifndef IOV_MAX
#define IOV_MAX 16
#endif

/* xxhash's public API (xxhash.h), bound by address. */
typedef uint64_t (*oneshot_fn)(const void *data, size_t len, uint64_t seed);
typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *state);
typedef int (*reset_fn)(void *state, uint64_t seed);
typedef int (*update_fn)(void *state, const void *data, size_t len);
typedef uint64_t (*digest_fn)(const void *state);

static struct {
    oneshot_fn oneshot;
    create_fn create;
    free_fn free;
    reset_fn reset;
    update_fn update;
    digest_fn digest;
} xxh3;

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

typedef struct {
    int fd;
    long long offset;
    Py_ssize_t payload, chunk, per_call, num;
    const unsigned char *prefix, *key_ids;
    Py_buffer *dests;
    unsigned char *headers; /* per_call * HEADER_SIZE */
    struct iovec *iov;      /* per_call * 2 */
    char *outcomes;         /* 1: filled; 0: rejected or not reached */
} span_t;

/* Whether `header` is one of the format's and holds record i's key id. */
static int header_ok(const span_t *s, const unsigned char *header, Py_ssize_t i) {
    return memcmp(header, s->prefix, PREFIX_SIZE) == 0 &&
           memcmp(header + KEY_ID_AT, s->key_ids + i * 8, 8) == 0;
}

/* Check the `count` records of one call that starts at record `lo`. */
static void check_records(span_t *s, Py_ssize_t lo, Py_ssize_t count) {
    for (Py_ssize_t k = 0; k < count; k++) {
        const unsigned char *header = s->headers + k * HEADER_SIZE;
        if (!header_ok(s, header, lo + k)) continue;
        uint64_t value = xxh3.oneshot(s->dests[lo + k].buf, (size_t)s->payload,
                                      le64(s->key_ids + (lo + k) * 8));
        if (value == le64(header + VALUE_AT)) s->outcomes[lo + k] = 1;
    }
}

/* preadv until every byte asked for has come or the file ends (a read of 0 bytes): a
 * short read that is not the end (a network file system, a signal) is read on. Returns
 * the bytes read, or -1 with errno set. `iov` is consumed (changed in place). */
static ssize_t preadv_full(int fd, struct iovec *iov, int count, off_t at) {
    ssize_t total = 0;
    while (count > 0) {
        ssize_t got = preadv(fd, iov, count, at + total);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return -1;
        if (got == 0) break;
        total += got;
        while (count > 0 && (size_t)got >= iov->iov_len) { /* drop the buffers filled */
            got -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) { /* the rest of a buffer partly filled */
            iov->iov_base = (char *)iov->iov_base + got;
            iov->iov_len -= (size_t)got;
        }
    }
    return total;
}

/* Records that each fit a chunk: `per_call` of them per preadv. */
static int read_whole(span_t *s) {
    const Py_ssize_t size = HEADER_SIZE + s->payload;
    for (Py_ssize_t lo = 0; lo < s->num; lo += s->per_call) {
        Py_ssize_t count = s->num - lo < s->per_call ? s->num - lo : s->per_call;
        for (Py_ssize_t k = 0; k < count; k++) {
            s->iov[2 * k].iov_base = s->headers + k * HEADER_SIZE;
            s->iov[2 * k].iov_len = HEADER_SIZE;
            s->iov[2 * k + 1].iov_base = s->dests[lo + k].buf;
            s->iov[2 * k + 1].iov_len = (size_t)s->payload;
        }
        ssize_t got = preadv_full(s->fd, s->iov, (int)(2 * count),
                                  (off_t)(s->offset + (long long)lo * size));
        if (got < 0) return errno;
        Py_ssize_t whole = (Py_ssize_t)got / size;
        check_records(s, lo, whole < count ? whole : count);
        if (whole < count) return 0; /* cut off: the rest stay rejected */
    }
    return 0;
}

/* Read the rest of record i's payload after its first `done` bytes, a chunk at a time,
 * hashing as it lands: 1 if all of it came, 0 if the file ended, -1 on an error. */
static int read_rest(span_t *s, Py_ssize_t i, void *state, size_t done) {
    unsigned char *dest = s->dests[i].buf;
    off_t at = (off_t)(s->offset + (long long)i * (HEADER_SIZE + s->payload) + HEADER_SIZE);
    while (done < (size_t)s->payload) {
        size_t n = (size_t)s->payload - done;
        if (n > (size_t)s->chunk) n = (size_t)s->chunk;
        struct iovec piece = {dest + done, n};
        ssize_t got = preadv_full(s->fd, &piece, 1, at + (off_t)done);
        if (got < 0) return -1;
        if ((size_t)got < n) return 0;
        xxh3.update(state, dest + done, n);
        done += n;
    }
    return 1;
}

/* Records larger than a chunk: each read (and hashed) a chunk at a time. */
static int read_pieces(span_t *s, void *state) {
    const size_t first = (size_t)(s->chunk - HEADER_SIZE);
    for (Py_ssize_t i = 0; i < s->num; i++) {
        unsigned char *dest = s->dests[i].buf;
        struct iovec iov[2] = {{s->headers, HEADER_SIZE}, {dest, first}};
        off_t at = (off_t)(s->offset + (long long)i * (HEADER_SIZE + s->payload));
        ssize_t got = preadv_full(s->fd, iov, 2, at);
        if (got < 0) return errno;
        if ((size_t)got < HEADER_SIZE + first) return 0; /* cut off */
        if (!header_ok(s, s->headers, i)) continue;
        xxh3.reset(state, le64(s->key_ids + i * 8));
        xxh3.update(state, dest, first);
        int whole = read_rest(s, i, state, first);
        if (whole < 0) return errno;
        if (whole == 0) return 0;
        if (xxh3.digest(state) == le64(s->headers + VALUE_AT)) s->outcomes[i] = 1;
    }
    return 0;
}

/* Read and check every record; 0, or the errno of a failed read (records after it are not
 * reached). A file that ends early (a short read) stops the span without an error. */
static int read_span(span_t *s) {
    if (HEADER_SIZE + s->payload <= s->chunk) return read_whole(s);
    void *state = xxh3.create();
    if (state == NULL) return ENOMEM;
    int err = read_pieces(s, state);
    xxh3.free(state);
    return err;
}

static void release_all(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

/* Take a writable, contiguous buffer of `payload` bytes from each item of `seq`. */
static Py_buffer *take_dests(PyObject *seq, Py_ssize_t payload) {
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (views == NULL) return (Py_buffer *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        if (PyObject_GetBuffer(item, &views[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0 ||
            views[i].len != payload) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "buffer %zd holds %zd bytes, not %zd", i,
                             views[i].len, payload);
            else
                i--; /* views[i] was not taken */
            release_all(views, i + 1);
            PyMem_Free(views);
            return NULL;
        }
    }
    return views;
}

/* The sizes of a call, checked; -1 with an exception set if they are bad. */
static int check_sizes(span_t *s, const Py_buffer *prefix, const Py_buffer *key_ids,
                       const Py_buffer *outcomes) {
    if (xxh3.oneshot == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "read_checked: bind() the hash functions first");
        return -1;
    }
    if (prefix->len != PREFIX_SIZE || s->payload < 0 || s->chunk <= HEADER_SIZE ||
        s->offset < 0) {
        PyErr_SetString(PyExc_ValueError, "read_checked: bad prefix or sizes");
        return -1;
    }
    if (key_ids->len != 8 * s->num || outcomes->len != s->num) {
        PyErr_SetString(PyExc_ValueError, "read_checked: key ids or outcomes do not match");
        return -1;
    }
    /* every record's offset (offset + i * record size) is then computed without overflow */
    long long span, end;
    if (s->payload > PY_SSIZE_T_MAX - HEADER_SIZE ||
        __builtin_mul_overflow((long long)s->num, HEADER_SIZE + (long long)s->payload, &span) ||
        __builtin_add_overflow(s->offset, span, &end)) {
        PyErr_SetString(PyExc_ValueError, "read_checked: the span ends past the largest offset");
        return -1;
    }
    s->per_call = s->chunk / (HEADER_SIZE + s->payload);
    if (s->per_call > IOV_MAX / 2) s->per_call = IOV_MAX / 2;
    if (s->per_call < 1) s->per_call = 1; /* pieces: one header */
    return 0;
}

/* Read the span with the GIL released; None, or NULL with an exception set. */
static PyObject *run_span(span_t *s) {
    PyObject *result = NULL;
    s->headers = PyMem_Malloc((size_t)s->per_call * HEADER_SIZE);
    s->iov = PyMem_Malloc((size_t)s->per_call * 2 * sizeof(struct iovec));
    if (s->headers == NULL || s->iov == NULL) {
        PyErr_NoMemory();
    } else {
        int err;
        Py_BEGIN_ALLOW_THREADS
        err = read_span(s);
        Py_END_ALLOW_THREADS
        if (err) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
        } else {
            result = Py_NewRef(Py_None);
        }
    }
    PyMem_Free(s->headers);
    PyMem_Free(s->iov);
    return result;
}

static PyObject *read_checked(PyObject *module, PyObject *args) {
    (void)module;
    span_t s = {0};
    Py_buffer prefix, key_ids, outcomes;
    PyObject *dests_obj;
    if (!PyArg_ParseTuple(args, "iLnny*y*Ow*", &s.fd, &s.offset, &s.payload, &s.chunk,
                          &prefix, &key_ids, &dests_obj, &outcomes))
        return NULL;
    PyObject *result = NULL;
    /* NOTE: a tuple, not the caller's list: taking a buffer can run Python code (3.12's
     * __buffer__) that could change a list under the loop over it */
    PyObject *seq = PySequence_Tuple(dests_obj);
    if (seq != NULL) {
        s.num = PyTuple_GET_SIZE(seq);
        if (check_sizes(&s, &prefix, &key_ids, &outcomes) == 0) {
            s.prefix = prefix.buf;
            s.key_ids = key_ids.buf;
            s.outcomes = outcomes.buf;
            memset(s.outcomes, 0, (size_t)s.num);
            s.dests = take_dests(seq, s.payload);
            if (s.dests != NULL) {
                result = run_span(&s);
                release_all(s.dests, s.num);
                PyMem_Free(s.dests);
            }
        }
        Py_DECREF(seq);
    }
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&key_ids);
    PyBuffer_Release(&outcomes);
    return result;
}

/* The checksum of each payload (seeded with its key id), little-endian u64s. */
static PyObject *checksums(PyObject *module, PyObject *args) {
    (void)module;
    Py_buffer key_ids;
    PyObject *payloads_obj;
    if (!PyArg_ParseTuple(args, "y*O", &key_ids, &payloads_obj)) return NULL;
    PyObject *seq = PySequence_Tuple(payloads_obj), *out = NULL;
    Py_ssize_t n = seq == NULL ? 0 : PyTuple_GET_SIZE(seq), taken = 0;
    Py_buffer *views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (seq == NULL || views == NULL) {
        if (views == NULL) PyErr_NoMemory();
        goto done;
    }
    if (xxh3.oneshot == NULL || key_ids.len != 8 * n) {
        PyErr_SetString(PyExc_ValueError, "checksums: not bound, or key ids do not match");
        goto done;
    }
    for (; taken < n; taken++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, taken), &views[taken], PyBUF_SIMPLE) < 0)
            goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (out == NULL) goto done;
    unsigned char *values = (unsigned char *)PyBytes_AS_STRING(out);
    const unsigned char *ids = key_ids.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t value = xxh3.oneshot(views[i].buf, (size_t)views[i].len, le64(ids + 8 * i));
        for (int b = 0; b < 8; b++) values[8 * i + b] = (unsigned char)(value >> (8 * b));
    }
    Py_END_ALLOW_THREADS
done:
    release_all(views, taken);
    PyMem_Free(views);
    Py_XDECREF(seq);
    PyBuffer_Release(&key_ids);
    return out;
}

typedef struct {
    uintptr_t start, end;
    Py_ssize_t index;
} extent_t;

static int by_start(const void *a, const void *b) {
    uintptr_t x = ((const extent_t *)a)->start, y = ((const extent_t *)b)->start;
    return (x > y) - (x < y);
}

/* The first pair of `extents` (sorted by start) whose bytes overlap, or (-1, -1). */
static void overlapping(const extent_t *extents, Py_ssize_t n, Py_ssize_t *i, Py_ssize_t *j) {
    *i = *j = -1;
    Py_ssize_t widest = 0; /* of those so far, the one that ends last */
    for (Py_ssize_t k = 1; k < n; k++) {
        if (extents[k].start < extents[widest].end && extents[k].end > extents[k].start) {
            *i = extents[widest].index < extents[k].index ? extents[widest].index
                                                         : extents[k].index;
            *j = extents[widest].index < extents[k].index ? extents[k].index
                                                         : extents[widest].index;
            return;
        }
        if (extents[k].end > extents[widest].end) widest = k;
    }
}

static PyObject *first_overlap(PyObject *module, PyObject *arg) {
    (void)module;
    PyObject *seq = PySequence_Tuple(arg);
    if (seq == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq), i, j;
    extent_t *extents = PyMem_Calloc((size_t)(n ? n : 1), sizeof(extent_t));
    PyObject *result = NULL;
    if (extents == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, k), &view, PyBUF_SIMPLE) < 0) goto done;
        extents[k].start = (uintptr_t)view.buf;
        extents[k].end = (uintptr_t)view.buf + (uintptr_t)view.len;
        extents[k].index = k;
        PyBuffer_Release(&view);
    }
    qsort(extents, (size_t)n, sizeof(extent_t), by_start);
    overlapping(extents, n, &i, &j);
    result = i < 0 ? Py_NewRef(Py_None) : Py_BuildValue("(nn)", i, j);
done:
    PyMem_Free(extents);
    Py_DECREF(seq);
    return result;
}

/* Whether `a` (bind's arguments, in its order) are the functions bound. */
static int bound_to(const unsigned long long a[6]) {
    const uintptr_t bound[6] = {(uintptr_t)xxh3.oneshot, (uintptr_t)xxh3.create,
                                (uintptr_t)xxh3.free,    (uintptr_t)xxh3.reset,
                                (uintptr_t)xxh3.update,  (uintptr_t)xxh3.digest};
    for (int i = 0; i < 6; i++) {
        if (bound[i] != (uintptr_t)a[i]) return 0;
    }
    return 1;
}

static PyObject *bind(PyObject *module, PyObject *args) {
    unsigned long long a[6];
    (void)module;
    if (!PyArg_ParseTuple(args, "KKKKKK", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5]))
        return NULL;
    if (xxh3.oneshot != NULL) { /* spans may be running: never rebound under them */
        /* NOTE: the same functions again are the package imported anew (importlib.reload,
         * sys.modules cleared): this module's state outlives that, and nothing changes */
        if (bound_to(a)) Py_RETURN_NONE;
        PyErr_SetString(PyExc_RuntimeError, "bind: already bound to other functions");
        return NULL;
    }
    for (int i = 0; i < 6; i++) {
        if (a[i] == 0) {
            PyErr_SetString(PyExc_ValueError, "bind: a null function");
            return NULL;
        }
    }
    xxh3.oneshot = (oneshot_fn)(uintptr_t)a[0];
    xxh3.create = (create_fn)(uintptr_t)a[1];
    xxh3.free = (free_fn)(uintptr_t)a[2];
    xxh3.reset = (reset_fn)(uintptr_t)a[3];
    xxh3.update = (update_fn)(uintptr_t)a[4];
    xxh3.digest = (digest_fn)(uintptr_t)a[5];
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"checksums", checksums, METH_VARARGS,
     "checksums(key_ids, payloads) -> bytes\n"
     "The xxh3-64 of each payload seeded with its key id (8 bytes each in key_ids), as\n"
     "little-endian u64s; the GIL released while hashing."},
    {"first_overlap", first_overlap, METH_O,
     "first_overlap(buffers) -> (i, j) | None\n"
     "The first two buffers (i < j) whose bytes overlap, or None: one sort of their extents."},
    {"bind", bind, METH_VARARGS,
     "bind(oneshot, create_state, free_state, reset_with_seed, update, digest)\n"
     "The addresses of xxhash's XXH3_64bits_withSeed, XXH3_createState, XXH3_freeState,\n"
     "XXH3_64bits_reset_withSeed, XXH3_64bits_update and XXH3_64bits_digest. Once:\n"
     "the same functions again change nothing, others are refused (RuntimeError)."},
    {"read_checked", read_checked, METH_VARARGS,
     "read_checked(fd, offset, payload, chunk, prefix, key_ids, dests, outcomes)\n"
     "Read adjacent records from `offset` into `dests`, about `chunk` bytes per preadv, and\n"
     "set outcomes[i] to 1 where record i's header and checksum match. The GIL is released\n"
     "throughout. Raises OSError if a read fails (outcomes hold what was checked before)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_spanread", "Checked reads of file-store spans, GIL released.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__spanread(void) { return PyModule_Create(&module_def); }
