"""What a vLLM-Omni `collective_rpc` returns, read for the engine (`engine.py`): one list per stage, of one reply
per answering worker. Its replies flattened, the failures among them, and the acknowledgements of sleep/wake."""

from __future__ import annotations


def rpc_replies(results) -> list:
    """The leaves of a collective_rpc result: one list per stage, of one reply per answering worker."""
    return [leaf for r in results for leaf in (rpc_replies(r) if isinstance(r, list) else [r]) if leaf is not None]


def rpc_errors(results) -> list[dict]:
    """The failures among a collective_rpc's replies: our workers' {"error": True, "reason"}, and vLLM-Omni's own
    for a stage that did not run the method: {"error": message} (it raised, or its serializer refused an argument)
    or {"todo": True} (a stage without that RPC)."""
    return [leaf for leaf in rpc_replies(results) if isinstance(leaf, dict) and (leaf.get("error") or leaf.get("todo"))]


def ack_errors(results) -> list[str]:
    """What went wrong in the OmniACKs (dataclasses or dicts) of a sleep/wake RPC; [] if all succeeded."""
    acks = rpc_replies(results)
    bad = [str(a) for a in acks if (a.get("status") if isinstance(a, dict) else a.status) != "SUCCESS"]
    return bad if acks else ["no acknowledgement"]
