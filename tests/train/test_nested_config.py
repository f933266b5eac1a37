"""``TrainConfig`` nests its components by concept (``rlvr_fast.utils.settings.NestedSettings``)
and is built, read and set by the settings' flat names all the same; config.json stays flat."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from rlvr_fast.train.config import TrainConfig, setting_fields
from rlvr_fast.utils.settings import is_component

POLICY = dict(loss_type="dapo", loss_order="token_weighted")


def components() -> dict[str, type]:
    return {
        f.name: f.metadata["component"] for f in dataclasses.fields(TrainConfig) if is_component(f)
    }


def test_each_setting_lands_in_its_component_and_reads_by_its_flat_name():
    config = TrainConfig.from_arm(
        "baseline", **POLICY, kl_beta=0.04, top_k=5, lr=2e-5, tree_k=2, kv_blocks=64
    )
    assert config.policy_loss.kl_beta == config.kl_beta == 0.04
    assert config.sampling_options.top_k == config.top_k == 5
    assert config.optim.lr == config.lr == 2e-5
    assert config.tree.tree_k == config.tree_k == 2
    assert config.device.kv_blocks == config.kv_blocks == 64
    assert config.lora_settings is None and config.pulls_every_group  # components' properties


def test_a_setting_set_by_its_flat_name_is_set_in_its_component():
    config = TrainConfig(betas=[0.8, 0.9])
    assert config.optim.betas == (0.8, 0.9)  # the type check's coercion reached the component
    config.lr = 3e-5
    assert config.optim.lr == 3e-5 and "lr" not in vars(config)


def test_unknown_names_are_refused_by_name():
    with pytest.raises(TypeError, match="unexpected keyword argument 'epsilonn'"):
        TrainConfig(epsilonn=0.3)
    with pytest.raises(AttributeError, match="no attribute 'epsilonn'"):
        _ = TrainConfig().epsilonn


def test_the_flat_settings_are_every_components_and_its_own_in_field_order():
    names = list(setting_fields())
    assert len(names) == len(set(names))
    for name, component in components().items():
        own = [f.name for f in dataclasses.fields(component)]
        start = names.index(own[0])
        assert names[start : start + len(own)] == own, name  # one block, in its place
    config = TrainConfig.from_arm("baseline", **POLICY, epsilon=0.3, min_p=0.1)
    assert list(config.to_json()) == [n for n in names if n in config.to_json()]


def test_a_config_survives_json_copy_and_pickle():
    config = TrainConfig.from_arm("baseline", **POLICY, epsilon=0.3, lora_r=4)
    assert TrainConfig(**config.to_json()) == config
    assert copy.deepcopy(config) == config
    assert pickle.loads(pickle.dumps(config)) == config
