"""Read a GGUF file's header without loading its tensors: the architecture, the metadata wanted here and
the extent of every tensor, so that a file that is not GGUF, is truncated or holds an architecture we do
not run is refused in one line before transformers dequantizes anything.

The layout (ggml's ``docs/gguf.md``, mirrored by the ``gguf`` package's ``GGUFReader``): the magic
``GGUF``, a u32 version (2 or 3), u64 tensor and key-value counts, the key-value pairs (a string key, a
u32 value type, the value; arrays are a u32 item type, a u64 count and the items), then per tensor its
name, u32 dimension count, u64 dimensions, u32 ggml type and u64 offset; the tensor data start at the
next multiple of ``general.alignment`` (default 32). A tensor of ggml type T with n elements takes
``n / block_size(T) * type_size(T)`` bytes (``gguf.GGML_QUANT_SIZES``). ``GGUFReader`` itself builds a
numpy view of every array and tensor (30 s for SmolLM2's 49k-token vocabulary on a busy 2-core
machine); this reads the same header in well under a second and skips the array items it does not keep.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types (ggml docs/gguf.md, gguf.GGUFValueType): id -> struct format of a scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
KEEP = ("general.architecture", "general.name", "general.alignment", "tokenizer.chat_template")


class GGUFError(ValueError):
    """A file that is not a readable GGUF checkpoint; the message is one line naming the file."""


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict = field(default_factory=dict)  # only the KEEP keys and the architecture's own scalars
    tensors: dict = field(default_factory=dict)  # name -> (shape, ggml type id, offset, n_bytes)
    data_start: int = 0
    size: int = 0

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def needed_bytes(self) -> int:
        """The file size the tensor table asks for: the end of the last tensor's data."""
        ends = [self.data_start + off + n for _, _, off, n in self.tensors.values()]
        return max(ends, default=self.data_start)


class _Cursor:
    def __init__(self, data: bytes, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise GGUFError(f"{self.path}: truncated GGUF header (ends at byte {len(self.data)} inside its tables)")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        raw = self.data[self.pos : self.pos + n]
        if len(raw) != n:
            raise GGUFError(f"{self.path}: truncated GGUF header (a string of {n} bytes runs past the file's end)")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise GGUFError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")
        itype, count = self.take("I"), self.take("Q")
        if itype in _SCALARS and not keep:  # skip a numeric array without unpacking it
            self.pos += count * struct.calcsize("<" + _SCALARS[itype])
            return None
        if itype == _STRING and not keep:  # skip a string array (a vocabulary) without decoding it
            for _ in range(count):
                n = self.take("Q")  # not `self.pos += self.take(...)`: take moves pos first
                self.pos += n
            return None
        items = [self.value(itype, keep) for _ in range(count)]
        return items if keep else None


def _tensor_bytes(path: Path, name: str, shape: tuple, ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # the gguf package's table of ggml types

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"{path}: tensor {name!r} has ggml type {ggml_type}, unknown to the gguf package") from None
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def read_header(path: str | Path) -> GGUFHeader:
    """The header of the GGUF file at ``path``; :class:`GGUFError` (one line) for anything else."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            magic = f.read(4)
            if magic != MAGIC:
                raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
            data = MAGIC + f.read(min(size, 64 << 20) - 4)  # headers are a few MB (vocabularies)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read: {e.strerror or e}") from None
    cur = _Cursor(data, path)
    cur.pos = 4
    version = cur.take("I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version}, expected 2 or 3")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    head = GGUFHeader(path, version, size=size)
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.take("I")
        keep = key in KEEP or (vtype != _ARRAY and "." in key and not key.startswith("tokenizer."))
        value = cur.value(vtype, keep)
        if keep:
            head.metadata[key] = value
    for _ in range(n_tensors):
        name = cur.string()
        shape = tuple(cur.take("Q") for _ in range(cur.take("I")))
        ggml_type, offset = cur.take("I"), cur.take("Q")
        head.tensors[name] = (shape, ggml_type, offset, _tensor_bytes(path, name, shape, ggml_type))
    align = int(head.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    head.data_start = (cur.pos + align - 1) // align * align
    if head.needed_bytes > size:
        raise GGUFError(
            f"{path}: truncated: its {n_tensors} tensors need {head.needed_bytes} bytes, the file has {size}"
        )
    return head
