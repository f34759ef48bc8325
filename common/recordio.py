"""MXNet/dmlc RecordIO (.rec + .idx) in pure Python: read and write insightface-style face datasets without mxnet.

On disk a .rec file is a sequence of records; each record is one or more chunks:

    uint32 magic 0xced7230a | uint32 lrec | data | zero padding to a 4-byte boundary      (little-endian)

lrec packs the chunk length (lower 29 bits) and a continuation flag cflag (upper 3 bits): 0 = the whole
record, 1/2/3 = first/middle/last part. dmlc splits a record only where the magic itself appears at a
4-byte-aligned offset of the payload: that magic is dropped and the reader puts it back between parts,
so a scanner that finds an aligned magic in the file always finds a chunk start. Records are < 2**29 bytes.

The .idx file is text, one `key<TAB>offset` line per record, offset = byte offset of the record's first chunk.

mxnet's image records start with an IRHeader (struct 'IfQQ': flag, label, id, id2). A scalar label lives in
the float field (flag 0); an array label of n floats sets flag = n and follows the header as float32s.

    with RecordWriter("train.idx", "train.rec") as w:
        w.write_idx(1, pack(IRHeader(0, 7.0, 1, 0), jpeg_bytes))
    reader = IndexedRecordReader("train.idx", "train.rec")
    header, jpeg_bytes = unpack(reader.read_idx(1))

MXFaceDataset reads the insightface "faces_emore" layout (train.rec/train.idx) as a torch Dataset.
"""

import array
import copy
import io
import numbers
import os
import struct
from collections import namedtuple
from collections.abc import Mapping

import numpy as np
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import Dataset

MAGIC = 0xCED7230A
MAX_RECORD_BYTES = (1 << 29) - 1  # the length field has 29 bits
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_CHUNK_HEAD = struct.Struct("<II")
_LENGTH_MASK = (1 << 29) - 1
_WHOLE, _FIRST, _MIDDLE, _LAST = 0, 1, 2, 3
# A record's bytes usually end where the next offset in the idx begins, so one pread of that span reads it;
# the cap keeps a sparse idx (gaps between indexed records) from reading megabytes of neighbours.
_READAHEAD_CAP = 1 << 20

IRHeader = namedtuple("IRHeader", ["flag", "label", "id", "id2"])
# mxnet packs 'IfQQ' in native order; spelling it '<' keeps the files little-endian (what every mxnet build
# wrote) on any host. The fields are naturally aligned, so native and '<' agree on 24 bytes with no padding.
_IR_HEADER = struct.Struct("<IfQQ")


class RecordIOError(Exception):
    """A .rec or .idx file is corrupt or truncated, or a key is missing; the one-line message names file and key."""


# ------------------------------------------------------------------------------------------ IRHeader
def pack(header, payload):
    """IRHeader + payload -> record bytes, exactly as mxnet.recordio.pack.

    A numeric label goes into the header (flag forced to 0); anything else is taken as an array of labels:
    flag = its size, the header's float is 0 and the float32 labels precede the payload.
    """
    header = IRHeader(*header)
    if isinstance(header.label, numbers.Number):
        header = header._replace(flag=0)
    else:
        label = np.asarray(header.label, dtype=np.float32)
        header = header._replace(flag=label.size, label=0)
        payload = label.tobytes() + bytes(payload)
    return _IR_HEADER.pack(*header) + bytes(payload)


def unpack(record):
    """Record bytes -> (IRHeader, payload), exactly as mxnet.recordio.unpack.

    header.label is a float when flag is 0, else a read-only float32 array of `flag` labels.
    """
    if len(record) < _IR_HEADER.size:
        raise RecordIOError(f"record is {len(record)} bytes, shorter than the {_IR_HEADER.size}-byte IRHeader")
    header = IRHeader(*_IR_HEADER.unpack_from(record))
    start = _IR_HEADER.size
    if header.flag > 0:
        end = start + 4 * header.flag
        if len(record) < end:
            raise RecordIOError(f"IRHeader flag {header.flag} promises {header.flag} float32 labels but the record "
                                f"has only {len(record) - start} bytes after the header")
        header = header._replace(label=np.frombuffer(record, np.float32, header.flag, start))
        start = end
    return header, bytes(record[start:])


# ------------------------------------------------------------------------------------------- chunks
def encode_record(payload):
    """One record as it lies in a .rec file: its chunk(s) and padding, byte for byte what dmlc writes."""
    payload = bytes(payload)
    size = len(payload)
    if size > MAX_RECORD_BYTES:
        raise ValueError(f"record of {size} bytes: RecordIO records must be smaller than 2**29 bytes")
    out = []
    done = 0  # payload bytes already written (before the last dropped magic)
    hit = payload.find(_MAGIC_BYTES)
    while hit != -1:
        if hit % 4:
            # dmlc only looks at aligned offsets: an unaligned magic is plain data and is not split on.
            hit = payload.find(_MAGIC_BYTES, hit + 1)
            continue
        cflag = _FIRST if done == 0 else _MIDDLE
        out += [_CHUNK_HEAD.pack(MAGIC, cflag << 29 | (hit - done)), payload[done:hit]]
        done = hit + 4
        hit = payload.find(_MAGIC_BYTES, done)
    cflag = _LAST if done else _WHOLE
    out += [_CHUNK_HEAD.pack(MAGIC, cflag << 29 | (size - done)), payload[done:]]
    # Every earlier part is a multiple of 4 long (both ends are aligned), so the padding depends on size alone.
    out.append(b"\0" * (-size % 4))
    return b"".join(out)


def _decode_record(read, start, readahead, where):
    """Read the record whose first chunk is at `start`; read(pos, n) returns up to n bytes at pos (fewer at EOF).

    `where` ("FILE: key K") prefixes error messages. The parts of a split record are rejoined with the magic
    that dmlc dropped between them.
    """
    buf = read(start, max(readahead, _CHUNK_HEAD.size))
    pos = 0  # current chunk, relative to start
    parts = []

    def have(end):
        nonlocal buf
        if len(buf) < end:
            buf += read(start + len(buf), end - len(buf))
            if len(buf) < end:
                raise RecordIOError(f"{where}: record truncated: the chunk at offset {start + pos} runs to offset "
                                    f"{start + end} but the file ends at offset {start + len(buf)}")

    while True:
        have(pos + _CHUNK_HEAD.size)
        magic, lrec = _CHUNK_HEAD.unpack_from(buf, pos)
        if magic != MAGIC:
            raise RecordIOError(f"{where}: bad magic 0x{magic:08x} at offset {start + pos} (expected "
                                f"0x{MAGIC:08x}): not a RecordIO file, or a wrong offset in the idx")
        cflag, length = lrec >> 29, lrec & _LENGTH_MASK
        if not parts and cflag not in (_WHOLE, _FIRST):
            raise RecordIOError(f"{where}: the chunk at offset {start + pos} is a continuation (cflag {cflag}), "
                                "not the start of a record: wrong offset in the idx")
        if parts and cflag not in (_MIDDLE, _LAST):
            raise RecordIOError(f"{where}: multi-part record broken: the chunk at offset {start + pos} has "
                                f"cflag {cflag}, expected a middle (2) or last (3) part")
        data = pos + _CHUNK_HEAD.size
        have(data + length)  # the last chunk's padding may be missing: the record is whole without it
        parts.append(buf[data:data + length])
        pos = data + length + (-length % 4)
        if cflag in (_WHOLE, _LAST):
            return parts[0] if len(parts) == 1 else _MAGIC_BYTES.join(parts)


# ------------------------------------------------------------------------------------------- writer
class RecordWriter:
    """Writes a .rec and its .idx, byte-identical to mx.recordio.MXIndexedRecordIO(idx, rec, 'w')."""

    def __init__(self, idx_path, rec_path, key_type=int):
        self.idx_path, self.rec_path, self.key_type = str(idx_path), str(rec_path), key_type
        self.keys = []
        self._seen = set()
        self._pos = 0
        self._rec = open(self.rec_path, "wb", buffering=1 << 20)
        self._idx = open(self.idx_path, "w", newline="\n", encoding="utf-8")

    def tell(self):
        """Offset in the .rec where the next record will start."""
        return self._pos

    def write(self, record):
        """Append a record without an idx line (mx MXRecordIO.write); returns its offset."""
        pos = self._pos
        data = encode_record(record)
        self._rec.write(data)
        self._pos += len(data)
        return pos

    def write_idx(self, key, record):
        """Append a record and its `key<TAB>offset` idx line; returns its offset."""
        key = self.key_type(key)
        if key in self._seen:
            # mxnet would write the line again and readers would keep only the last one: refuse instead.
            raise ValueError(f"{self.idx_path}: key {key} written twice")
        pos = self.write(record)
        self._idx.write(f"{key}\t{pos}\n")
        self._seen.add(key)
        self.keys.append(key)
        return pos

    def close(self):
        self._rec.close()
        self._idx.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------------------------- reader
class KeyOffsets(Mapping):
    """key -> offset of its record's first chunk (mxnet's .idx dict), by binary search in sorted numpy arrays."""

    def __init__(self, keys, sorted_keys, offsets):
        self._keys, self._sorted, self._offsets = keys, sorted_keys, offsets

    def __getitem__(self, key):
        try:
            i = int(np.searchsorted(self._sorted, key))
            if i < len(self._sorted) and self._sorted[i] == key:
                return int(self._offsets[i])
        except (TypeError, ValueError, OverflowError):  # not comparable with the keys: missing, as from a dict
            pass
        raise KeyError(key)

    def __iter__(self):  # idx order, as plain Python keys
        return (key.item() for key in self._keys)

    def __len__(self):
        return len(self._keys)


class IndexedRecordReader:
    """Random access to a .rec through its .idx, like mx.recordio.MXIndexedRecordIO(idx, rec, 'r').

    Safe in forked DataLoader workers and threads: reads use os.pread, so there is no shared file position,
    and each process opens its own descriptor on first use (a fork shows up as a changed pid).
    The index is numpy arrays, not mxnet's dict and list of Python ints: 24 bytes a key, not 115 (faces_emore's
    5.9M: 140 MB, not 680), and forked workers share their pages (reading a Python int writes its refcount: each
    worker copied the dict page by page). .keys is an array, in idx order; .idx a read-only mapping key -> offset.
    """

    def __init__(self, idx_path, rec_path, key_type=int):
        self.idx_path, self.rec_path, self.key_type = str(idx_path), str(rec_path), key_type
        self._fd, self._pid = None, None
        self._rec_size = os.path.getsize(self.rec_path)
        keys, offsets, lines = self._load_idx()
        order = self._refuse_repeats(keys, offsets, lines)  # sorted by key; equal keys in idx order
        sorted_keys = keys[order]
        self.keys = sorted_keys if np.array_equal(sorted_keys, keys) else keys  # idx order; sorted ones stored once
        self.idx = KeyOffsets(self.keys, sorted_keys, offsets[order])
        # Sorted distinct offsets + end of file: the next one after a record's offset bounds its readahead.
        self._bounds = np.append(np.unique(offsets), np.int64(self._rec_size))

    def _load_idx(self):
        """(keys, offsets, line numbers) of the idx's records, as numpy arrays in idx order."""
        # array('q') while reading: 8 bytes an entry, not a Python int's 28 plus a list's or dict's slot
        keys = array.array("q") if self.key_type is int else []
        offsets, lines = array.array("q"), array.array("q")
        with open(self.idx_path, encoding="utf-8", newline="\n") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                fields = line.rstrip("\r\n").split("\t")
                try:
                    if len(fields) != 2:
                        raise ValueError
                    key, offset = self.key_type(fields[0]), int(fields[1])
                    keys.append(key)  # OverflowError: a key past int64
                except (ValueError, OverflowError):
                    self._refuse_repeats(keys, offsets, lines)  # an earlier line's error is reported first
                    raise RecordIOError(f"{self.idx_path}: idx line {lineno} malformed: {line.rstrip()!r} "
                                        f"(expected 'key<TAB>offset')") from None
                lines.append(lineno)
                if not 0 <= offset <= self._rec_size - _CHUNK_HEAD.size:
                    self._refuse_repeats(keys, [*offsets, offset], lines)  # this line may repeat a key: said first
                    raise RecordIOError(f"{self.idx_path}: key {key}: offset {offset} at idx line {lineno} is "
                                        f"outside {self.rec_path} ({self._rec_size} bytes): truncated .rec?")
                offsets.append(offset)
        return np.asarray(keys), np.asarray(offsets, dtype=np.int64), np.asarray(lines, dtype=np.int64)

    def _refuse_repeats(self, keys, offsets, lines):
        """The first idx line that repeats an earlier key, as the one-line error (found by sorting: no set of
        every key). Returns the order that sorts the keys, equal ones in idx order."""
        keys = np.asarray(keys)
        order = np.argsort(keys, kind="stable")
        repeats = np.flatnonzero(keys[order[1:]] == keys[order[:-1]])
        if repeats.size:
            i = repeats[np.argmin(order[repeats + 1])]  # the repeat on the earliest line
            first, second = order[i], order[i + 1]
            raise RecordIOError(f"{self.idx_path}: key {keys[second]}: listed twice (idx lines with offsets "
                                f"{offsets[first]} and {offsets[second]}, the second at line {lines[second]})")
        return order

    def __len__(self):
        return len(self.keys)

    def __contains__(self, key):
        return key in self.idx

    def _fileno(self):
        pid = os.getpid()
        if self._pid != pid:
            if self._fd is not None:
                os.close(self._fd)  # the parent's descriptor, inherited by fork: closing our copy is harmless
            self._fd, self._pid = os.open(self.rec_path, os.O_RDONLY), pid
        return self._fd

    def _pread(self, pos, n):
        return os.pread(self._fileno(), n, pos)

    def read_idx(self, key):
        """The record stored under `key` (multi-part records rejoined), as bytes."""
        key = key.item() if isinstance(key, np.generic) else key  # an array's element: named as a plain number
        try:
            start = self.idx[key]
        except KeyError:
            raise RecordIOError(f"{self.rec_path}: key {key!r} missing from {self.idx_path}") from None
        end = int(self._bounds[np.searchsorted(self._bounds, start, side="right")])
        where = f"{self.rec_path}: key {key!r}"
        return _decode_record(self._pread, start, min(end - start, _READAHEAD_CAP), where)

    def close(self):
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd, self._pid = None, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # getattr: __init__ may have failed before _fd existed.
        if getattr(self, "_fd", None) is not None:
            self.close()

    def __getstate__(self):
        # Pickled for spawn-started workers: a descriptor number means nothing in another process.
        state = dict(self.__dict__)
        state["_fd"], state["_pid"] = None, None
        return state


# ------------------------------------------------------------------------------------------ dataset
def _label_of(header):
    label = header.label
    return int(label if isinstance(label, numbers.Number) else label[0])


class MXFaceDataset(Dataset):
    """insightface's faces_emore layout (root/train.rec + root/train.idx) as a map-style torch Dataset.

    Record 0 is a header: flag > 0 and label (first identity key, end key). Keys 1 .. label[0]-1 are
    images (label = class id, payload = JPEG/PNG); keys label[0] .. label[1]-1 are one record per identity
    whose label is its [start, end) range of image keys. If record 0's flag is 0 every key is an image.

    reader="python" uses IndexedRecordReader; reader="mxnet" uses mx.recordio for comparison.
    Items are (transform(PIL RGB image) or a CHW float tensor in [0, 1], int label).
    num_classes: the head's classes (default: the header's identity count; fewer is refused here). A label outside
    0 .. num_classes-1 is a RecordIOError naming file and key, raised where the sample loads (in its worker).
    """

    def __init__(self, root, transform=None, reader="python", num_classes=None):
        if num_classes is not None and num_classes < 1:
            raise RecordIOError(f"num_classes {num_classes} (--num-classes) must be 1 or more")
        self.root, self.kind, self.num_classes = str(root), reader, num_classes
        self.idx_path = os.path.join(self.root, "train.idx")
        self.rec_path = os.path.join(self.root, "train.rec")
        self.transform = T.ToTensor() if transform is None else transform
        if reader == "python":
            self.reader = IndexedRecordReader(self.idx_path, self.rec_path)
            self._unpack = unpack
        elif reader == "mxnet":
            try:
                import mxnet as mx
            except Exception as exc:  # mxnet 1.9.1 with numpy>=1.24 dies on np.bool (AttributeError), not ImportError
                raise RecordIOError(f"MXFaceDataset(reader='mxnet'): mxnet does not import ({type(exc).__name__}: "
                                    f"{exc}); mxnet 1.9.1 needs numpy<1.24, python<3.12; use reader='python'") from None
            self.reader = mx.recordio.MXIndexedRecordIO(self.idx_path, self.rec_path, "r")
            self._unpack = mx.recordio.unpack
        else:
            raise ValueError(f"reader must be 'python' or 'mxnet', not {reader!r}")
        header = self._read(0)[0] if 0 in self.reader.idx else None
        if header is not None and header.flag > 0:
            if header.flag < 2:
                raise RecordIOError(f"{self.rec_path}: key 0: header record has {header.flag} label(s), expected "
                                    "2: (first identity key, end key)")
            first_identity, end = int(header.label[0]), int(header.label[1])
            self.identity_range = (first_identity, end)
            self.imgidx = np.arange(1, first_identity)  # an array, not a list of ints that forked workers copy
            identities = end - first_identity  # labels 0 .. identities - 1
            if num_classes is not None and num_classes < identities:
                raise RecordIOError(f"num_classes {num_classes} (--num-classes) is below the {identities} identities "
                                    f"in {self.rec_path}'s header record 0: pass {identities} or more, or leave it out")
            self.num_classes = num_classes or identities
        else:
            self.identity_range = None
            self.imgidx = np.asarray(self.reader.keys)

    def with_transform(self, transform):
        """These records under another transform (train's and val's), sharing the python reader: its index is in
        memory once, and pread keeps threads and workers apart. mxnet's reader seeks one file position: a new one."""
        other = copy.copy(self)
        other.transform = T.ToTensor() if transform is None else transform
        if self.kind == "mxnet":
            other.reader = type(self.reader)(self.idx_path, self.rec_path, "r")
        return other

    def _read(self, key):
        record = self.reader.read_idx(key)
        try:
            return self._unpack(record)
        except (RecordIOError, struct.error) as exc:
            raise RecordIOError(f"{self.rec_path}: key {key}: {exc}") from None

    def __len__(self):
        return len(self.imgidx)

    def __getitem__(self, index):
        key = int(self.imgidx[index])
        header, payload = self._read(key)
        label = _label_of(header)
        classes = self.num_classes
        if classes is not None and not 0 <= label < classes:  # else a traceback per rank (a device assert on a GPU)
            raise RecordIOError(f"{self.rec_path}: key {key}: label {label} is not in 0 .. {classes - 1} (num_classes "
                                f"{classes}): pass the identity count as num_classes (--num-classes)")
        try:
            image = Image.open(io.BytesIO(payload)).convert("RGB")
        except OSError as exc:  # PIL.UnidentifiedImageError is an OSError too
            raise RecordIOError(f"{self.rec_path}: key {key}: payload is not a readable image ({exc})") from None
        return self.transform(image), label
