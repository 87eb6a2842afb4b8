"""safeckpt.testing: crash and break storage on purpose, in your own tests too.

Modelled on SQLite's crash-test layer (see docs/testing.md):

- ``crash_points(fn, profile)``: run ``fn(storage)`` crashed at every storage
  operation, with power cuts, and check what recovers;
- ``storage_for_profile(name)``: a storage that behaves like a POSIX disk, NFS,
  Windows, an object-store FUSE mount or an object store;
- ``SimulatedDisk``: an in-memory filesystem that loses unsynced writes and folder
  entries at ``crash()``; ``MemoryObjectStore``: an in-memory S3;
- ``FaultyStorage``: wraps any ``Storage`` to crash it or inject errors (ENOSPC,
  EACCES, EROFS, EIO on read or fsync, transient errors, stale listings, latency);
- ``SimulatedCrash``: what a crashed operation raises (a ``BaseException``);
- ``StorageTests``: the conformance suite a storage backend's tests subclass.
"""

from .crash import PROFILES, CrashPoint, crash_points, storage_for_profile
from .disk import DISK_PROFILES, DiskProfile, SimulatedDisk
from .faults import Fault, FaultyStorage, OpCounter, SimulatedCrash, make_error
from .objectstore import MemoryObjectStore, ObjectBucket
from .storage import StorageTests

__all__ = [
    "crash_points", "CrashPoint", "storage_for_profile", "PROFILES",
    "SimulatedDisk", "DiskProfile", "DISK_PROFILES",
    "MemoryObjectStore", "ObjectBucket",
    "FaultyStorage", "Fault", "SimulatedCrash", "OpCounter", "make_error", "StorageTests",
]
