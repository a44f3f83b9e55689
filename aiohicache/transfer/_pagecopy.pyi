# The native page copier (_pagecopy.c); use it through _native.native_copier.
import numpy as np

class PageCopier:
    def __init__(self, device: object, device_side: tuple[int, int, int, int, int],
                 host: object, host_side: tuple[int, int, int, int, int], chunk: int,
                 num_kv: int, num_layers: int) -> None: ...
    def copy(self, src: np.ndarray, dst: np.ndarray, to_device: bool, layer_lo: int,
             layer_hi: int, release_gil: bool, /) -> None: ...
