"""An engine's start parts (jaxflow_bridge/contract/engine_start.py): from its stamps, across Ray as plain values,
named in one short text, the slowest of several engines."""
import pickle

from jaxflow_bridge.contract.engine_start import EngineStart, slowest_start


def test_parts_from_stamps_round_trip_and_summary():
    start = EngineStart.from_stamps(100.0, 109.2, 156.4, 159.0)
    assert (round(start.imports, 6), round(start.engine, 6), round(start.checks, 6)) == (9.2, 47.2, 2.6)
    assert round(start.total, 6) == 59.0
    wire = pickle.loads(pickle.dumps(start.to_dict()))
    assert all(type(v) is float for v in wire.values()) and EngineStart.from_dict(wire) == start
    assert start.summary() == "imports 9 s, engine 47 s, checks 3 s"


def test_the_slowest_engine_is_reported_and_none_without_one():
    fast, slow = EngineStart(1.0, 2.0, 3.0), EngineStart(1.0, 20.0, 0.5)
    infos = [{"start": fast.to_dict()}, {"engine": "diffusers"}, {"start": slow.to_dict()}]
    assert slowest_start(infos) == slow
    assert slowest_start([{"engine": "diffusers"}]) is None and slowest_start([]) is None
