"""Phase timing by context (jaxflow/trainer/phases.py): what a recording collects, and what it does not."""
import threading
import time

from jaxflow.trainer import phases


def test_a_recording_collects_its_phases_and_nothing_outside_it():
    with phases.phase("before"):
        pass
    assert not phases.active()
    with phases.recording() as seconds:
        assert phases.active()
        with phases.phase("rollout"):
            time.sleep(0.02)
        with phases.phase("rollout"):  # a phase met twice adds up
            time.sleep(0.02)
        phases.add("sync_engine", 0.5)
        phases.merge({"reward": 0.25, "sync_engine": 0.5})
    assert set(seconds) == {"rollout", "reward", "sync_engine"}
    assert seconds["rollout"] >= 0.04 and seconds["reward"] == 0.25 and seconds["sync_engine"] == 1.0
    assert not phases.active()
    phases.add("after", 1.0)  # no recording: nothing happens


def test_a_phase_that_raises_is_not_recorded_and_threads_record_apart():
    seen = {}

    def worker():
        with phases.recording() as mine:
            with phases.phase("rollout"):
                pass
        seen.update(mine, outer_visible=phases.active())

    with phases.recording() as seconds:
        try:
            with phases.phase("train"):
                raise ValueError("boom")
        except ValueError:
            pass
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert seconds == {} and set(seen) == {"rollout", "outer_visible"} and seen["outer_visible"] is False
