"""Storage behind small interfaces: Journal (tier 1), LongTermStore (tier 2), MetaStore."""

from ._chunks import LocalChunkStore, LongTermStore, MemoryChunkStore, chunk_name
from ._journal import (
    ENTRY_OVERHEAD,
    FileJournal,
    Journal,
    JournalAddress,
    MemoryJournal,
    RecoveryReport,
    storage_error,
)
from ._meta import ChunkRecord, MetaStore, SegmentRecord, SqliteMetaStore, StreamRecord

__all__ = [
    "ENTRY_OVERHEAD",
    "ChunkRecord",
    "FileJournal",
    "Journal",
    "JournalAddress",
    "LocalChunkStore",
    "LongTermStore",
    "MemoryChunkStore",
    "MemoryJournal",
    "MetaStore",
    "RecoveryReport",
    "SegmentRecord",
    "SqliteMetaStore",
    "StreamRecord",
    "chunk_name",
    "storage_error",
]
