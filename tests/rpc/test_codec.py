"""attrs values survive the wire exactly: absent stays absent, zero stays zero."""

from __future__ import annotations

import contextlib
import typing

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw import model
from llmgw.rpc import CapnpThread, _codec
from llmgw.rpc._schema import schema


def values(cls: type) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls, vars(model))
    fields = {}
    for field in attrs.fields(cls):
        fields[field.name] = strategy_for(hints[field.name])
    return st.builds(cls, **fields)


def strategy_for(tp: object) -> st.SearchStrategy:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, __import__("types").UnionType):
        inner = next(a for a in args if a is not type(None))
        return st.none() | strategy_for(inner)
    if origin is tuple:
        return st.lists(strategy_for(args[0]), max_size=3).map(tuple)
    if tp is int:
        return st.integers(-(2**31), 2**31 - 1)
    if tp is float:
        return st.floats(allow_nan=False, width=64)
    if tp is str:
        return st.text(max_size=8)
    if tp is bool:
        return st.booleans()
    if attrs.has(tp):
        return st.deferred(lambda: values(tp))  # type: ignore[arg-type]
    raise TypeError(tp)


def roundtrip(value: object, struct: object) -> object:
    builder = struct.new_message()  # type: ignore[attr-defined]
    _codec.encode(value, builder)
    reader = struct.from_bytes(builder.to_bytes())  # type: ignore[attr-defined]
    with reader as r:
        return _codec.decode(type(value), r)


TYPES = [
    (model.Hello, schema.Hello),
    (model.Heartbeat, schema.Heartbeat),
    (model.ShardReport, schema.ShardReport),
    (model.Progress, schema.Progress),
    (model.Settings, schema.Settings),
    (model.ShardSpec, schema.ShardSpec),
    (model.Reclaimed, schema.Reclaimed),
    (model.EngineDecls, schema.EngineDecls),
]


def make_check(cls: type, struct: object, failures: list[str]):
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(values(cls))
    def check(value: object) -> None:
        back = roundtrip(value, struct)
        if back != value:
            failures.append(f"{value!r} came back as {back!r}")
        assert back == value

    return check


async def test_every_wire_value_roundtrips() -> None:
    # Builders and readers live on the capnp thread, as everywhere else.
    failures: list[str] = []
    async with CapnpThread.open() as bridge:
        for cls, struct in TYPES:
            check = make_check(cls, struct, failures)

            async def run_check(check=check) -> None:
                with contextlib.suppress(AssertionError):  # reported through `failures`
                    check()

            await bridge.run(run_check)
    assert failures == []


async def test_unknown_is_not_zero_on_the_wire() -> None:
    async with CapnpThread.open() as bridge:

        async def check() -> tuple[object, object]:
            unknown = model.Usage()
            zero = model.Usage(memory_available_bytes=0, load1=0.0, gpus=())
            return roundtrip(unknown, schema.Usage), roundtrip(zero, schema.Usage)

        unknown, zero = await bridge.run(check)
    assert unknown == model.Usage()
    assert zero.memory_available_bytes == 0 and zero.load1 == 0.0
    assert unknown.memory_available_bytes is None and unknown.load1 is None
    # An inventory whose GPUs could not be told apart from one with none.
    assert model.Inventory(host=model.Host("h")).gpus is None


async def test_a_mig_card_and_its_instances_roundtrip() -> None:
    # As recorded on an H100 with four MIG instances (tests/data/INDEX.md).
    gpu = model.Gpu(
        index=0,
        uuid="GPU-00000000-0000-0000-0000-000000000000",
        name="NVIDIA H100 80GB HBM3",
        gpu_class="h100-80g",
        mig_mode="enabled",
        mig_pending="disabled",
        mig_devices=(
            model.MigDevice("MIG-00000000-0000-0000-0000-000000000000", "3g.40gb", 40448, 2, 0),
            model.MigDevice("MIG-00000003-0000-0000-0000-000000000003", "1g.10gb", None, 10, None),
        ),
    )
    async with CapnpThread.open() as bridge:

        async def check() -> tuple[object, object]:
            old = model.Gpu(index=1, uuid="GPU-x", name="n", gpu_class="c")
            return roundtrip(gpu, schema.Gpu), roundtrip(old, schema.Gpu)

        back, old = await bridge.run(check)
    assert back == gpu
    # A card from an agent that says nothing of MIG: unknown, not "disabled".
    assert old.mig_mode is None and old.mig_pending is None and old.mig_devices == ()  # type: ignore[attr-defined]
