# The native span reader (_spanread.c); use it through _native.SPAN_READER.
from collections.abc import Sequence

def bind(oneshot: int, create_state: int, free_state: int, reset_with_seed: int, update: int,
         digest: int, /) -> None: ...
def read_checked(fd: int, offset: int, payload: int, chunk: int, prefix: bytes,
                 key_ids: bytes, dests: Sequence[memoryview], outcomes: bytearray,
                 /) -> None: ...
