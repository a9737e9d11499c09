"""Storage behind small interfaces: Journal (tier 1), LongTermStore (tier 2), MetaStore."""

from ._chunks import LocalChunkStore, LongTermStore, MemoryChunkStore, chunk_name
from ._journal import (
    BLOCK,
    ENTRY_OVERHEAD,
    FileJournal,
    Journal,
    JournalAddress,
    MemoryJournal,
    RecoveryReport,
    ensure_dir,
    fsync_dir,
    payload_alignment,
    storage_error,
)
from ._meta import (
    ChunkRecord,
    CommitPart,
    Identity,
    MetaStore,
    SegmentRecord,
    SqliteMetaStore,
    StreamRecord,
    TxnCommit,
)

__all__ = [
    "BLOCK",
    "ENTRY_OVERHEAD",
    "ChunkRecord",
    "CommitPart",
    "FileJournal",
    "Identity",
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
    "TxnCommit",
    "chunk_name",
    "ensure_dir",
    "fsync_dir",
    "payload_alignment",
    "storage_error",
]
