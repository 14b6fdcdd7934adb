"""The η mode (base/eta.py): what η = 0 and η >= 1 switch, written out by hand, and η read the same way
from a typed config and from a run's config.yaml as plain data."""

import pytest
import yaml

from areal_async.base.eta import EtaError, EtaMode
from areal_async.config import from_dict, to_yaml


@pytest.mark.parametrize(
    "eta, wanted, channel, plan_ahead, forward_ahead, publish_overlap",
    [
        (0, True, "shm", False, True, True),
        (0, False, "shm", False, False, True),
        (0, True, "gloo", False, True, False),
        (1, True, "shm", True, False, True),
        (1, True, "zmq", True, False, True),
        (2, True, "nccl", True, False, False),
        (4, False, "cuda_ipc", True, False, False),
    ],
)
def test_what_eta_switches(eta, wanted, channel, plan_ahead, forward_ahead, publish_overlap):
    m = EtaMode(eta, wanted, channel)
    assert (m.synchronous, m.plan_ahead, m.forward_ahead, m.publish_overlap) == (
        eta == 0, plan_ahead, forward_ahead, publish_overlap,
    )  # fmt: skip


def test_fresh_enough_is_the_staleness_rule():
    # step 5 at eta 2 trains tokens of versions 3..; at eta 0 only 5
    assert [EtaMode(2).fresh_enough(v, 5) for v in (2, 3, 5)] == [False, True, True]
    assert [EtaMode(0).fresh_enough(v, 5) for v in (4, 5)] == [False, True]


@pytest.mark.parametrize("overrides", [[], ["rollout.max_head_offpolicyness=0", "tensor_channel.weights=zmq"],
                                       ["rollout.max_head_offpolicyness=3", "actor.forward_ahead=false"]])  # fmt: skip
def test_a_typed_config_and_its_yaml_give_the_same_mode(overrides):
    cfg = from_dict({}, overrides)
    assert EtaMode.of_mapping(yaml.safe_load(to_yaml(cfg))) == EtaMode.of(cfg)


@pytest.mark.parametrize(
    "data, why",
    [
        ({}, "no rollout.max_head_offpolicyness in the config"),
        ({"rollout": {}}, "no rollout.max_head_offpolicyness in the config"),
        ({"rollout": "x"}, "no rollout.max_head_offpolicyness in the config"),
        ({"rollout": {"max_head_offpolicyness": -1}}, "rollout.max_head_offpolicyness=-1: expected an integer >= 0"),
        ({"rollout": {"max_head_offpolicyness": "1"}}, "rollout.max_head_offpolicyness='1': expected an integer >= 0"),
        ({"rollout": {"max_head_offpolicyness": True}}, "rollout.max_head_offpolicyness=True: expected an integer"),
        (None, "no rollout.max_head_offpolicyness in the config"),
    ],
)
def test_a_mapping_without_a_usable_eta_is_refused_by_name(data, why):
    with pytest.raises(EtaError, match=why.replace(".", r"\.").replace("(", r"\(")):
        EtaMode.of_mapping(data)
