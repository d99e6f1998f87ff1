"""Kineto events read as columns straight from the bytes: no object per event.

Most events of a profiler trace are device events (kernels, copies, sets), the runtime calls
that launched them, and host ops; of each, `kineto.parse_file` keeps a few numbers or
nothing. `scan` finds, for all the events of a chunk at once, the keys and values it needs
with numpy operations over the positions of the chunk's quotes, and settles the events
whose fields it can read with certainty:

- *skipped*: of no use to the importer (not a complete event, a category it does not read,
  a host op whose name no rule takes);
- *device*: a kernel, copy or set that is not an NCCL kernel: start, end, class and
  correlation;
- *launch*: a runtime or driver call: correlation and start;
- *backward*: an ``autograd::engine::evaluate_function`` op: start and end.

Everything else (steps, phase annotations, NCCL kernels, host collectives, and any event
whose layout `scan` is not sure of) is left to the parser, event by event.

What "sure" means. The chunk holds no backslash (the caller's condition), so its quotes
alternate between opening and closing a string, starting with an opening one. A key is a
string directly followed by ``:``. An event's key counts only when it occurs exactly once in
the event and outside the event's inner object (its ``args``; an event with more than one
inner object is left to the parser), so that it is the key a parser keeps. A string value
must follow its key's ``:`` after at most one blank. A number must be
``-?(0|[1-9][0-9]*)(.[0-9]+)?`` (an exponent leaves the event to the parser) followed, after
blanks, by ``,`` or ``}``; it is converted to the float64 nearest to it, as a JSON parser
does (`decimal_to_float`), so that both paths give the same values. The fields the importer
does not read are not checked, as they are not in skipped events.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUMBER_BYTES = 24
"""Bytes read of a number's text after its sign (19 digits, a point, the byte after)."""
MAX_DIGITS = 19
"""Most digits of a number read here (its digits as one uint64)."""

_BLANKS = np.zeros(256, bool)
_BLANKS[[0x20, 0x09, 0x0A, 0x0D]] = True
_DIGIT = np.zeros(256, bool)
_DIGIT[0x30:0x3A] = True

KEYS = (b"ph", b"cat", b"name", b"ts", b"dur", b"args", b"correlation")
PH, CAT, NAME, TS, DUR, ARGS, CORR = range(len(KEYS))

DEVICE_CATS = (b"kernel", b"gpu_memcpy", b"gpu_memset")
LAUNCH_CATS = (b"cuda_runtime", b"cuda_driver")
HOST_CATS = (b"user_annotation", b"cpu_op", b"python_function")
CATS = DEVICE_CATS + LAUNCH_CATS + HOST_CATS
_FIRST_LAUNCH, _FIRST_HOST = len(DEVICE_CATS), len(DEVICE_CATS) + len(LAUNCH_CATS)
OTHER_CAT = len(CATS)
"""Category code of a string no reader takes."""

BACKWARD_PREFIX = b"autograd::engine::evaluate_function"


@dataclass
class Scanned:
    """What `scan` settled in one chunk (times as float µs, as the parser gives them)."""

    settled: np.ndarray
    """bool per event: skipped or read here (the parser need not look at it)."""
    skipped: int
    dev_t0: np.ndarray
    dev_t1: np.ndarray
    dev_cls: np.ndarray
    dev_corr: np.ndarray
    launch_corr: np.ndarray
    launch_t0: np.ndarray
    bwd_t0: np.ndarray
    bwd_t1: np.ndarray


PAD = 64
"""Zero bytes after a chunk (`padded`), so that every window read from it lies inside."""


def padded(text: bytes) -> np.ndarray:
    """The bytes of a chunk as uint8, followed by `PAD` zeros (read-only)."""
    return np.frombuffer(text + bytes(PAD), np.uint8)


def _windows(a: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """uint8 (len(at), width): the bytes of ``a`` (padded by `PAD` zeros) from each
    position (positions past the chunk read its padding)."""
    rows = np.ndarray((a.shape[0] - width + 1, width), np.uint8, a, 0, (1, 1))
    return rows[np.minimum(at, a.shape[0] - PAD)]


_MASKS = np.array(
    [[(1 << (8 * min(k, 8))) - 1, (1 << (8 * min(max(k - 8, 0), 8))) - 1] for k in range(17)],
    np.uint64,
)
"""Row k: masks of the first k bytes of a 16-byte window read as two little-endian words."""
_MASKS4 = np.array([(1 << (8 * k)) - 1 for k in range(5)], np.uint32)
"""Entry k: the mask of the first k bytes of a little-endian 4-byte word."""


def _strings_equal(
    a: np.ndarray, start: np.ndarray, length: np.ndarray, words: tuple[bytes, ...]
) -> np.ndarray:
    """int per string ``a[start:start + length]``: the index of the equal word in ``words``
    (each at most 16 bytes), or ``len(words)``."""
    w = _windows(a, start, 16).view(np.uint64)
    m = _MASKS[np.clip(length, 0, 16)]
    w0, w1 = w[:, 0] & m[:, 0], w[:, 1] & m[:, 1]
    out = np.full(start.shape[0], len(words))
    for i in range(len(words) - 1, -1, -1):
        word = np.frombuffer(words[i].ljust(16, b"\0"), np.uint64)
        out[(length == len(words[i])) & (w0 == word[0]) & (w1 == word[1])] = i
    return out


def _starts_with(a: np.ndarray, start: np.ndarray, length: np.ndarray, prefix: bytes) -> np.ndarray:
    """bool per string ``a[start:start + length]``: whether it starts with ``prefix``."""
    n = len(prefix)
    ok = length >= n
    if not ok.any():
        return ok
    want = np.frombuffer(prefix, np.uint8)
    ok[ok] = (_windows(a, start[ok], n) == want).all(axis=1)
    return ok


def decimal_to_float(neg: np.ndarray, digits: np.ndarray, frac: np.ndarray) -> np.ndarray:
    """The float64 nearest to each ``±digits / 10**frac`` (ties to even), as a JSON
    parser's correctly rounded conversion gives it.

    Args:
        neg: bool, the number is negative.
        digits: uint64, every digit of the number (below 10**19).
        frac: int64 in [0, 9], how many of them follow the point; the integer part
            ``digits // 10**frac`` must be below 2**53.
    """
    scale = 10 ** frac.astype(np.uint64)
    out = digits / scale.astype(np.float64)  # both exact below 2**53: one rounding
    big = digits >= np.uint64(2**53)
    if big.any():
        # q + r / 10**f with q an integer below 2**53, so on the float grid, which steps by
        # u = 2**-e up to q + 1: the nearest point is q + j*u, j = round(r * 2**e / 10**f),
        # ties to the even significand (q * 2**e + j).
        q, r = (x.astype(np.int64) for x in np.divmod(digits[big], scale[big]))
        f = scale[big].astype(np.int64)
        e = _grid_exponent(q)
        unit = np.left_shift(np.int64(1), e)
        j, rem = np.divmod(r * unit, f)
        odd = ((q * unit + j) & 1) == 1
        j += (2 * rem > f) | ((2 * rem == f) & odd)
        out[big] = q.astype(np.float64) + j.astype(np.float64) / unit.astype(np.float64)
    return np.where(neg, -out, out)


def _grid_exponent(q: np.ndarray) -> np.ndarray:
    """int64 e per integer ``q`` in [1, 2**53): the float64 grid near ``q`` steps by
    ``2**-e`` (``2**52 <= q * 2**e < 2**53``)."""
    bits = np.zeros(q.shape[0], np.int64)
    v = q.copy()
    for shift in (32, 16, 8, 4, 2, 1):
        high = v >= (np.int64(1) << shift)
        bits += np.where(high, shift, 0)
        v = np.where(high, v >> shift, v)
    return 52 - bits


def read_numbers(
    a: np.ndarray, at: np.ndarray, is_int: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The JSON numbers whose text starts at each position of ``at``: (float64 values, or
    int64 with ``is_int``; bool readable). Unreadable: not ``-?(0|[1-9][0-9]*)(.[0-9]+)?``
    of at most `MAX_DIGITS` digits (with ``is_int``: no point), or not followed, after
    blanks, by ``,`` or ``}``."""
    n = at.shape[0]
    empty = np.zeros(0, np.int64 if is_int else np.float64)
    if n == 0:
        return empty, np.zeros(0, bool)
    neg = a[np.minimum(at, a.shape[0] - 1)] == 0x2D
    body = _windows(a, at + neg, NUMBER_BYTES)
    value = body - np.uint8(0x30)  # a digit's value; other bytes wrap past 9
    digit = value < 10
    point = body == 0x2E
    rows = np.arange(n)
    # The number ends at the first byte that is neither a digit nor the first point.
    first_point = point.argmax(axis=1)
    first_point[~point[rows, first_point]] = NUMBER_BYTES
    part = digit.copy()
    has = first_point < NUMBER_BYTES
    part[rows[has], first_point[has]] = True
    end = (~part).argmax(axis=1)
    end[part[rows, end]] = NUMBER_BYTES
    has_point = first_point < end
    int_len = np.where(has_point, first_point, end)
    frac = np.where(has_point, end - first_point - 1, 0)
    ok = (int_len >= 1) & (end < NUMBER_BYTES - 1) & (int_len + frac <= MAX_DIGITS)
    ok &= ~has_point | (frac >= 1)
    ok &= ~((body[:, 0] == 0x30) & (int_len > 1))  # no leading zero
    if is_int:
        ok &= ~has_point
    # After the number: , or }, or blanks and then one of them.
    stop = body[rows, np.minimum(end, NUMBER_BYTES - 1)]
    ends = (stop == 0x2C) | (stop == 0x7D)
    blank = np.flatnonzero(ok & ~ends & _BLANKS[stop])
    if blank.shape[0]:
        tail = _windows(a, at[blank] + neg[blank] + end[blank], 16)
        nonblank = ~_BLANKS[tail]
        first = tail[np.arange(blank.shape[0]), nonblank.argmax(axis=1)]
        ends[blank] = nonblank.any(axis=1) & ((first == 0x2C) | (first == 0x7D))
    ok &= ends
    # The digits as one integer, column by column.
    digits = np.zeros(n, np.uint64)
    ten = np.uint64(10)
    for j in range(int(end[ok].max(initial=0))):
        take = ok & digit[:, j] & (j < end)
        digits[take] = digits[take] * ten + value[take, j]
    if is_int:
        ok &= digits < np.uint64(2**63)
        signed = np.where(ok, digits, 0).astype(np.int64)
        return np.where(neg, -signed, signed), ok
    ok &= digits // 10 ** frac.astype(np.uint64) < np.uint64(2**53)
    digits = np.where(ok, digits, np.uint64(0))
    return decimal_to_float(neg, digits, np.where(ok, frac, 0)), ok


def _keys(a: np.ndarray, quotes: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Where each of `KEYS` occurs: (per key, the indices of its strings), with the strings'
    opening and closing quotes. String ``i`` opens at ``quotes[2i]``."""
    m = quotes.shape[0] // 2
    qo, qc = quotes[0 : 2 * m : 2], quotes[1 : 2 * m : 2]
    after = np.minimum(qc + 1, a.shape[0] - 1)
    is_key = np.flatnonzero(a[after] == 0x3A)
    length = qc[is_key] - qo[is_key] - 1
    code = np.full(is_key.shape[0], len(KEYS))
    # The short keys by their (at most 4) bytes as one word, the long one byte by byte.
    short = np.flatnonzero((length >= 2) & (length <= 4))
    word = _windows(a, qo[is_key[short]] + 1, 4).view(np.uint32)[:, 0]
    word &= _MASKS4[length[short]]
    for k, key in enumerate(KEYS):
        if len(key) <= 4:
            want = np.frombuffer(key.ljust(4, b"\0"), np.uint32)[0]
            code[short[word == want]] = k
    long = np.flatnonzero(length == len(KEYS[CORR]))
    same = _windows(a, qo[is_key[long]] + 1, len(KEYS[CORR])) == np.frombuffer(KEYS[CORR], np.uint8)
    code[long[same.all(axis=1)]] = CORR
    return [is_key[code == k] for k in range(len(KEYS))], qo, qc


def _once(
    at: np.ndarray,
    qo: np.ndarray,
    ev_start: np.ndarray,
    ev_end: np.ndarray,
    inner_open: np.ndarray,
    inner_close: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the key strings ``at``: per event, (how many of them it holds, the string of the
    first, whether that one lies outside the event's inner object)."""
    pos = qo[at]
    lo = np.searchsorted(pos, ev_start)
    count = np.searchsorted(pos, ev_end) - lo
    which = at[np.minimum(lo, max(at.shape[0] - 1, 0))] if at.shape[0] else np.zeros_like(lo)
    p = qo[which] if at.shape[0] else np.zeros_like(lo)
    top = (inner_open < 0) | (p < inner_open) | (p > inner_close)
    return count, which, top


def _string_value(
    a: np.ndarray, qo: np.ndarray, qc: np.ndarray, key: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For key strings ``key``: (whether a string value follows its ``:`` after at most one
    blank, the value's first byte, its length)."""
    nxt = np.minimum(key + 1, qo.shape[0] - 1)
    gap = qo[nxt] - qc[key]
    ok = (key + 1 < qo.shape[0]) & (
        (gap == 2) | ((gap == 3) & _BLANKS[a[np.minimum(qc[key] + 2, a.shape[0] - 1)]])
    )
    return ok, qo[nxt] + 1, qc[nxt] - qo[nxt] - 1


def _value_at(a: np.ndarray, qc: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Where the value of each key string ``key`` starts (after its ``:`` and one blank)."""
    at = qc[key] + 2
    return at + _BLANKS[a[np.minimum(at, a.shape[0] - 1)]]


def scan(
    text: bytes,
    a: np.ndarray,
    quotes: np.ndarray,
    ev_start: np.ndarray,
    ev_end: np.ndarray,
    inner_open: np.ndarray,
    inner_close: np.ndarray,
    host_prefixes: tuple[bytes, ...],
    host_names: tuple[bytes, ...],
    max_us: float,
) -> Scanned:
    """Settle what can be settled of the events ``a[ev_start[i] : ev_end[i] + 1]``.

    Args:
        text: the chunk (no backslash), starting outside every string.
        a: its bytes, `padded`.
        quotes: positions of every ``"`` in ``a``.
        ev_start, ev_end: each event's ``{`` and ``}``.
        inner_open, inner_close: the event's one inner object's braces; -1 where it has
            none, -2 where it has more than one (such events are left to the parser).
        host_prefixes, host_names: the host op names the parser reads (by prefix, whole).
        max_us: times beyond ± this, and durations beyond it, are left to the parser.
    """
    n = ev_start.shape[0]
    if n == 0 or quotes.shape[0] < 2:
        return _nothing(n)
    keys, qo, qc = _keys(a, quotes)
    span = (ev_start, ev_end, inner_open, inner_close)
    got = [_once(k, qo, *span) for k in keys]
    simple = inner_open != -2
    one = [simple & (c == 1) & top for c, _, top in got]

    def string(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ok, start, length = _string_value(a, qo, qc, got[k][1])
        return one[k] & ok, start, length

    ph_ok, ph_at, ph_len = string(PH)
    is_x = ph_ok & (ph_len == 1) & (a[np.minimum(ph_at, a.shape[0] - 1)] == 0x58)
    cat_ok, cat_at, cat_len = string(CAT)
    cat = np.where(cat_ok, _strings_equal(a, cat_at, cat_len, CATS), -1)
    name_ok, name_at, name_len = string(NAME)
    skip = ph_ok & ~is_x
    x = is_x & cat_ok
    skip |= x & (cat == OTHER_CAT)
    host = x & (cat >= _FIRST_HOST) & (cat < OTHER_CAT) & name_ok
    wanted = np.zeros(n, bool)
    for p in host_prefixes:
        wanted[host] |= _starts_with(a, name_at[host], name_len[host], p)
    if host.any():
        exact = _strings_equal_long(a, name_at[host], name_len[host], host_names)
        wanted[host] |= exact
    skip |= host & ~wanted
    # The numbers: ts and dur once each at the top; read where an event may use them.
    timed = x & name_ok & one[TS] & one[DUR] & ~skip
    ts, ts_ok = read_numbers(a, _value_at(a, qc, got[TS][1][timed]))
    dur, dur_ok = read_numbers(a, _value_at(a, qc, got[DUR][1][timed]))
    t_ok = np.zeros(n, bool)
    # Times that cannot be true are left to the parser, which counts them.
    t_ok[timed] = ts_ok & dur_ok & (np.abs(ts) < max_us) & (dur >= 0) & (dur < max_us)
    t0 = np.zeros(n)
    t1 = np.zeros(n)
    t0[timed], t1[timed] = ts, ts + dur
    bwd = host & wanted & t_ok & _starts_with(a, name_at, name_len, BACKWARD_PREFIX)
    # Device and runtime events: the correlation of their args.
    dev = t_ok & (cat >= 0) & (cat < _FIRST_HOST)
    dev &= ~_starts_with(a, name_at, name_len, b"nccl")
    corr, corr_ok = _correlations(a, qo, qc, keys[CORR], got[ARGS], span, dev)
    dev &= corr_ok
    kernel = dev & (cat < _FIRST_LAUNCH)
    launch = dev & (cat >= _FIRST_LAUNCH)
    cls = _device_classes(text, a, name_at[kernel], name_len[kernel])
    settled = skip | bwd | kernel | launch
    return Scanned(
        settled=settled,
        skipped=int(skip.sum()),
        dev_t0=t0[kernel],
        dev_t1=t1[kernel],
        dev_cls=cls,
        dev_corr=corr[kernel],
        launch_corr=corr[launch],
        launch_t0=t0[launch],
        bwd_t0=t0[bwd],
        bwd_t1=t1[bwd],
    )


def _nothing(n: int) -> Scanned:
    f, i = np.zeros(0), np.zeros(0, np.int64)
    return Scanned(np.zeros(n, bool), 0, f, f, np.zeros(0, np.int8), i, i, f, f, f)


def _strings_equal_long(
    a: np.ndarray, start: np.ndarray, length: np.ndarray, words: tuple[bytes, ...]
) -> np.ndarray:
    """bool per string ``a[start:start + length]``: whether it is one of ``words``."""
    out = np.zeros(start.shape[0], bool)
    for word in words:
        out |= (length == len(word)) & _starts_with(a, start, length, word)
    return out


def _correlations(
    a: np.ndarray,
    qo: np.ndarray,
    qc: np.ndarray,
    corr_keys: np.ndarray,
    args: tuple[np.ndarray, np.ndarray, np.ndarray],
    span: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    sel: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per event: (the ``correlation`` of its args, -1 where it has none; whether that is
    certain). Read only where ``sel``: no ``args``, or ``args`` once at the top whose value
    is not an object, or is the event's inner object holding at most one
    ``correlation``, an integer."""
    _, _, inner_open, inner_close = span
    n = sel.shape[0]
    corr = np.full(n, -1, np.int64)
    ok = np.zeros(n, bool)
    count, key, top = args
    ok |= sel & (count == 0)
    once = sel & (count == 1) & top
    at = _value_at(a, qc, key[once])
    is_obj = a[np.minimum(at, a.shape[0] - 1)] == 0x7B
    rows = np.flatnonzero(once)
    ok[rows[~is_obj]] = True
    rows, at = rows[is_obj], at[is_obj]
    rows = rows[at == inner_open[rows]]
    pos = qo[corr_keys]
    lo = np.searchsorted(pos, inner_open[rows])
    inside = np.searchsorted(pos, inner_close[rows]) - lo
    ok[rows[inside == 0]] = True
    rows, lo = rows[inside == 1], lo[inside == 1]
    value, readable = read_numbers(a, _value_at(a, qc, corr_keys[lo]), is_int=True)
    corr[rows[readable]] = value[readable]
    ok[rows[readable]] = True
    return corr, ok


def _occurrences(text: bytes, word: bytes) -> list[int]:
    """Every position of ``word`` in ``text``."""
    out = []
    i = text.find(word)
    while i >= 0:
        out.append(i)
        i = text.find(word, i + 1)
    return out


MEMORY_PREFIXES = (b"Memcpy", b"Memset", b"dma")
OTHER_INFIXES = (b"Memcpy", b"Sync")
COMPUTE_CLASS, MEMORY_CLASS, OTHER_CLASS = 0, 2, 3
"""`kineto.COMPUTE`, `kineto.MEMORY`, `kineto.OTHER` (`kineto.device_class`)."""


def _device_classes(
    text: bytes, a: np.ndarray, start: np.ndarray, length: np.ndarray
) -> np.ndarray:
    """int8 `kineto.device_class` of kernel names that do not start with ``nccl``: memory
    (``^Memcpy``, ``^Memset``, ``^dma``), other (``Memcpy`` or ``Sync`` anywhere), compute."""
    cls = np.full(start.shape[0], COMPUTE_CLASS, np.int8)
    if not start.shape[0]:
        return cls
    other = np.zeros(start.shape[0], bool)
    for word in OTHER_INFIXES:
        at = np.array(_occurrences(text, word), np.int64)
        i = np.searchsorted(at, start)
        found = np.r_[at, np.iinfo(np.int64).max][i]
        other |= found <= start + length - len(word)
    cls[other] = OTHER_CLASS
    memory = np.zeros(start.shape[0], bool)
    for p in MEMORY_PREFIXES:
        memory |= _starts_with(a, start, length, p)
    cls[memory] = MEMORY_CLASS
    return cls


GAP_BYTES = 16
"""Gaps between events up to this long are checked at once; a longer one ends a chunk's
events there (the next chunk starts with it)."""
_SEPARATOR = np.zeros(256, np.int8)
_SEPARATOR[[0x20, 0x09, 0x0A, 0x0D]] = 1
_SEPARATOR[0x2C] = 2


def separated(a: np.ndarray, gap_start: np.ndarray, gap_end: np.ndarray) -> int:
    """How many of the first gaps ``a[gap_start[i]:gap_end[i]]`` (``a`` `padded`) in a row
    are one comma among blanks (the events before each are complete members of the
    array)."""
    length = gap_end - gap_start
    kind = _SEPARATOR[_windows(a, gap_start, GAP_BYTES)]
    inside = np.arange(GAP_BYTES) < length[:, None]
    good = ((kind > 0) | ~inside).all(axis=1) & (((kind == 2) & inside).sum(axis=1) == 1)
    good &= length <= GAP_BYTES
    bad = np.flatnonzero(~good)
    return int(bad[0]) if bad.shape[0] else int(good.shape[0])
