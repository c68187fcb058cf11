"""An engine's TextLengthError (its text longer than the train batch pads to) comes back through Ray as itself, with
its fields, and the command line prints the driver's one line for it (exit 2), not Ray's UnserializableException."""
import pickle

import numpy as np
import pytest
import ray.exceptions

from jaxflow.config.errors import UserError
from jaxflow.config.validation import config_module
from jaxflow.run.driver import text_length_error
from jaxflow.run.rollout_client import RayTransport, RolloutGroup
from jaxflow_bridge.contract.trajectory import TextLengthError
from jaxflow_bridge.rollout.server import RolloutServer
from tests.helpers import ROOT, cli_run_raising


class LongTextServer(RolloutServer):
    """The Ray server's methods on an engine whose text outgrows the padding, as the edit engine's did."""

    def __init__(self, config: dict):
        self.engine = self

    def generate(self, *args):
        raise TextLengthError("prompt_embeds", 358, 96)


class LongTextTransport(RayTransport):
    def start(self, config: dict):
        import ray
        return ray.remote(LongTextServer).options(num_cpus=0).remote(config)


def assert_fields(err: TextLengthError) -> None:
    assert type(err) is TextLengthError and (err.field, err.tokens, err.length) == ("prompt_embeds", 358, 96)
    assert str(err) == "prompt_embeds has 358 tokens > 96, the length the batch pads it to"


def test_text_length_error_pickles_with_its_fields():
    assert_fields(pickle.loads(pickle.dumps(TextLengthError("prompt_embeds", 358, 96))))


def test_the_ray_transport_raises_it_out_of_rays_task_error(monkeypatch):
    """Ray's RayTaskError wrapping it (as ray.get raises it where the cause's class cannot be subclassed): the
    transport's get raises the cause, the driver's line names the key to raise."""
    wrapped = ray.exceptions.RayTaskError("generate", "Traceback ...", TextLengthError("prompt_embeds", 358, 96))

    def failing_get(refs):
        raise pickle.loads(pickle.dumps(wrapped))

    monkeypatch.setattr(ray, "get", failing_get)
    with pytest.raises(TextLengthError) as err:
        RayTransport().get(["ref"])
    assert_fields(err.value)
    cfg = config_module(ROOT / "configs" / "qwen_edit_ocr.py").get_config()
    line = text_length_error(err.value, cfg)
    assert isinstance(line, UserError) and "\n" not in str(line)
    assert str(line).startswith("prompt_embeds has 358 tokens > sample.max_sequence_length=96: raise --config.sample.")
    beyond = text_length_error(TextLengthError("prompt_embeds", 500, 96 + 332), cfg)  # the edit padding's images
    assert str(beyond).startswith("prompt_embeds has 500 tokens > 428 (sample.max_sequence_length=96 + the images' "
                                  "tokens): raise --config.sample.max_sequence_length")


@pytest.mark.slow  # starts Ray (the ray_session fixture) and Ray actors
def test_an_actors_text_length_error_reaches_the_group_as_itself(ray_session):
    group = RolloutGroup({}, 1, LongTextTransport(num_cpus=0))
    try:
        with pytest.raises(TextLengthError) as err:
            group.generate(["a"], 2, {}, np.arange(2), 1)
        assert_fields(err.value)
    finally:
        group.close()


@pytest.mark.slow
def test_the_driver_line_is_one_line_exit_2(tmp_path):
    """From the command line (a stand-in loop whose rollout raised it): the driver's line, exit 2, no traceback."""
    out = cli_run_raising(tmp_path, "from jaxflow.run.driver import text_length_error\n"
                          "from jaxflow_bridge.contract.trajectory import TextLengthError",
                          "text_length_error(TextLengthError('prompt_embeds', 358, 96), self.cfg)")
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1 and "Traceback" not in out.stderr, out.stderr
    assert err[0].startswith("error: prompt_embeds has 358 tokens > sample.max_sequence_length=96: raise ")
