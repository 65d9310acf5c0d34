"""The verl integration's files and code: the LZE selection state it puts into verl's ``data.pt``
holds only tensors and plain values (it loads with ``weights_only=True``, although verl 0.9.1
itself loads ``data.pt`` with ``weights_only=False``: docs/checkpoints.md), and a crafted DOTS
embeddings file (``sampler_kwargs.forward.embeddings``) is refused before its payload runs."""

import pytest
import torch

pytest.importorskip("verl")

from crafted_state import Payload, same  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from lze_kernels import LZEConfig  # noqa: E402
from lze_kernels.greso import GresoConfig, GresoFilter  # noqa: E402
from lze_kernels.integrations.verl import LZEAdvantage, checkpoint  # noqa: E402
from lze_kernels.integrations.verl.checkpoint import LZERLHFDataset  # noqa: E402
from lze_kernels.integrations.verl.forward import ForwardSampler  # noqa: E402
from lze_kernels.integrations.verl.replay_buffer import LZEReplayBuffer  # noqa: E402
from lze_kernels.serialization import UnsafeStateFileError  # noqa: E402

NUM_PROMPTS = 8


def test_the_selection_state_in_verls_data_pt_loads_safely(tmp_path):
    parts = {"estimator": LZEAdvantage(NUM_PROMPTS, LZEConfig(seed=3)),
             "forward_test": ForwardSampler(NUM_PROMPTS, 4, "greso",
                                            greso=GresoFilter(NUM_PROMPTS, GresoConfig()))}
    for name, part in parts.items():
        checkpoint.register(name, part)
    try:
        for _ in range(3):
            parts["forward_test"].next_row()
        state = object.__new__(LZERLHFDataset).state_dict()  # what verl saves into data.pt
        torch.save(state, tmp_path / "data.pt")
        assert same(torch.load(tmp_path / "data.pt", weights_only=True), state)
    finally:
        for name in parts:
            checkpoint.unregister(name)


def test_crafted_dots_embeddings_are_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    torch.save(Payload(marker), tmp_path / "embeddings.pt")
    kwargs = OmegaConf.create({"num_prompts": NUM_PROMPTS, "forward": {
        "method": "dots", "batch_size": 4, "embeddings": str(tmp_path / "embeddings.pt")}})
    with pytest.raises(UnsafeStateFileError, match="builtins.exec") as refused:
        LZEReplayBuffer("sync", OmegaConf.create({}), None, "drop", kwargs,
                        refill_fn=lambda count: count)
    assert "sampler_kwargs.forward.embeddings" in str(refused.value)
    assert str(tmp_path / "embeddings.pt") in str(refused.value)
    assert not marker.exists()
