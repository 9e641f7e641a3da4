"""Config: presets, typed overrides, range checks with clear messages, JSON round trip."""

import pytest

from arvdm.config import Config, ConfigError, apply_overrides, get_preset


@pytest.mark.parametrize("name", ["tiny", "paper"])
def test_presets_validate_and_round_trip(name):
    cfg = get_preset(name).validate()
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_overrides_are_typed():
    cfg = apply_overrides(get_preset("tiny_time"), ["memory.length=16", "train.lr=1e-3", "train.bf16=false",
                                               "memory.structure=cross_attention"])
    assert cfg.memory.length == 16 and cfg.train.lr == 1e-3 and cfg.train.bf16 is False
    assert cfg.memory.structure == "cross_attention"


@pytest.mark.parametrize("override, message", [
    ("memory.bogus=1", "unknown config key 'memory.bogus'"),
    ("nope.length=1", "unknown config section 'nope'"),
    ("memory.length=abc", "expects int"),
    ("memorylength", "key=value"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(get_preset("tiny_time"), [override])


@pytest.mark.parametrize("overrides, message", [
    (["memory.compressor=joint", "memory.budget=9", "memory.length=8"], "memory.budget=9"),
    (["memory.budget=2"], "needs memory.compressor"),
    (["memory.structure=ring"], "memory.structure"),
    (["model.image_size=30"], "multiple of model.patch_size"),
    (["model.frames_per_chunk=3"], "train.window"),
    (["memory.retention=sink_recent", "memory.sink=4", "memory.recent=8", "memory.length=8"], "sink"),
    (["diffusion.eta=2"], "diffusion.eta"),
    (["model.unet_channels=[32,64]", "model.patch_size=2", "model.image_size=34"], r"2\*\*\(levels-1\) = 4"),
    (["model.unet_channels=[32,0]"], "model.unet_channels"),
    (["train.loss_weight=p2"], "train.loss_weight"),
])
def test_out_of_range_values_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(get_preset("tiny_time"), overrides).validate()


def test_a_token_narrower_than_its_patch_warns():
    with pytest.warns(UserWarning, match="smaller than the 192 values"):
        apply_overrides(get_preset("tiny_time"), ["model.unet_channels=[]", "model.patch_size=8"]).validate()
