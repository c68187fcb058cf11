"""sample.solver and eval.solver: 'dpm2' (DPM-Solver++(2M)) rolls out with sde_type 'ode' (nft's: the sde_type rule
refuses it to the others), and with an SDE only for mixgrpo (its Flash variant: dpm2 after the window); the eval's may
be 'dpm2' for every algorithm; each reaches the engine's sampling params."""
import pytest

from jaxflow import families
from jaxflow.config import validation
from jaxflow.config.errors import UserError
from jaxflow_bridge.rollout.sampling import SamplingParams
from tests.helpers import tiny_config


def _config(tmp_path, algorithm="flowgrpo", **sample):
    cfg = tiny_config(tmp_path, algorithm=algorithm)
    if algorithm == "nft":
        cfg.sample.guidance = 1.0
    cfg.sample.update(sample)
    return cfg


@pytest.mark.parametrize("algorithm, sample, line", [
    ("flowgrpo", dict(solver="dpm2"), "config.sample.solver: 'dpm2' with sde_type 'sde' is MixGRPO-Flash (dpm2 after "
                                      "the SDE window), for train.algorithm mixgrpo, not 'flowgrpo': pass "
                                      "--config.sample.solver=euler"),
    ("nft", dict(solver="dpm2", sde_type="sde"), "config.sample.solver: 'dpm2' with sde_type 'sde' is MixGRPO-Flash "
                                                 "(dpm2 after the SDE window), for train.algorithm mixgrpo, not 'nft': "
                                                 "pass --config.sample.solver=euler or --config.sample.sde_type=ode"),
    ("nft", dict(solver="rk4", sde_type="ode"), "config.sample.solver: solver='rk4'; choose one of ('euler', 'dpm2')"),
])
def test_a_solver_the_rollout_cannot_use_is_one_line(tmp_path, algorithm, sample, line):
    with pytest.raises(UserError) as e:
        validation.validate(_config(tmp_path, algorithm, **sample))
    assert str(e.value) == line


def test_dpm2_reaches_the_rollout_for_nft_and_the_eval_for_flowgrpo(tmp_path):
    nft = validation.validate(_config(tmp_path, "nft", solver="dpm2", sde_type="ode"))
    family = families.of(nft)
    rollout = SamplingParams.from_dict(family.sampling(nft, eval_mode=False))
    assert (rollout.solver, rollout.sde_type, rollout.keep_final) == ("dpm2", "ode", True)
    assert family.sampling(nft, eval_mode=True)["solver"] == "euler"  # the eval's own key
    cfg = _config(tmp_path / "b")
    cfg.eval.solver = "dpm2"
    flowgrpo = validation.validate(cfg)
    assert SamplingParams.from_dict(family.sampling(flowgrpo, eval_mode=True)).solver == "dpm2"
    assert family.sampling(flowgrpo, eval_mode=False)["solver"] == "euler"


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_mixgrpo_flash_reaches_the_rollout_with_its_sde(tmp_path, sde_type):
    cfg = validation.validate(_config(tmp_path, "mixgrpo", solver="dpm2", sde_type=sde_type))
    rollout = SamplingParams.from_dict(families.of(cfg).sampling(cfg, eval_mode=False))
    assert (rollout.solver, rollout.sde_type, rollout.keep_final) == ("dpm2", sde_type, False)
