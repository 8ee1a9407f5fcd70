"""Durable snapshots: rank 0's newest commit written to a directory or an object store.

``store`` is the API (the background ``SnapshotWriter``, the resume plan, ``load_snapshot``);
``files`` lays out and checks a snapshot's files (data, manifest, checksum); ``fs`` is the
small file-system interface they are written through (a local directory or fsspec).

The launcher imports ``files`` (standard library only) to choose the snapshot to resume from.
"""
