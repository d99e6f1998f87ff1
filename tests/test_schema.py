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
