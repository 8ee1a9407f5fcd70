"""The torch.distributed.checkpoint (DCP) directory a sharded snapshot is, written one rank
at a time, without collectives.

A DCP checkpoint directory holds one data file per rank (``__R_0.distcp``) and
``.metadata``: a pickled ``torch.distributed.checkpoint.metadata.Metadata`` that gives, for
each key of the flattened state dict, the global size and dtype and the chunks it was
written in (offsets and sizes), and where each chunk's bytes are (``storage_data``: file,
offset, length). ``torch.distributed.checkpoint.load`` plans the reads of any world size
from it.

Why the format is written here instead of by ``dcp.save`` run on each rank with
``no_dist=True`` into a directory of its own, then merged:

* ``dcp.save`` learns where a tensor's rows sit in the global tensor from a DTensor (its
  mesh and placements, so the training thread's process group). A rank offers plain CPU
  rows held by its commit, written from a thread of its own. Run without a group, DCP
  would record every piece as a whole tensor at offset 0, and would name every rank's file
  ``__0_0.distcp``. The merge would then rewrite DCP's own records, and its private planner
  internals would be needed to place the rows.
* Written here, each file goes through the snapshot directory's ``Store`` (a local
  directory: temporary name, fsync, publication that replaces nothing; or an fsspec URL) and
  is hashed as it is written, like the files of a DDP snapshot.

The rest follows DCP. Keys are flattened the way its default planner flattens nested
dicts and lists (``flatten``; the tests compare it with ``dcp.save``). Each tensor chunk is
``torch.save``d at its offset in the rank's file, and each other value is ``torch.save``d
as bytes, as its ``FileSystemWriter`` does. The metadata is built from DCP's public
classes. One private name is needed: ``torch.distributed.checkpoint.filesystem._StorageInfo``,
the storage record that its ``FileSystemReader`` reads (imported in ``merge`` alone).

Each rank describes the part it wrote in a ``Part`` (JSON, next to its data file), and
rank 0 merges the W parts into ``.metadata`` (``merge``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_elastic.durable.files import HashingWriter
from lightning_elastic.durable.fs import SnapshotError

METADATA_NAME = ".metadata"  # DCP's name: FileSystemReader reads it
PART_FORMAT = 1  # of a rank's part description; a newer one is refused, not guessed at

# A key's place in the nested tree: dict keys as strings, list indices as ints (DCP's OBJ_PATH).
KeyPath = tuple[str | int, ...]


def data_file_name(rank: int) -> str:
    """Rank ``rank``'s data file, named as DCP's ``FileSystemWriter`` names it (one file per rank)."""
    return f"__{rank}_0.distcp"


def part_name(rank: int) -> str:
    """The description of rank ``rank``'s part, written after its data file."""
    return f".part-{rank}.json"


@dataclasses.dataclass(frozen=True)
class ShardPiece:
    """This rank's rows ``[row_offset, row_offset + len(tensor))`` of a tensor of
    ``global_shape`` that is sharded on dim 0 (FSDP2's layout on a 1-D mesh: ``param.to_local()``).

    ``tensor`` is on the CPU and may have 0 rows: with torch.chunk semantics, a rank past
    the end of a short tensor holds nothing, at an offset at or past ``global_shape[0]``.
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    row_offset: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(n) for n in self.global_shape))
        t = self.tensor
        if not isinstance(t, torch.Tensor) or hasattr(t, "to_local"):
            raise SnapshotError(f"ShardPiece.tensor: expected a plain CPU tensor (a DTensor's to_local()), "
                                f"got {type(t).__name__}")
        if t.device.type != "cpu":
            raise SnapshotError(f"ShardPiece.tensor: expected a CPU tensor, got one on {t.device}")
        shape = self.global_shape
        if not shape or t.dim() != len(shape) or tuple(t.shape[1:]) != shape[1:]:
            raise SnapshotError(f"ShardPiece: rows of shape {tuple(t.shape)} do not fit a tensor of global shape "
                                f"{shape} sharded on dim 0")
        rows = t.shape[0]
        if self.row_offset < 0 or (rows and self.row_offset + rows > shape[0]):
            raise SnapshotError(f"ShardPiece: rows [{self.row_offset}, {self.row_offset + rows}) are not within the "
                                f"{shape[0]} rows of global shape {shape}")

    @property
    def chunk_offsets(self) -> tuple[int, ...]:
        """The chunk's offsets as DCP records them. An empty piece sits at the end of the rows,
        where a DTensor's empty shard says it is."""
        return (min(self.row_offset, self.global_shape[0]),) + (0,) * (len(self.global_shape) - 1)


@dataclasses.dataclass(frozen=True)
class Flat:
    """A nested tree flattened as DCP flattens it: ``leaves`` by key, each key's ``paths``."""

    leaves: dict[str, Any]
    paths: dict[str, KeyPath]


def flatten(tree: Mapping[str, Any]) -> Flat:
    """``tree`` flattened as DCP's default planner does (``_nested_dict.flatten_state_dict``).

    Dict keys become strings, list items their index, and a key is its path joined with
    ".". A list is a leaf unless it holds a tensor (a ``ShardPiece`` counts as one), a dict,
    or such a list. A tuple is always a leaf, and an empty dict leaves nothing.
    """
    leaves: dict[str, Any] = {}
    paths: dict[str, KeyPath] = {}

    def is_leaf(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        for entry in value:
            if isinstance(entry, (Mapping, list)) and not is_leaf(entry):
                return False
            if isinstance(entry, (torch.Tensor, ShardPiece)):
                return False
        return True

    def visit(path: KeyPath, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit(path + (str(k),), v)
        elif is_leaf(value):
            key = ".".join(map(str, path))
            if key in leaves:
                raise SnapshotError(f"{key}: two entries of the tree flatten to this key (as DCP flattens it)")
            leaves[key] = value
            paths[key] = path
        else:
            for i, v in enumerate(value):
                visit(path + (i,), v)

    for key, value in tree.items():
        visit((str(key),), value)
    return Flat(leaves, paths)


def check_leaves(leaves: Mapping[str, Any]) -> None:
    """Refuse a tree DCP could not read back: a DTensor given as it is. Its rows have to be
    offered as a ``ShardPiece``, because saved whole it would be pickled with its mesh."""
    for key, leaf in leaves.items():
        if isinstance(leaf, torch.Tensor) and hasattr(leaf, "to_local"):
            raise SnapshotError(f"{key}: a DTensor; offer this rank's rows as ShardPiece(t.to_local(), "
                                "tuple(t.shape), row_offset)")


@dataclasses.dataclass(frozen=True)
class PartItem:
    """One entry of a rank's data file: a tensor chunk or a value's bytes."""

    key: str
    kind: str  # "tensor" (a chunk of a tensor) or "bytes" (any other value, torch.save'd)
    offset: int  # where its bytes start in the rank's data file
    length: int
    dtype: str = ""  # a tensor's: "torch.float32"
    size: tuple[int, ...] = ()  # a tensor's global size
    chunk_offsets: tuple[int, ...] = ()
    chunk_sizes: tuple[int, ...] = ()
    sharded: bool = False  # a ShardPiece (each rank holds a chunk), not a tensor rank 0 writes whole


@dataclasses.dataclass(frozen=True)
class Part:
    """What one rank wrote for one snapshot: its data file (size, SHA-256) and the items in it."""

    rank: int
    world_size: int
    step: int
    token: str
    file: str
    size: int
    sha256: str
    items: tuple[PartItem, ...]
    format: int = PART_FORMAT

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> Part:
        try:
            data = json.loads(text)
            if data.get("format", PART_FORMAT) > PART_FORMAT:
                raise SnapshotError(f"{where}: written in part format {data['format']}, this version reads "
                                    f"{PART_FORMAT} and older")
            items = tuple(
                PartItem(str(i["key"]), str(i["kind"]), int(i["offset"]), int(i["length"]), str(i["dtype"]),
                         tuple(map(int, i["size"])), tuple(map(int, i["chunk_offsets"])),
                         tuple(map(int, i["chunk_sizes"])), bool(i["sharded"]))
                for i in data["items"]
            )
            return cls(int(data["rank"]), int(data["world_size"]), int(data["step"]), str(data["token"]),
                       str(data["file"]), int(data["size"]), str(data["sha256"]), items)
        except SnapshotError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise SnapshotError(f"{where}: not a part description ({type(err).__name__}: {err})") from None


def write_items(leaves: Mapping[str, Any], rank: int, sink: HashingWriter) -> tuple[PartItem, ...]:
    """Write this rank's items to ``sink``, its data file: every ``ShardPiece`` and, on rank
    0 alone, the leaves every rank holds the same (tensors whole, other values as bytes).

    ``sink.size`` counts the bytes written so far, and each item records its offset and
    length from it. The tensors are only read, never changed.
    """
    items = []
    for key, leaf in leaves.items():
        if isinstance(leaf, ShardPiece):
            items.append(_write_tensor(sink, key, leaf.tensor, leaf.global_shape, leaf.chunk_offsets, True))
        elif rank != 0:
            continue  # the same on every rank: rank 0 writes it
        elif isinstance(leaf, torch.Tensor):
            shape = tuple(leaf.shape)
            items.append(_write_tensor(sink, key, leaf, shape, (0,) * len(shape), False))
        else:
            buffer = io.BytesIO()
            torch.save(leaf, buffer)  # DCP's encoding of a value that is not a tensor
            start = sink.size
            sink.write(buffer.getbuffer())
            items.append(PartItem(key, "bytes", start, sink.size - start))
    return tuple(items)


def _write_tensor(sink: HashingWriter, key: str, tensor: torch.Tensor, size: tuple[int, ...],
                  offsets: tuple[int, ...], sharded: bool) -> PartItem:
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        # torch.save writes a view's whole storage: the rows of a larger buffer are copied
        # out first, as DCP's writer does.
        tensor = tensor.clone()
    start = sink.size
    torch.save(tensor, sink)
    return PartItem(key, "tensor", start, sink.size - start, str(tensor.dtype), size, offsets,
                    tuple(tensor.shape), sharded)


def merge(parts: Sequence[Part], paths: Mapping[str, KeyPath], checkpoint_id: Any) -> Any:
    """The DCP ``Metadata`` of the checkpoint whose ranks wrote ``parts`` (in rank order),
    for the tree that rank 0 flattened into ``paths``.

    Raises ``SnapshotError`` when the parts do not make one checkpoint: a rank offered
    another tree, or rows that do not tile a tensor exactly once.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: PLC0415 - see the module's docstring
    from torch.distributed.checkpoint.metadata import (  # noqa: PLC0415
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    for r, part in enumerate(parts):
        if part.rank != r or part.world_size != len(parts):
            raise SnapshotError(f"part {r} of {len(parts)}: written by rank {part.rank} of {part.world_size}")
    sharded: dict[str, list[tuple[int, PartItem]]] = {}
    whole: dict[str, PartItem] = {}
    for part in parts:
        for item in part.items:
            if item.key not in paths:
                raise SnapshotError(f"{item.key}: written by rank {part.rank} but not in rank 0's tree")
            if item.sharded:
                sharded.setdefault(item.key, []).append((part.rank, item))
            elif part.rank != 0:
                raise SnapshotError(f"{item.key}: written whole by rank {part.rank}; only rank 0 writes whole values")
            else:
                whole[item.key] = item
    for key in paths:
        if key not in sharded and key not in whole:
            raise SnapshotError(f"{key}: in rank 0's tree but in no rank's part")
        if key in sharded and key in whole:
            raise SnapshotError(f"{key}: rank 0 wrote it whole and ranks wrote it in rows")
    for key, chunks in sharded.items():
        _check_tiling(key, chunks, len(parts))

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for key in paths:
        if key in sharded:
            chunks = sharded[key]
            first = chunks[0][1]
            md = TensorStorageMetadata(TensorProperties(dtype=_dtype(first.dtype)), torch.Size(first.size), [])
            for rank, item in chunks:
                index = MetadataIndex(key, item.chunk_offsets, len(md.chunks))
                md.chunks.append(ChunkStorageMetadata(torch.Size(item.chunk_offsets), torch.Size(item.chunk_sizes)))
                storage[index] = _StorageInfo(parts[rank].file, item.offset, item.length)
            state[key] = md
        elif whole[key].kind == "bytes":
            state[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = _StorageInfo(parts[0].file, whole[key].offset, whole[key].length)
        else:
            item = whole[key]
            chunk = ChunkStorageMetadata(torch.Size(item.chunk_offsets), torch.Size(item.chunk_sizes))
            state[key] = TensorStorageMetadata(TensorProperties(dtype=_dtype(item.dtype)), torch.Size(item.size), [chunk])
            storage[MetadataIndex(key, item.chunk_offsets, 0)] = _StorageInfo(parts[0].file, item.offset, item.length)
    return Metadata(
        state_dict_metadata=state,
        planner_data=dict(paths),  # DCP's flatten mapping: what unflattens a load without a target
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4())),
        version=_dcp_version(),
    )


def metadata_bytes(metadata: Any) -> bytes:
    """``.metadata``'s contents: DCP pickles its ``Metadata``."""
    return pickle.dumps(metadata)


def _check_tiling(key: str, chunks: list[tuple[int, PartItem]], world_size: int) -> None:
    """Every rank wrote one chunk of ``key``, all of one dtype and global size, and their
    rows tile the global rows exactly once."""
    ranks = [rank for rank, _ in chunks]
    if ranks != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(ranks))
        raise SnapshotError(f"{key}: no rows from rank(s) {', '.join(map(str, missing))} (another tree there?)")
    first = chunks[0][1]
    for rank, item in chunks:
        if item.dtype != first.dtype or item.size != first.size:
            raise SnapshotError(f"{key}: rank {rank} wrote {item.dtype} of global size {item.size}, rank 0 "
                                f"{first.dtype} of {first.size}")
        if item.chunk_offsets[1:] != (0,) * (len(item.size) - 1) or item.chunk_sizes[1:] != item.size[1:]:
            raise SnapshotError(f"{key}: rank {rank}'s chunk at {item.chunk_offsets} of {item.chunk_sizes} is not "
                                f"whole rows of {item.size}")
    row = 0
    for rank, item in sorted(((r, i) for r, i in chunks if i.chunk_sizes[0]), key=lambda c: c[1].chunk_offsets[0]):
        if item.chunk_offsets[0] != row:
            raise SnapshotError(f"{key}: rank {rank}'s rows start at {item.chunk_offsets[0]}, expected {row} "
                                "(rows missing or written twice)")
        row += item.chunk_sizes[0]
    if row != first.size[0]:
        raise SnapshotError(f"{key}: the ranks' rows end at {row}, the tensor has {first.size[0]}")


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise SnapshotError(f"dtype {name!r}: not a torch dtype")
    return value


def _dcp_version() -> str | None:
    from torch.distributed.checkpoint import filesystem  # noqa: PLC0415

    return getattr(filesystem, "CURRENT_DCP_VERSION", None)
