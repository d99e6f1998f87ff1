"""Wire schema: round trip and every rejection reason."""

import msgpack
import numpy as np
import pytest

from rankscope.collector import schema


def _header(rank: int = 0) -> dict:
    return {"job": "j", "run": "r", "rank": rank, "inc": 0, "batch": 0}


def test_steps_round_trip_keeps_columns() -> None:
    steps = schema.empty_table("steps", 3)
    steps["step"][:] = [1, 2, 3]
    steps["t_start"][:] = [10, 20, 30]
    steps["t_end"][:] = [19, 29, 39]
    colls = schema.empty_table("colls", 2)
    colls["seq"][:] = [5, 6]
    colls["op"][:] = schema.OP_INDEX["all_reduce"]
    data = schema.steps_message(_header(), steps, colls=colls, phase_names=["mine"])
    msg = schema.decode(data)
    assert msg.kind == "steps"
    assert msg.tables["steps"]["t_end"].tolist() == [19, 29, 39]
    assert msg.tables["colls"]["seq"].tolist() == [5, 6]
    assert np.isnan(msg.tables["steps"]["attn_cost"]).all()
    assert msg.header["phase_names"] == ["mine"]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\xc1garbage", "bad_msgpack"),
        (msgpack.packb([1, 2]), "bad_msgpack"),
        (msgpack.packb({"v": 99, "kind": "steps"}), "bad_version"),
        (msgpack.packb({"v": schema.SCHEMA_VERSION, "kind": "nope"}), "bad_kind"),
        (
            msgpack.packb(
                {
                    "v": schema.SCHEMA_VERSION,
                    "kind": "stats",
                    "job": "j",
                    "run": "r",
                    "rank": "0",
                    "inc": 0,
                }
            ),
            "bad_type",
        ),
        (
            msgpack.packb(
                {
                    "v": schema.SCHEMA_VERSION,
                    "kind": "stats",
                    "job": "j",
                    "run": "r",
                    "rank": True,
                    "inc": 0,
                }
            ),
            "bad_type",
        ),
        (
            msgpack.packb(
                {
                    "v": schema.SCHEMA_VERSION,
                    "kind": "stats",
                    "job": "j",
                    "run": "r",
                    "rank": -1,
                    "inc": 0,
                }
            ),
            "bad_header",
        ),
    ],
)
def test_rejections_name_the_reason(data: bytes, reason: str) -> None:
    with pytest.raises(schema.SchemaError) as err:
        schema.decode(data)
    assert err.value.reason == reason


def test_column_size_mismatch_is_rejected() -> None:
    steps = schema.empty_table("steps", 2)
    msg = msgpack.unpackb(schema.steps_message(_header(), steps))
    msg["tables"]["steps"]["cols"]["t_end"] = b"\x00" * 7
    with pytest.raises(schema.SchemaError) as err:
        schema.decode(msgpack.packb(msg))
    assert err.value.reason == "bad_size"


def test_too_many_rows_is_rejected_before_allocation() -> None:
    msg = msgpack.unpackb(schema.steps_message(_header(), schema.empty_table("steps", 1)))
    msg["tables"]["steps"]["n"] = schema.MAX_ROWS + 1
    with pytest.raises(schema.SchemaError) as err:
        schema.decode(msgpack.packb(msg))
    assert err.value.reason == "bad_size"


def test_oversized_message_is_rejected() -> None:
    with pytest.raises(schema.SchemaError) as err:
        schema.decode(b"\x00" * (schema.MAX_MESSAGE_BYTES + 1))
    assert err.value.reason == "too_large"


def test_hello_rank_must_fit_world() -> None:
    ident = {"rank": 4, "world_size": 4, "local_rank": 0, "host": "h", "node_rank": 0, "pid": 1}
    data = schema.encode({**_header(4), "kind": "hello", "identity": ident})
    with pytest.raises(schema.SchemaError) as err:
        schema.decode(data)
    assert err.value.reason == "bad_hello"


# -- packed integer columns ----------------------------------------------------------------


def _colls(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A realistic collective table: one step, times over ~100 ms, two groups, two sizes."""
    co = schema.empty_table("colls", n)
    co["step"][:] = 7
    co["op"][:] = schema.OP_INDEX["all_reduce"]
    co["group"][:] = rng.integers(0, 2, n)
    co["seq"][:] = 40_000 + np.arange(n)
    co["nbytes"][:] = rng.choice([25 << 20, 3 << 20], n)
    co["t_enter"][:] = 1_765_000_000_000_000_000 + np.sort(rng.integers(0, 100_000_000, n))
    co["t_exit"][:] = co["t_enter"] + rng.integers(5_000, 900_000, n)
    co["flags"][:] = 0
    return co


def test_packed_columns_round_trip_exactly_and_shrink_the_message() -> None:
    rng = np.random.default_rng(3)
    co = _colls(1000, rng)
    data = schema.steps_message(_header(), schema.empty_table("steps", 1), colls=co)
    got = schema.decode(data).tables["colls"]
    for name, col in co.items():
        assert got[name].dtype == col.dtype and np.array_equal(got[name], col), name
    # 65 bytes a row unpacked; times span 4 bytes, the rest 0-2.
    assert len(data) / 1000 < 24, len(data)
    raw = msgpack.unpackb(data)["tables"]["colls"]["cols"]
    assert raw["t_enter"][1] == 4 and raw["seq"][1] == 2 and raw["step"][1] == 0


@pytest.mark.parametrize("dtype", ["<i1", "<u1", "<i2", "<i4", "<u4", "<i8", "<u8"])
def test_packing_is_exact_at_the_ends_of_every_integer_type(dtype: str) -> None:
    info = np.iinfo(dtype)
    rng = np.random.default_rng(0)
    for lo, span in (
        (info.min, 0),
        (info.max, 0),
        (info.min, 255),
        (info.max - 70_000, 70_000),
        (0, 1 << 31),
        (info.max - (1 << 32) + 1, (1 << 32) - 1),
        (info.min, 1 << 40),
    ):
        lo = max(int(lo), int(info.min))
        span = min(span, int(info.max) - lo)
        vals = [lo + int(x) for x in rng.integers(0, span + 1, 64, dtype=np.uint64)]
        col = np.array([lo, *vals, lo + span], dtype=dtype)
        sent = schema.pack_column(col)
        back = schema._unpack_column("t.c", sent, col.shape[0], col.dtype)
        assert back.dtype == col.dtype and np.array_equal(back, col), (dtype, lo, span)
        if isinstance(sent, list):
            assert len(sent[2]) < col.nbytes  # packed only where it is narrower


def test_small_tables_and_float_columns_travel_unpacked() -> None:
    co = _colls(schema.PACK_MIN_ROWS - 1, np.random.default_rng(1))
    assert all(isinstance(schema.pack_column(c), bytes) for c in co.values())
    assert isinstance(schema.pack_column(np.zeros(1000)), bytes)  # float64


def _packed_steps(mutate) -> bytes:
    co = _colls(64, np.random.default_rng(2))
    msg = msgpack.unpackb(schema.steps_message(_header(), schema.empty_table("steps", 1), colls=co))
    mutate(msg["tables"]["colls"]["cols"])
    return msgpack.packb(msg)


@pytest.mark.parametrize(
    ("mutate", "reason", "says"),
    [
        (lambda c: c.update(t_enter=[0, 3, b"\x00" * 192]), "bad_table", "width 3"),
        (lambda c: c.update(t_enter=[2**63 + 5, 4, b"\x00" * 256]), "bad_table", "do not fit"),
        (lambda c: c.update(t_enter=[2**63 - 10, 4, b"\x00" * 256]), "bad_table", "do not fit"),
        (lambda c: c.update(op=[0, 1, b"\x00" * 64]), "bad_table", "do not fit"),
        (lambda c: c.update(t_enter=[0, 4, b"\x00" * 255]), "bad_size", "expected 64 x 4"),
        (lambda c: c.update(t_enter=[0, 4]), "bad_table", "colls.t_enter"),
        (lambda c: c.update(t_enter=[True, 4, b"\x00" * 256]), "bad_table", "int base"),
        (lambda c: c.update(t_enter=[1.5, 0, b""]), "bad_table", "int base"),
        (lambda c: c.update(t_enter=[0, 4, "x" * 256]), "bad_size", "packed offsets are str"),
    ],
)
def test_malformed_packed_columns_are_rejected_by_name(mutate, reason: str, says: str) -> None:
    with pytest.raises(schema.SchemaError) as err:
        schema.decode(_packed_steps(mutate))
    assert err.value.reason == reason and says in str(err.value), str(err.value)


def test_a_packed_float_column_is_rejected() -> None:
    msg = msgpack.unpackb(schema.samples_message(_header(), schema.empty_table("samples", 20)))
    name = next(k for k, dt in schema.TABLES["samples"].items() if dt.kind == "f")
    msg["tables"]["samples"]["cols"][name] = [0, 0, b""]
    with pytest.raises(schema.SchemaError) as err:
        schema.decode(msgpack.packb(msg))
    assert err.value.reason == "bad_table" and name in str(err.value)


def test_version_1_messages_still_read() -> None:
    co = _colls(100, np.random.default_rng(4))
    st = schema.empty_table("steps", 1)
    tables = {
        name: {"n": len(t["step"]), "cols": {k: v.tobytes() for k, v in t.items()}}
        for name, t in (("steps", st), ("colls", co))
    }
    msg = {**_header(), "kind": "steps", "v": 1, "tables": tables}
    got = schema.decode(msgpack.packb(msg)).tables["colls"]
    assert all(np.array_equal(got[k], v) for k, v in co.items())
