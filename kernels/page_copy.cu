// Page-index KV copies between the device pool and the host pool (either direction).
//
// Launch contract
// ---------------
// Both pools are seen as bytes. One *chunk* is the KV of one page for one (kv, layer) pair:
// page_size * row_bytes contiguous bytes on both sides, in every layout the cache uses:
//   device      [num_kv, layers, pages, page_size, row]   page = P, kv = K, layer = Lr strides
//   layer_first [num_kv, layers, pages, page_size, row]   (same shape as the device pool)
//   page_first  [pages, num_kv, layers, page_size, row]
// so a side is described by three byte strides (page, kv, layer) and the copy of item
// (i, kv, layer) moves chunk_bytes from
//   src + src_pages[i] * src_page_stride + kv * src_kv_stride + layer * src_layer_stride
// to the same expression on the dst side. MHA has num_kv = 2 (K and V), MLA num_kv = 1.
// Layers [layer_begin, layer_end) are copied: one layer (layer-wise load) or all of them.
//
// - Indices are page ids (int64), not token ids: page_size times fewer than SGLang's.
// - A negative index on either side skips the pair (padding in a fixed-size batch).
// - One warp copies one chunk with VEC-byte accesses; the grid is a CTA *budget* (the caller
//   picks how many CTAs, e.g. 1..32, so the copy leaves the forward pass its SMs) and every
//   warp strides over the items.
// - copy_pages_v16 needs src, dst, all strides and chunk_bytes 16-byte aligned; _v8 and _v4
//   likewise for 8 and 4. The engine picks the widest that fits (576 B and 656 B rows are
//   16-byte multiples; the 4-byte variant covers any row of whole 4-byte words).
// No headers: CuPy compiles this with NVRTC, which has none; CI compile-checks with nvcc.

template <typename Vec>
__device__ __forceinline__ void copy_chunk(const char* __restrict__ src, char* __restrict__ dst,
                                           long long chunk_bytes, int lane) {
    const Vec* s = reinterpret_cast<const Vec*>(src);
    Vec* d = reinterpret_cast<Vec*>(dst);
    const long long n = chunk_bytes / (long long)sizeof(Vec);
    for (long long j = lane; j < n; j += 32) {
        d[j] = s[j];
    }
}

template <typename Vec>
__device__ __forceinline__ void copy_pages(
        const char* __restrict__ src, char* __restrict__ dst,
        const long long* __restrict__ src_pages, const long long* __restrict__ dst_pages,
        long long num_pages, int num_kv, int layer_begin, int layer_end,
        long long src_page_stride, long long src_kv_stride, long long src_layer_stride,
        long long dst_page_stride, long long dst_kv_stride, long long dst_layer_stride,
        long long chunk_bytes) {
    const int lane = threadIdx.x & 31;
    const long long warps_per_cta = blockDim.x >> 5;
    const long long warp = (long long)blockIdx.x * warps_per_cta + (threadIdx.x >> 5);
    const long long num_warps = (long long)gridDim.x * warps_per_cta;
    const long long layers = layer_end - layer_begin;
    const long long items = num_pages * num_kv * layers;
    // Item order: page-major, so consecutive warps read neighbouring layers of one page
    // (contiguous in page_first) and one layer of neighbouring pages is close in time.
    for (long long item = warp; item < items; item += num_warps) {
        const long long i = item / (num_kv * layers);
        const long long rest = item - i * num_kv * layers;
        const long long kv = rest / layers;
        const long long layer = layer_begin + (rest - kv * layers);
        const long long sp = src_pages[i];
        const long long dp = dst_pages[i];
        if (sp < 0 || dp < 0) {
            continue;  // padding: skip the pair
        }
        copy_chunk<Vec>(src + sp * src_page_stride + kv * src_kv_stride + layer * src_layer_stride,
                        dst + dp * dst_page_stride + kv * dst_kv_stride + layer * dst_layer_stride,
                        chunk_bytes, lane);
    }
}

#define AIOHICACHE_COPY_PAGES(NAME, VEC)                                                      \
    extern "C" __global__ void NAME(                                                          \
            const char* src, char* dst, const long long* src_pages,                           \
            const long long* dst_pages, long long num_pages, int num_kv, int layer_begin,     \
            int layer_end, long long src_page_stride, long long src_kv_stride,                \
            long long src_layer_stride, long long dst_page_stride, long long dst_kv_stride,   \
            long long dst_layer_stride, long long chunk_bytes) {                              \
        copy_pages<VEC>(src, dst, src_pages, dst_pages, num_pages, num_kv, layer_begin,       \
                        layer_end, src_page_stride, src_kv_stride, src_layer_stride,          \
                        dst_page_stride, dst_kv_stride, dst_layer_stride, chunk_bytes);       \
    }

AIOHICACHE_COPY_PAGES(copy_pages_v16, uint4)
AIOHICACHE_COPY_PAGES(copy_pages_v8, uint2)
AIOHICACHE_COPY_PAGES(copy_pages_v4, unsigned int)
