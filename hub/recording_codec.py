"""How a recording of format 2 stores messages: zstd frames of re-encoded column tables.

A format-2 frame (`hub.recording`) carries one of two bodies, told by its first byte:

``TAG_MESSAGE``
    One wire message, zstd-compressed as it is: a message too large for a block.
``TAG_BLOCK``
    A block: the messages one flush buffered, up to ``BLOCK_BYTES`` of them, re-encoded
    (below) and zstd-compressed together.

The transform is exact by construction: a message is cut, byte for byte, into its column
data and the rest (its *skeleton*), and a reader splices them back, so it gets the very
bytes the hub received whatever the message holds. Every reader above the frame layer
(replay, follow, open, diagnose...) sees the wire messages as in format 1, and a message of
a kind this schema does not know, garbage, or a message whose columns are not where
expected decodes as it came (at worst it compresses less).

Where the columns are: messages of one shape (same length, ``tables`` at the same offset:
one sender's steps messages, step after step) share a *template*, the byte ranges of their
schema columns found once by walking one of them with msgpack's unpacker. The block stacks
the messages of a shape as rows of a byte matrix, so a column is one slice of it however many
messages there are: the work per message is a few C calls. A message that does not hold
``tables``, or whose shape has no schema column, is stored whole.

The columns of the block that hold one (table, column) are joined and stored in their
narrowest exact form: integers widened to int64 (floats taken as their bits), then one
transform — none, the difference to the previous row (``diff``: times in issue order,
sequence numbers), or the difference to another column of the same rows (``ref``: a
collective's exit minus its entry) — whichever spans the fewest bytes; the values minus
their minimum are stored as unsigned integers of 0, 1, 2, 4 or 8 bytes (0: every row holds
the minimum), byte plane by byte plane (the mostly-zero high bytes side by side for zstd).
All arithmetic wraps modulo 2**64, so any bit pattern comes back as it went in.

Decoding trusts nothing and unpacks no msgpack: zstd output is bounded by
``schema.MAX_MESSAGE_BYTES`` (the frame must state its decompressed size, at most that),
every count, offset and length of the block is checked against the bytes that hold it,
the messages a block rebuilds total at most ``schema.MAX_MESSAGE_BYTES``, and any failure
raises `CodecError`, which the reader turns into a skipped ``corrupt`` frame.

Block layout (decompressed, little endian)::

    u32 M messages   u16 K columns   u16 G shapes   u32 W whole messages   u32 their bytes
    i64[M] t_recv_ns
    u16[M] shape of each message (0xFFFF: stored whole), in message order
    u32[W] lengths of the whole messages, then their bytes
    K columns:  u8 len + table name, u8 len + column name
    G shapes:   u32 messages, u32 message length, u16 S ranges,
                S x (u16 column, u32 offset, u32 length), skeletons (messages x the
                bytes outside the ranges)
    K column data, in schema order: u16 column, u8 transform, u8 ref column, u8 width,
                   i64 base, u32 rows, rows x width bytes (byte planes)
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence

import msgpack
import numpy as np
import zstandard

from rankscope.collector.schema import MAX_MESSAGE_BYTES, REDUCED_TABLES, TABLES

TAG_MESSAGE = 1
TAG_BLOCK = 2

BLOCK_BYTES = 1 << 20
"""Wire bytes a block holds at most (a larger message is a frame of its own). Bounds what
one damaged frame costs and what a reader holds decoded at once; large enough that the
per-block work is paid over many messages."""

MAX_COLUMNS = 256
"""Most distinct (table, column) keys in one block."""

MAX_SHAPES = 4096
"""Most message shapes in one block (the rest of its messages are stored whole)."""

MAX_TEMPLATES = 4096
"""Shapes whose column ranges a writer remembers (forgotten all at once past it)."""

LEVEL = 3
"""zstd level of the writer (benchmarks/RESULTS.md, recording section: level 3 keeps up
with ingest and level 1 saves little CPU)."""

_WHOLE = 0xFFFF
_TRANSFORM_NONE, _TRANSFORM_DIFF, _TRANSFORM_REF = 0, 1, 2
_WIDTHS = (0, 1, 2, 4, 8)
_UINT: dict[int, np.dtype] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}
_SIGNED: dict[int, np.dtype] = {
    1: np.dtype("<i1"),
    2: np.dtype("<i2"),
    4: np.dtype("<i4"),
    8: np.dtype("<i8"),
}
_MASK64 = 2**64 - 1

_HEAD = struct.Struct("<IHHII")
_SHAPE = struct.Struct("<IIH")
_RANGE = struct.Struct("<HII")
_COLUMN = struct.Struct("<BBBqI")
_INDEX = struct.Struct("<H")
_BIN_HEADER = {0xC4: 2, 0xC5: 3, 0xC6: 5}
_PACKED_HEADER = 0x93
"""msgpack's header of an array of three: a packed column."""
_TABLES_KEY = b"\xa6tables"

_DIFF_FIRST = {
    ("colls", "t_enter"),
    ("colls", "seq"),
    ("steps", "t_start"),
    ("steps", "step"),
    ("phases", "t0"),
    ("samples", "t"),
}
"""Columns that usually grow row by row: their differences are tried."""

_REFS: dict[tuple[str, str], tuple[str, ...]] = {
    ("colls", "t_start"): ("t_enter",),
    ("colls", "t_end"): ("t_start", "t_enter"),
    ("colls", "t_exit"): ("t_end", "t_enter"),
    ("steps", "t_end"): ("t_start",),
    ("phases", "t1"): ("t0",),
}
"""Columns tried as the difference to an earlier column of the same table (earlier in
schema order, so a reader has decoded the reference first)."""

_SPECS = {
    name: {**TABLES.get(name, {}), **REDUCED_TABLES.get(name, {})}
    for name in (*TABLES, *(n for n in REDUCED_TABLES if n not in TABLES))
}
"""The columns stored as columns: every table of the schema, with the ``rank`` and ``inc``
columns and the ``cells`` and ``instances`` tables of a relay's ``reduced`` messages (a
superset: a message without them is stored as before)."""

_ORDER = {(t, c): (i, j) for i, (t, spec) in enumerate(_SPECS.items()) for j, c in enumerate(spec)}

_PACKED = "@u"
"""A packed column's offsets (`schema.pack_column`) are stored under its name with this
suffix and their width (``t_enter@u4``): unsigned integers of that width, whatever the
column's dtype; the base and width themselves stay in the skeleton."""


def _base_name(cname: str) -> str:
    return cname.split(_PACKED, 1)[0]


def _column_dtype(tname: str, cname: str) -> np.dtype | None:
    """The dtype a stored column's bytes hold; None for a name this schema lacks."""
    base, _, width = cname.partition(_PACKED)
    dt = _SPECS.get(tname, {}).get(base)
    if dt is None or not width:
        return dt
    got = _UINT.get(int(width)) if width in ("1", "2", "4") else None
    return got if got is not None and dt.kind in "iu" else None


class CodecError(ValueError):
    """A stored body that does not decode: ``str(exc)`` says what was wrong."""


# -- writing --------------------------------------------------------------------------------


def _short_key(up: msgpack.Unpacker, payload: bytes) -> str | None:
    """The next map key when it is a short string (a schema name); otherwise skips it."""
    if 0xA0 <= payload[up.tell()] <= 0xBF:
        key = up.unpack()
        return key if isinstance(key, str) else None
    up.skip()
    return None


def column_ranges(payload: bytes) -> list[tuple[str, str, int, int]]:
    """The byte ranges of the schema columns in a message: (table, column, offset, length),
    in offset order; [] when it holds none. Never raises: what cannot be walked ends the
    list there (the ranges only decide what is stored as columns, not what is read back).
    """
    out: list[tuple[str, str, int, int]] = []
    up = msgpack.Unpacker(raw=False, max_buffer_size=len(payload) + 1)
    up.feed(payload)
    try:
        for _ in range(up.read_map_header()):
            if _short_key(up, payload) == "tables":
                break
            up.skip()
        else:
            return out
        for _ in range(up.read_map_header()):
            tname = _short_key(up, payload)
            spec = _SPECS.get(tname) if tname is not None else None
            if spec is None:
                up.skip()
                continue
            for _ in range(up.read_map_header()):
                if _short_key(up, payload) != "cols":
                    up.skip()
                    continue
                for _ in range(up.read_map_header()):
                    cname = _short_key(up, payload)
                    start = up.tell()
                    if payload[start] == _PACKED_HEADER and cname is not None:
                        # [base, width, offsets]: the offsets are the column's bytes.
                        up.read_array_header()
                        up.skip()
                        width = up.unpack()
                        if type(width) is int and 0 < width <= 4:
                            cname = f"{cname}{_PACKED}{width}"
                        start = up.tell()
                    up.skip()
                    dt = _column_dtype(tname, cname) if cname is not None and tname else None
                    head = _BIN_HEADER.get(payload[start])
                    if dt is None or head is None or tname is None or cname is None:
                        continue
                    length = up.tell() - start - head
                    if length > 0 and length % dt.itemsize == 0:
                        out.append((tname, cname, start + head, length))
    except Exception:  # a message this walk cannot follow: the ranges found so far
        pass
    return out


def _as_int64(buf: bytes, dt: np.dtype) -> np.ndarray:
    """A column's values as int64: integers sign-extended, floats as their bits."""
    if dt.kind == "f":
        return np.frombuffer(buf, _SIGNED[dt.itemsize]).astype(np.int64)
    return np.frombuffer(buf, dt).astype(np.int64)


def _gather(parts: list[np.ndarray], dt: np.dtype) -> np.ndarray:
    """One column's values as int64, from (messages, bytes) slices of byte matrices:
    integers sign-extended, floats as their bits."""
    as_int = _SIGNED[dt.itemsize] if dt.kind == "f" else dt
    xs = [p.view(as_int).astype(np.int64).reshape(-1) for p in parts]
    return xs[0] if len(xs) == 1 else np.concatenate(xs)


def _span_width(v: np.ndarray) -> tuple[int, int]:
    """(base, width): the minimum of ``v`` and the bytes that hold ``v - base``."""
    if v.shape[0] == 0:
        return 0, 0
    lo, hi = int(v.min()), int(v.max())
    span = hi - lo
    return lo, next(w for w in _WIDTHS if w == 8 or span < 1 << (8 * w))


def _diff(x: np.ndarray) -> np.ndarray:
    v = np.empty_like(x)
    if x.shape[0]:
        v[0] = x[0]
        np.subtract(x[1:], x[:-1], out=v[1:])
    return v


def _narrow(v: np.ndarray, base: int, width: int) -> bytes:
    """``v - base`` (wrapping) as ``width``-byte unsigned integers, byte plane by plane."""
    if width == 0:
        return b""
    u = np.empty(v.shape[0], dtype=_UINT[width])
    np.subtract(v.view(np.uint64), np.uint64(base & _MASK64), out=u, casting="unsafe")
    return u.view(np.uint8).reshape(-1, width).T.tobytes()


def _encode_column(
    x: np.ndarray, key: tuple[str, str], done: dict[str, tuple[int, np.ndarray, tuple]], sig
) -> bytes:
    """One column's data entry; ``done`` holds the table's columns encoded before it."""
    tname, cname = key
    base_key = (tname, _base_name(cname))
    tries: list[tuple[int, int, np.ndarray]] = []
    if _SPECS[tname][base_key[1]].kind != "f":
        for ref in _REFS.get(base_key, ()):
            got = done.get(ref)
            if got is not None and got[2] == sig:  # the same rows, message by message
                tries.append((_TRANSFORM_REF, got[0], x - got[1]))
        if base_key in _DIFF_FIRST:
            tries.append((_TRANSFORM_DIFF, 0, _diff(x)))
    tries.append((_TRANSFORM_NONE, 0, x))
    best = None
    for transform, ref_k, v in tries:
        base, width = _span_width(v)
        if best is None or width < best[3]:
            best = (transform, ref_k, base, width, v)
        if width <= 1:
            break
    assert best is not None
    transform, ref_k, base, width, v = best
    return _COLUMN.pack(transform, ref_k, width, base, x.shape[0]) + _narrow(v, base, width)


class Encoder:
    """Turns buffered messages into format-2 frame bodies (tag byte + zstd frame).

    One per writer, used by one thread at a time (the writer encodes under its I/O lock):
    it holds a zstd context and the templates of the shapes it has seen."""

    def __init__(self, level: int = LEVEL, block_bytes: int = BLOCK_BYTES) -> None:
        self.level = level
        self.block_bytes = min(block_bytes, MAX_MESSAGE_BYTES // 2)
        self._zstd = zstandard.ZstdCompressor(level=level, write_content_size=True)
        self._templates: dict[tuple[int, int], list[tuple[str, str, int, int]]] = {}

    def _template(self, key: tuple[int, int], payload: bytes) -> list[tuple[str, str, int, int]]:
        tpl = self._templates.get(key)
        if tpl is None:
            if len(self._templates) >= MAX_TEMPLATES:
                self._templates.clear()
            tpl = self._templates[key] = column_ranges(payload)
        return tpl

    def encode_block(self, messages: Sequence[tuple[bytes, int]]) -> bytes:
        """The decompressed body of a block holding ``messages`` ((payload, t_recv_ns))."""
        m = len(messages)
        shape_of = np.full(m, _WHOLE, dtype="<u2")
        shapes: dict[tuple[int, int], list[int]] = {}
        whole: list[int] = []
        for i, (payload, _) in enumerate(messages):
            pos = payload.find(_TABLES_KEY)
            if pos < 0:
                whole.append(i)
                continue
            shapes.setdefault((len(payload), pos), []).append(i)
        keys: dict[tuple[str, str], int] = {}
        parts: list[list[np.ndarray]] = []
        """Per column: the (messages, bytes) slices of the shapes' byte matrices."""
        sigs: list[list[tuple[int, int]]] = []
        """Per column: (shape, length) of each range it came from (which rows it holds)."""
        shape_parts: list[bytes] = []
        for key, idx in shapes.items():
            tpl = self._template(key, messages[idx[0]][0])
            g = len(shape_parts)
            if not tpl or g >= MAX_SHAPES or len(keys) + len(tpl) > MAX_COLUMNS:
                whole.extend(idx)
                continue
            size = key[0]
            rows = np.frombuffer(b"".join(messages[i][0] for i in idx), np.uint8)
            rows = rows.reshape(len(idx), size)
            ranges, gaps, at = [], [], 0
            for tname, cname, off, length in tpl:
                k = keys.setdefault((tname, cname), len(parts))
                if k == len(parts):
                    parts.append([])
                    sigs.append([])
                parts[k].append(rows[:, off : off + length])
                sigs[k].append((g, length))
                ranges.append(_RANGE.pack(k, off, length))
                gaps.append(rows[:, at:off])
                at = off + length
            gaps.append(rows[:, at:])
            skeletons = np.concatenate(gaps, axis=1).tobytes()
            shape_parts.append(
                b"".join((_SHAPE.pack(len(idx), size, len(tpl)), *ranges, skeletons))
            )
            shape_of[idx] = g
        whole.sort()
        names = list(keys)
        # Column data in schema order, so that a reference precedes its user.
        data: list[bytes] = []
        done: dict[str, dict[str, tuple[int, np.ndarray, tuple]]] = {}
        order = {k: _ORDER[(t, _base_name(c))] for k, (t, c) in enumerate(names)}
        for k in sorted(range(len(names)), key=order.__getitem__):
            tname, cname = names[k]
            dt = _column_dtype(tname, cname)
            assert dt is not None  # column_ranges keeps only columns that have one
            x = _gather(parts[k], dt)
            sig = tuple(sigs[k])
            table = done.setdefault(tname, {})
            data.append(struct.pack("<H", k) + _encode_column(x, names[k], table, sig))
            table[_base_name(cname)] = (k, x, sig)
        whole_bytes = [messages[i][0] for i in whole]
        out = [
            _HEAD.pack(m, len(names), len(shape_parts), len(whole), sum(map(len, whole_bytes))),
            np.fromiter((t for _, t in messages), dtype="<i8", count=m).tobytes(),
            shape_of.tobytes(),
            np.fromiter(map(len, whole_bytes), dtype="<u4", count=len(whole)).tobytes(),
            *whole_bytes,
        ]
        for tname, cname in names:
            t, c = tname.encode(), cname.encode()
            out += [bytes((len(t),)), t, bytes((len(c),)), c]
        return b"".join([*out, *shape_parts, *data])

    def bodies(self, messages: Sequence[tuple[bytes, int]]) -> Iterator[tuple[bytes, int]]:
        """(body, t_recv_ns of its first message) for ``messages`` in order, a block of up
        to ``block_bytes`` wire bytes at a time; a larger message goes alone."""
        i, n = 0, len(messages)
        while i < n:
            payload, t = messages[i]
            if len(payload) > self.block_bytes:
                yield bytes((TAG_MESSAGE,)) + self._zstd.compress(payload), t
                i += 1
                continue
            j, size = i, 0
            while j < n and size + len(messages[j][0]) <= self.block_bytes:
                size += len(messages[j][0])
                j += 1
            yield bytes((TAG_BLOCK,)) + self._zstd.compress(self.encode_block(messages[i:j])), t
            i = j


# -- reading --------------------------------------------------------------------------------


class _Reader:
    """Bounds-checked cursor over a decompressed block."""

    def __init__(self, data: bytes) -> None:
        self.view = memoryview(data)
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.view):
            raise CodecError(f"the block ends inside {what} ({n} bytes at {self.pos})")
        out = self.view[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct, what: str) -> tuple:
        return st.unpack(self.take(st.size, what))

    def array(self, dtype: str, n: int, what: str) -> np.ndarray:
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(n * dt.itemsize, what), dtype=dt)

    def name(self, what: str) -> str:
        (n,) = self.take(1, what)
        try:
            return bytes(self.take(n, what)).decode()
        except UnicodeDecodeError:
            raise CodecError(f"{what} is not UTF-8") from None


def _widen(raw: memoryview, rows: int, width: int, base: int) -> np.ndarray:
    """Inverse of `_narrow`: int64 values."""
    if width == 0:
        return np.full(rows, base, dtype=np.int64)
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(width, rows)
    u = np.ascontiguousarray(planes.T).view(_UINT[width]).reshape(rows)
    return (u.astype(np.uint64) + np.uint64(base & _MASK64)).view(np.int64)


def _column_bytes(v: np.ndarray, dt: np.dtype) -> np.ndarray:
    """int64 values back in the column's dtype, as bytes (a uint8 array)."""
    out = v.astype(_SIGNED[dt.itemsize] if dt.kind == "f" else dt)
    return out.view(np.uint8)


def decode_block(data: bytes) -> list[tuple[int, bytes]]:
    """The (t_recv_ns, wire message) pairs of a decompressed block, in order.

    Raises:
        CodecError: the block is malformed (names what was wrong).
    """
    r = _Reader(data)
    m, k_count, g_count, w_count, w_total = r.unpack(_HEAD, "the block head")
    if k_count > MAX_COLUMNS or g_count > MAX_SHAPES:
        raise CodecError(f"the block has {k_count} columns and {g_count} shapes")
    times = r.array("<i8", m, "the receive times")
    shape_of = r.array("<u2", m, "the message shapes")
    lengths = r.array("<u4", w_count, "the whole-message lengths")
    if int(lengths.sum(dtype=np.uint64)) != w_total:
        raise CodecError(f"whole messages of {int(lengths.sum())} bytes, the head says {w_total}")
    if int((shape_of == _WHOLE).sum()) != w_count:
        raise CodecError(f"{w_count} whole messages, the shapes say otherwise")
    whole_bytes = r.take(w_total, "the whole messages")
    total = w_total
    names = []
    for k in range(k_count):
        tname, cname = r.name("a table name"), r.name("a column name")
        dt = _column_dtype(tname, cname)
        if dt is None:
            raise CodecError(f"column {k} is {tname}.{cname}, not a schema column")
        names.append((tname, cname, dt))
    wanted = [0] * k_count
    """Bytes of each column the shapes take."""
    shapes = []
    for g in range(g_count):
        count, size, n_ranges = r.unpack(_SHAPE, "a shape")
        total += count * size
        if total > MAX_MESSAGE_BYTES:
            raise CodecError(f"the block's messages exceed {MAX_MESSAGE_BYTES} bytes")
        ranges, at = [], 0
        for _ in range(n_ranges):
            k, off, length = r.unpack(_RANGE, "a column range")
            if k >= k_count or off < at or off + length > size:
                raise CodecError(f"shape {g} has a range ({k}, {off}, {length}) out of place")
            if length % names[k][2].itemsize:
                raise CodecError(f"shape {g} range of {length} bytes splits a value")
            ranges.append((k, off, length))
            wanted[k] += count * length
            at = off + length
        skeleton_len = size - sum(length for _, _, length in ranges)
        skel = r.array("<u1", count * skeleton_len, f"shape {g}'s skeletons")
        shapes.append((count, size, ranges, skel.reshape(count, skeleton_len)))
    if int((shape_of != _WHOLE).sum()) and int(shape_of[shape_of != _WHOLE].max()) >= g_count:
        raise CodecError("a message names a shape the block lacks")
    counts = np.bincount(shape_of[shape_of != _WHOLE], minlength=g_count)
    if any(int(counts[g]) != shapes[g][0] for g in range(g_count)):
        raise CodecError("the shapes' message counts differ from the messages'")
    columns: dict[int, np.ndarray] = {}
    values: dict[int, np.ndarray] = {}
    for _ in range(k_count):
        (k,) = r.unpack(_INDEX, "a column index")
        if k >= k_count or k in columns:
            raise CodecError(f"column data for column {k} (of {k_count}) again or out of range")
        tname, cname, dt = names[k]
        transform, ref_k, width, base, rows = r.unpack(_COLUMN, f"column {tname}.{cname}")
        if width not in _WIDTHS or rows * dt.itemsize != wanted[k]:
            raise CodecError(f"column {tname}.{cname}: {rows} rows of width {width}")
        v = _widen(r.take(rows * width, f"column {tname}.{cname}"), rows, width, base)
        if transform == _TRANSFORM_DIFF:
            v = np.cumsum(v, dtype=np.int64)
        elif transform == _TRANSFORM_REF:
            ref = values.get(ref_k)
            if ref is None or ref.shape[0] != rows:
                raise CodecError(f"column {tname}.{cname} refers to column {ref_k}")
            v = v + ref
        elif transform != _TRANSFORM_NONE:
            raise CodecError(f"column {tname}.{cname} has transform {transform}")
        values[k] = v
        columns[k] = _column_bytes(v, dt)
    if r.pos != len(r.view):
        raise CodecError(f"{len(r.view) - r.pos} bytes after the last column")
    return _splice(times, shape_of, lengths, whole_bytes, shapes, columns)


def _splice(
    times: np.ndarray,
    shape_of: np.ndarray,
    lengths: np.ndarray,
    whole_bytes: memoryview,
    shapes: list[tuple[int, int, list[tuple[int, int, int]], np.ndarray]],
    columns: dict[int, np.ndarray],
) -> list[tuple[int, bytes]]:
    """Messages from their skeletons and column bytes, in message order."""
    used = dict.fromkeys(columns, 0)
    rebuilt: list[np.ndarray] = []
    for count, size, ranges, skel in shapes:
        out = np.empty((count, size), dtype=np.uint8)
        at = s_at = 0
        for k, off, length in ranges:
            out[:, at:off] = skel[:, s_at : s_at + off - at]
            s_at += off - at
            n = count * length
            out[:, off : off + length] = columns[k][used[k] : used[k] + n].reshape(count, length)
            used[k] += n
            at = off + length
        out[:, at:] = skel[:, s_at:]
        rebuilt.append(out)
    result: list[tuple[int, bytes]] = []
    next_row = [0] * len(shapes)
    w_at = w_i = 0
    for i in range(shape_of.shape[0]):
        g = int(shape_of[i])
        if g == _WHOLE:
            n = int(lengths[w_i])
            payload = bytes(whole_bytes[w_at : w_at + n])
            w_at += n
            w_i += 1
        else:
            payload = rebuilt[g][next_row[g]].tobytes()
            next_row[g] += 1
        result.append((int(times[i]), payload))
    return result


class Decoder:
    """Decodes format-2 frame bodies, within ``schema.MAX_MESSAGE_BYTES`` of output."""

    def __init__(self) -> None:
        self._zstd = zstandard.ZstdDecompressor()

    def _inflate(self, data: memoryview | bytes) -> bytes:
        try:
            size = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise CodecError(f"not a zstd frame ({exc})") from None
        if size < 0:
            raise CodecError("the zstd frame does not state its decompressed size")
        if size > MAX_MESSAGE_BYTES:
            raise CodecError(f"the zstd frame decompresses to {size} bytes > {MAX_MESSAGE_BYTES}")
        try:
            out = self._zstd.decompress(data, max_output_size=size, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd: {exc}") from None
        if len(out) != size:
            raise CodecError(f"the zstd frame gave {len(out)} bytes, it states {size}")
        return out

    def messages(self, body: memoryview | bytes, t_recv_ns: int) -> list[tuple[int, bytes]]:
        """(t_recv_ns, wire message) pairs of one frame body.

        Raises:
            CodecError: the body does not decode (names what was wrong).
        """
        if len(body) < 1:
            raise CodecError("empty frame body")
        tag = body[0]
        if tag == TAG_MESSAGE:
            return [(t_recv_ns, self._inflate(body[1:]))]
        if tag == TAG_BLOCK:
            return decode_block(self._inflate(body[1:]))
        raise CodecError(f"unknown frame body tag {tag}")
