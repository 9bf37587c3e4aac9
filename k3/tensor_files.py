"""safetensors files written straight from the tensors' memory, hashed on the way.

`safetensors.torch.save` builds the whole file as one bytes object first (a copy of every tensor), and a SHA-256 of
it is a second pass; for a checkpoint of tens of GB both cost as much as the write itself. `write_safetensors`
writes the format's header and then each tensor's bytes from its own storage (one tensor on the host at a time,
for tensors on a device), feeding the same buffers to SHA-256 in a second thread while the file is written (both
release the GIL), and fsyncs the file. The file is a plain safetensors file: `safetensors` reads it, and only it
ever reads these files back.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import torch

# torch dtype -> the format's name (the ones the safetensors library writes for torch tensors)
DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
CHUNK_BYTES = 64 << 20  # bytes per write and hash call: large enough that both run without the GIL


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> str:
    """Write `tensors` as a safetensors file at `path` (fsynced) and return the file's SHA-256 (hex). Tensors may
    live on any device; each is copied to the host on its turn. Raises ValueError naming a tensor of a dtype the
    format has no name for."""
    header: dict = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    names = sorted(tensors)
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as hasher:
        pending = None

        def put(buf) -> None:
            nonlocal pending
            for a in range(0, len(buf), CHUNK_BYTES):
                piece = buf[a:a + CHUNK_BYTES]
                if pending is not None:
                    pending.result()  # SHA-256 is sequential: one piece at a time, in order
                pending = hasher.submit(digest.update, piece)
                f.write(piece)

        put(memoryview(struct.pack("<Q", len(head)) + head))
        for name in names:
            t = tensors[name].detach()
            t = t.to("cpu") if t.device.type != "cpu" else t
            t = t.contiguous()
            put(_raw(t))
            if pending is not None:
                pending.result()  # the piece's memory must outlive its hashing
            del t
        if pending is not None:
            pending.result()
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()
