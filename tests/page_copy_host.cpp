// kernels/page_copy.cu compiled as host C++ (g++), so the CPU tests run the real kernel
// source, not a re-implementation. CUDA's built-ins become plain C++: every (block, thread)
// of the grid runs the kernel body in turn. Threads share nothing and the kernel has no
// barriers, so running them one after another gives what the GPU gives. Stores are counted
// (`aiohicache_stored_bytes`) so a test can tell that no unit is written twice.
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(threads)

struct uint4 { unsigned int x, y, z, w; };
struct uint2 { unsigned int x, y; };
struct Dim3 { unsigned int x = 0, y = 0, z = 0; };

static Dim3 threadIdx, blockIdx, blockDim, gridDim;
static unsigned long long stored_bytes = 0;

template <typename T> inline T __ldcs(const T* p) {
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

template <typename T> inline void __stcs(T* p, T v) {
    std::memcpy(p, &v, sizeof v);
    stored_bytes += sizeof v;
}

#include "page_copy.cu"

typedef void (*Entry)(const CopyParams);

static Entry entry(int width) {
    switch (width) {
        case 16: return copy_pages_v16;
        case 8: return copy_pages_v8;
        case 4: return copy_pages_v4;
        case 2: return copy_pages_v2;
        case 1: return copy_pages_v1;
        default: return nullptr;
    }
}

extern "C" unsigned int aiohicache_params_size() { return sizeof(CopyParams); }

extern "C" unsigned long long aiohicache_stored_bytes() { return stored_bytes; }

// Runs copy_pages_v<width> over a grid of `grid` blocks of `block` threads; -1: no such width.
extern "C" int aiohicache_launch(int width, unsigned int grid, unsigned int block,
                                 const CopyParams* params) {
    const Entry fn = entry(width);
    if (fn == nullptr) {
        return -1;
    }
    gridDim.x = grid;
    blockDim.x = block;
    for (unsigned int b = 0; b < grid; ++b) {
        for (unsigned int t = 0; t < block; ++t) {
            blockIdx.x = b;
            threadIdx.x = t;
            fn(*params);
        }
    }
    return 0;
}
