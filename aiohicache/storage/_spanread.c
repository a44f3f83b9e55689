/* Reading a span of adjacent file-store records into the callers' buffers and checking
 * them, with the GIL released for the whole span (aiohicache.storage._spanread).
 *
 * Why native: for small pages (64 KiB) the Python reader holds the GIL for about as long
 * as the kernel takes to copy a page (header checks, the checksum, the iovec list), so the
 * I/O threads take turns instead of copying side by side, and each turn is a GIL hand-off.
 * Here a thread takes the GIL once to enter and once to leave a span.
 *
 * The checksum is xxh3-64 from the `xxhash` package the store already uses: its address is
 * handed in by the Python side (`_reader.py`), which checks it against the package's own
 * function first. Nothing of xxhash is built here.
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
#include <string.h>
#include <sys/uio.h>

#define HEADER_SIZE 64
#define PREFIX_SIZE 48
#define VALUE_AT 48
#define KEY_ID_AT 56

typedef uint64_t (*hash_fn)(const void *data, size_t len, uint64_t seed);

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

typedef struct {
    int fd;
    long long offset;
    Py_ssize_t payload, per_call, num;
    const unsigned char *prefix, *key_ids;
    Py_buffer *dests;
    unsigned char *headers; /* per_call * HEADER_SIZE */
    struct iovec *iov;      /* per_call * 2 */
    char *outcomes;         /* 1: filled; 0: rejected or not reached */
    hash_fn hash;
} span_t;

/* Check the `got_records` records of one call that starts at record `lo`. */
static void check_records(span_t *s, Py_ssize_t lo, Py_ssize_t count) {
    for (Py_ssize_t k = 0; k < count; k++) {
        const unsigned char *header = s->headers + k * HEADER_SIZE;
        const unsigned char *key_id = s->key_ids + (lo + k) * 8;
        if (memcmp(header, s->prefix, PREFIX_SIZE) != 0) continue;
        if (memcmp(header + KEY_ID_AT, key_id, 8) != 0) continue;
        uint64_t value = s->hash(s->dests[lo + k].buf, (size_t)s->payload, le64(key_id));
        if (value == le64(header + VALUE_AT)) s->outcomes[lo + k] = 1;
    }
}

/* Read and check every record; 0, or the errno of a failed read (records after it are not
 * reached). A file that ends early (a short read) stops the span without an error. */
static int read_span(span_t *s) {
    const Py_ssize_t size = HEADER_SIZE + s->payload;
    for (Py_ssize_t lo = 0; lo < s->num; lo += s->per_call) {
        Py_ssize_t count = s->num - lo < s->per_call ? s->num - lo : s->per_call;
        for (Py_ssize_t k = 0; k < count; k++) {
            s->iov[2 * k].iov_base = s->headers + k * HEADER_SIZE;
            s->iov[2 * k].iov_len = HEADER_SIZE;
            s->iov[2 * k + 1].iov_base = s->dests[lo + k].buf;
            s->iov[2 * k + 1].iov_len = (size_t)s->payload;
        }
        ssize_t got;
        do {
            got = preadv(s->fd, s->iov, (int)(2 * count), (off_t)(s->offset + lo * size));
        } while (got < 0 && errno == EINTR);
        if (got < 0) return errno;
        Py_ssize_t whole = (Py_ssize_t)got / size;
        check_records(s, lo, whole < count ? whole : count);
        if (whole < count) return 0; /* cut off: the rest stay rejected */
    }
    return 0;
}

static void release_all(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

/* Take a writable, contiguous buffer of `payload` bytes from each item of `seq`. */
static Py_buffer *take_dests(PyObject *seq, Py_ssize_t payload) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (views == NULL) return (Py_buffer *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
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

static PyObject *read_checked(PyObject *module, PyObject *args) {
    span_t s = {0};
    unsigned long long hash_address;
    Py_buffer prefix, key_ids, outcomes;
    PyObject *dests_obj;
    if (!PyArg_ParseTuple(args, "iLnny*y*Ow*K", &s.fd, &s.offset, &s.payload, &s.per_call,
                          &prefix, &key_ids, &dests_obj, &outcomes, &hash_address))
        return NULL;
    PyObject *seq = NULL, *result = NULL;
    if (prefix.len != PREFIX_SIZE || s.payload <= 0 || s.per_call <= 0 || s.offset < 0 ||
        hash_address == 0) {
        PyErr_SetString(PyExc_ValueError, "read_checked: bad prefix, sizes or hash");
        goto done;
    }
    seq = PySequence_Fast(dests_obj, "read_checked: dests must be a sequence");
    if (seq == NULL) goto done;
    s.num = PySequence_Fast_GET_SIZE(seq);
    if (key_ids.len != 8 * s.num || outcomes.len != s.num) {
        PyErr_SetString(PyExc_ValueError, "read_checked: key ids or outcomes do not match");
        goto done;
    }
    s.prefix = prefix.buf;
    s.key_ids = key_ids.buf;
    s.outcomes = outcomes.buf;
    s.hash = (hash_fn)(uintptr_t)hash_address;
    memset(s.outcomes, 0, (size_t)s.num);
    s.dests = take_dests(seq, s.payload);
    if (s.dests == NULL) goto done;
    s.headers = PyMem_Malloc((size_t)s.per_call * HEADER_SIZE);
    s.iov = PyMem_Malloc((size_t)s.per_call * 2 * sizeof(struct iovec));
    if (s.headers == NULL || s.iov == NULL) {
        PyErr_NoMemory();
    } else {
        int err;
        Py_BEGIN_ALLOW_THREADS
        err = read_span(&s);
        Py_END_ALLOW_THREADS
        if (err) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
        } else {
            result = Py_NewRef(Py_None);
        }
    }
    PyMem_Free(s.headers);
    PyMem_Free(s.iov);
    release_all(s.dests, s.num);
    PyMem_Free(s.dests);
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&key_ids);
    PyBuffer_Release(&outcomes);
    return result;
}

static PyMethodDef methods[] = {
    {"read_checked", read_checked, METH_VARARGS,
     "read_checked(fd, offset, payload, per_call, prefix, key_ids, dests, outcomes, hash)\n"
     "Read adjacent records from `offset` into `dests` (per_call records per preadv) and\n"
     "set outcomes[i] to 1 where record i's header and checksum match. The GIL is released\n"
     "throughout. Raises OSError if a read fails (outcomes hold what was checked before)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_spanread", "Checked reads of file-store spans, GIL released.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__spanread(void) { return PyModule_Create(&module_def); }
