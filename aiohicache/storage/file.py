"""The file store: `FileBackend`, page objects in append-only segment files and journals.

The implementation is private: `_file` (the protocol), `_file_upkeep` (index upkeep,
compaction), `_file_index` (the in-memory index), `_journal` (the on-disk layout and the
journals), `_appender` (writing) and `_reader` (reading).
"""

from __future__ import annotations

from ._file import FileBackend

__all__ = ("FileBackend",)
