// Page-index KV copies between the device pool and the host pool (either direction).
//
// Launch contract
// ---------------
// Both pools are seen as bytes. One *chunk* is the KV of one page for one (kv, layer) pair:
// page_size * row_bytes contiguous bytes on both sides, in every layout the cache uses:
//   device      [num_kv, layers, pages, page_size, row]
//   layer_first [num_kv, layers, pages, page_size, row]   (same shape as the device pool)
//   page_first  [pages, num_kv, layers, page_size, row]
// so a side is described by three byte strides (page, kv, layer) and item (i, kv, layer)
// moves chunk_bytes from
//   src + src_pages[i] * src_page_stride + kv * src_kv_stride + layer * src_layer_stride
// to the same expression on the dst side. MHA has num_kv = 2 (K and V), MLA num_kv = 1.
// Layers [layer_begin, layer_end) are copied: one layer (layer-wise load) or all of them.
//
// - Indices are page ids (int64, device memory), not token ids: page_size times fewer than a
//   token-index kernel reads.
// - A negative index on either side skips the pair (padding in a fixed-size batch).
// - Work is a flat range of VEC-byte units, item-major: consecutive threads take consecutive
//   units, so a warp reads and writes one contiguous run of a chunk (or the ends of two), and
//   a chunk of any size, 16 B to 288 KB, keeps every lane busy.
// - Each thread issues UNROLL loads before its stores: a PCIe read is latency-bound, and
//   bandwidth = bytes in flight / round trip, so the loads must overlap.
// - The grid is a CTA *budget* chosen by the caller (e.g. 1..32) so the copy leaves the
//   forward pass its SMs; threads stride over the units.
// - Streaming cache hints (ld/st .cs): KV passes through once; the forward pass keeps L2.
// - copy_pages_v16 needs src, dst, every stride and chunk_bytes to be multiples of 16;
//   _v8, _v4, _v2 and _v1 likewise. The engine picks the widest that fits (576 B and 656 B
//   rows are multiples of 16; _v1 covers any byte layout).
// - Unit and item counters are 32-bit (the host splits launches at 2^31 units); addresses
//   are 64-bit.
// No headers: CuPy compiles this with NVRTC, which has none; CI compile-checks it with both
// nvcc and NVRTC.

#define AIOHICACHE_UNROLL 4

template <typename Vec>
__device__ __forceinline__ Vec load_streaming(const Vec* p) { return __ldcs(p); }

template <typename Vec>
__device__ __forceinline__ void store_streaming(Vec* p, Vec v) { __stcs(p, v); }

// __ldcs/__stcs have no 16-bit or 8-bit overloads: those widths are rare (odd rows), plain
// accesses are fine for them.
template <>
__device__ __forceinline__ unsigned short load_streaming(const unsigned short* p) { return *p; }
template <>
__device__ __forceinline__ void store_streaming(unsigned short* p, unsigned short v) { *p = v; }
template <>
__device__ __forceinline__ unsigned char load_streaming(const unsigned char* p) { return *p; }
template <>
__device__ __forceinline__ void store_streaming(unsigned char* p, unsigned char v) { *p = v; }

struct Side {
    long long page_stride, kv_stride, layer_stride;
};

// Byte offset of unit `unit` on one side, or -1 for a skipped item.
__device__ __forceinline__ long long unit_offset(
        unsigned int unit, unsigned int units_per_chunk, unsigned int vec_bytes,
        const long long* __restrict__ pages, const Side& side, unsigned int num_kv,
        unsigned int layers, int layer_begin) {
    const unsigned int item = unit / units_per_chunk;
    const unsigned int within = unit - item * units_per_chunk;
    const unsigned int per_page = num_kv * layers;
    const unsigned int i = item / per_page;
    const unsigned int rest = item - i * per_page;
    const unsigned int kv = rest / layers;
    const unsigned int layer = layer_begin + (rest - kv * layers);
    const long long page = pages[i];
    if (page < 0) {
        return -1;
    }
    return page * side.page_stride + (long long)kv * side.kv_stride
           + (long long)layer * side.layer_stride + (long long)within * vec_bytes;
}

template <typename Vec>
__device__ __forceinline__ void copy_pages(
        const char* __restrict__ src, char* __restrict__ dst,
        const long long* __restrict__ src_pages, const long long* __restrict__ dst_pages,
        unsigned int num_pages, unsigned int num_kv, int layer_begin, int layer_end,
        const Side& s, const Side& d, unsigned int units_per_chunk) {
    const unsigned int layers = layer_end - layer_begin;
    const unsigned int total = num_pages * num_kv * layers * units_per_chunk;
    const unsigned int stride = gridDim.x * blockDim.x;
    const unsigned int vec = sizeof(Vec);
    for (unsigned int base = blockIdx.x * blockDim.x + threadIdx.x; base < total;
         base += stride * AIOHICACHE_UNROLL) {
        Vec v[AIOHICACHE_UNROLL];
        long long out[AIOHICACHE_UNROLL];
#pragma unroll
        for (int u = 0; u < AIOHICACHE_UNROLL; ++u) {
            const unsigned int unit = base + u * stride;
            out[u] = -1;
            if (unit < total) {
                const long long from = unit_offset(unit, units_per_chunk, vec, src_pages, s,
                                                   num_kv, layers, layer_begin);
                const long long to = unit_offset(unit, units_per_chunk, vec, dst_pages, d,
                                                 num_kv, layers, layer_begin);
                if (from >= 0 && to >= 0) {
                    v[u] = load_streaming(reinterpret_cast<const Vec*>(src + from));
                    out[u] = to;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < AIOHICACHE_UNROLL; ++u) {
            if (out[u] >= 0) {
                store_streaming(reinterpret_cast<Vec*>(dst + out[u]), v[u]);
            }
        }
    }
}

#define AIOHICACHE_COPY_PAGES(NAME, VEC)                                                      \
    extern "C" __global__ void NAME(                                                          \
            const char* src, char* dst, const long long* src_pages,                           \
            const long long* dst_pages, unsigned int num_pages, unsigned int num_kv,          \
            int layer_begin, int layer_end, long long src_page_stride,                        \
            long long src_kv_stride, long long src_layer_stride, long long dst_page_stride,   \
            long long dst_kv_stride, long long dst_layer_stride,                              \
            unsigned int units_per_chunk) {                                                   \
        const Side s = {src_page_stride, src_kv_stride, src_layer_stride};                    \
        const Side d = {dst_page_stride, dst_kv_stride, dst_layer_stride};                    \
        copy_pages<VEC>(src, dst, src_pages, dst_pages, num_pages, num_kv, layer_begin,       \
                        layer_end, s, d, units_per_chunk);                                    \
    }

AIOHICACHE_COPY_PAGES(copy_pages_v16, uint4)
AIOHICACHE_COPY_PAGES(copy_pages_v8, uint2)
AIOHICACHE_COPY_PAGES(copy_pages_v4, unsigned int)
AIOHICACHE_COPY_PAGES(copy_pages_v2, unsigned short)
AIOHICACHE_COPY_PAGES(copy_pages_v1, unsigned char)
