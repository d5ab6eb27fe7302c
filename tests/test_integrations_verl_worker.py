"""verl's own ``external_lib`` hook, which verl imports in each worker, patches verl with ppo_fast's ops."""

import pathlib
import sys

import pytest

core = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed")
import_utils = pytest.importorskip("verl.utils.import_utils", reason="verl is not installed")

import ppo_fast.integrations.verl as pf_verl  # noqa: E402

HOOK = "ppo_fast.integrations.verl_worker"


@pytest.fixture(autouse=True)
def _fresh():
    pf_verl.unpatch()
    sys.modules.pop(HOOK, None)
    yield
    pf_verl.unpatch()
    sys.modules.pop(HOOK, None)


def test_verls_import_external_libs_patches_verl():
    original = core.compute_policy_loss_vanilla
    assert not pf_verl.is_patched()
    import_utils.import_external_libs(HOOK)  # what verl's HFModelConfig.__post_init__ calls with external_lib
    assert pf_verl.is_patched()
    assert core.compute_policy_loss_vanilla is pf_verl.compute_policy_loss_vanilla is not original
    assert core.get_policy_loss_fn(pf_verl.POLICY_LOSS_NAME) is pf_verl.compute_policy_loss_vanilla
    assert core.compute_gae_advantage_return is pf_verl.compute_gae_advantage_return


def test_the_hook_is_the_model_configs_external_lib():
    from omegaconf import OmegaConf

    config = pathlib.Path(core.__file__).parents[2] / "trainer" / "config" / "model" / "hf_model.yaml"
    assert "external_lib" in OmegaConf.load(config)
    from verl.workers.config.model import HFModelConfig

    assert "external_lib" in HFModelConfig.__dataclass_fields__
