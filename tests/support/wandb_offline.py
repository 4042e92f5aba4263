"""Read the records of an offline wandb run (``run-<id>.wandb``), to check what the wandb sink
logged without a network. The file is wandb's transaction log: a 7-byte header (``:W&B``,
magic, version), then 32 KiB blocks of chunks (crc32 4, length 2, type 1: full, first, middle,
last), each record a ``wandb_internal_pb2.Record`` protobuf."""

from __future__ import annotations

import struct
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: str) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path}: not a wandb transaction log"
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER:  # zero padding at a block's end
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:
            continue
        if kind in (_FULL, _FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def summary(path: str) -> dict[str, Any]:
    """The run record (id, project, name, group, tags) and every history row (key -> value)."""
    import json

    out: dict[str, Any] = {"run": None, "history": []}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            out["run"] = {"id": r.run_id, "project": r.project, "entity": r.entity, "name": r.display_name,
                          "group": r.run_group, "tags": list(r.tags)}
        elif kind == "history":
            out["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in record.history.item})
    return out
