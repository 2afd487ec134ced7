import pytest

from stratagem.spaces import Scenario, cluster_preset, model_preset


@pytest.fixture
def llama8b() -> Scenario:
    return Scenario(
        model=model_preset("llama3-8b"),
        cluster=cluster_preset("h100-sxm-80g", 8),
        training={"seq_len": 8192, "global_batch_size": 64},
    )
