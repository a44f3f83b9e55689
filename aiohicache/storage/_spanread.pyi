# The native span reader (_spanread.c); use it through _native.SPAN_READER.
from collections.abc import Sequence

def read_checked(fd: int, offset: int, payload: int, per_call: int, prefix: bytes,
                 key_ids: bytes, dests: Sequence[memoryview], outcomes: bytearray,
                 hash_address: int, /) -> None: ...
