"""CUDA C sources of the transfer kernels, installed as the data package ``aiohicache._kernels``.

Nothing here is imported for code: `aiohicache.transfer._cuda_kernels` reads the ``*.cu`` files
with `importlib.resources` and compiles them with NVRTC through CuPy on first use.
"""
