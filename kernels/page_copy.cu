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
// Layers [layer_begin, layer_begin + layers) are copied: one layer (layer-wise load) or all.
//
// - One argument, a `CopyParams` struct by value (the host packs it with numpy: see
//   aiohicache/transfer/_cuda_kernels.py, PARAMS_DTYPE, which must match it field for field).
// - Indices are page ids (int64, device memory), not token ids: page_size times fewer than a
//   token-index kernel reads.
// - A negative index on either side skips the pair (padding in a fixed-size batch). Ids
//   beyond the pools are refused on the host before launch; the kernel does not check.
// - Work mapping: a *group* of 2^group_shift lanes (4..32, chosen by the host from the chunk
//   size) takes one chunk at a time. The group decodes (page, kv, layer) and loads both page
//   ids once per chunk; then its lanes stride over the chunk's VEC-byte units, so a group's
//   accesses are contiguous (a 4-lane group of 16-byte units: 64 B; 8 lanes: 128 B, one
//   PCIe transaction). Small chunks (page 1, short rows) get small groups and keep every lane
//   busy; large chunks get whole warps.
// - Each lane issues UNROLL independent loads before its UNROLL stores (no branch between
//   them on full steps): a PCIe read is latency-bound, and bandwidth = bytes in flight /
//   round trip. UNROLL scales with the vector width, so every variant keeps 64 B in flight
//   per lane (16 B x 4, 8 B x 8, 4 B x 16; 2 B and 1 B vectors are capped at 16).
// - No division per unit: within a chunk a lane only adds; the two divisions that decode a
//   chunk index (by num_kv * layers and by layers) run once per chunk.
// - The grid is a CTA *budget* chosen by the caller (e.g. 1..32) so the copy leaves the
//   forward pass its SMs; groups stride over the chunks.
// - Streaming cache hints (ld/st .cs): KV passes through once; the forward pass keeps L2.
// - copy_pages_v16 needs src, dst, every stride and chunk_bytes to be multiples of 16;
//   _v8, _v4, _v2 and _v1 likewise. The engine picks the widest that fits (576 B and 656 B
//   rows are multiples of 16; _v1 covers any byte layout).
// - Chunk and unit counters are 32-bit (the host splits launches at 2^31 chunks; a chunk is
//   far below 2^31 units); addresses are 64-bit, so pools past 4 GiB are fine.
// - CTAs over 512 threads: the engine defines AIOHICACHE_MAX_THREADS (its `threads`) and the
//   kernels get `__launch_bounds__`, so the compiler keeps registers within what a CTA that
//   size may have. Unbounded, the 4/2/1-byte variants take 72-96 registers and cannot launch
//   more than 672-800 threads (64K registers per CTA). At 512 and below they are left
//   unbounded: bounded at 512, NVRTC took up to 128 registers, code no GPU run has measured.
// No headers: CuPy compiles this with NVRTC, which has none; CI compile-checks it with nvcc,
// NVRTC, and as host C++ (tests/page_copy_host.cpp runs it on the CPU).

#ifdef AIOHICACHE_MAX_THREADS
#define AIOHICACHE_BOUNDS __launch_bounds__(AIOHICACHE_MAX_THREADS)
#else
#define AIOHICACHE_BOUNDS
#endif

struct CopyParams {
    unsigned long long src, dst;              // base addresses, in copy direction
    unsigned long long src_pages, dst_pages;  // device addresses of the int64 page ids
    long long src_page, src_kv, src_layer;    // byte strides of the source side
    long long dst_page, dst_kv, dst_layer;    // byte strides of the destination side
    unsigned int num_chunks;                  // pages * num_kv * layers
    unsigned int num_kv;
    unsigned int layers;
    int layer_begin;
    unsigned int units_per_chunk;             // chunk_bytes / VEC
    unsigned int group_shift;                 // lanes per chunk = 1 << group_shift
};

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

// One chunk: `units` VEC-byte units from `from` to `to`, lanes `lane`, `lane + lanes`, ...
template <typename Vec, int UNROLL>
__device__ __forceinline__ void copy_chunk(const Vec* __restrict__ from, Vec* __restrict__ to,
                                           unsigned int units, unsigned int lane,
                                           unsigned int lanes) {
    const unsigned int step = lanes * UNROLL;
    unsigned int k = lane;
    // Full steps: UNROLL unconditional loads, then the stores.
    for (; k + (UNROLL - 1) * lanes < units; k += step) {
        Vec v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            v[u] = load_streaming(from + k + u * lanes);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            store_streaming(to + k + u * lanes, v[u]);
        }
    }
    // The tail: at most UNROLL - 1 units per lane, predicated.
    if (k < units) {
        Vec v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (k + u * lanes < units) {
                v[u] = load_streaming(from + k + u * lanes);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (k + u * lanes < units) {
                store_streaming(to + k + u * lanes, v[u]);
            }
        }
    }
}

template <typename Vec, int UNROLL>
__device__ __forceinline__ void copy_pages(const CopyParams& p) {
    const unsigned int thread = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int lanes = 1u << p.group_shift;
    const unsigned int lane = thread & (lanes - 1);
    const unsigned int groups = (gridDim.x * blockDim.x) >> p.group_shift;
    const unsigned int per_page = p.num_kv * p.layers;
    const long long* __restrict__ src_pages = reinterpret_cast<const long long*>(p.src_pages);
    const long long* __restrict__ dst_pages = reinterpret_cast<const long long*>(p.dst_pages);
    for (unsigned int chunk = thread >> p.group_shift; chunk < p.num_chunks; chunk += groups) {
        const unsigned int i = chunk / per_page;
        const unsigned int rest = chunk - i * per_page;
        const unsigned int kv = rest / p.layers;
        const unsigned int layer = p.layer_begin + (rest - kv * p.layers);
        const long long sp = src_pages[i];
        const long long dp = dst_pages[i];
        if (sp < 0 || dp < 0) {
            continue;  // uniform across the group: every lane read the same ids
        }
        const char* from = reinterpret_cast<const char*>(p.src) + sp * p.src_page
                           + (long long)kv * p.src_kv + (long long)layer * p.src_layer;
        char* to = reinterpret_cast<char*>(p.dst) + dp * p.dst_page
                   + (long long)kv * p.dst_kv + (long long)layer * p.dst_layer;
        copy_chunk<Vec, UNROLL>(reinterpret_cast<const Vec*>(from), reinterpret_cast<Vec*>(to),
                                p.units_per_chunk, lane, lanes);
    }
}

#define AIOHICACHE_COPY_PAGES(NAME, VEC, UNROLL)                                              \
    extern "C" __global__ void AIOHICACHE_BOUNDS                                              \
    NAME(const CopyParams params) {                                                           \
        copy_pages<VEC, UNROLL>(params);                                                      \
    }

AIOHICACHE_COPY_PAGES(copy_pages_v16, uint4, 4)
AIOHICACHE_COPY_PAGES(copy_pages_v8, uint2, 8)
AIOHICACHE_COPY_PAGES(copy_pages_v4, unsigned int, 16)
AIOHICACHE_COPY_PAGES(copy_pages_v2, unsigned short, 16)
AIOHICACHE_COPY_PAGES(copy_pages_v1, unsigned char, 16)
