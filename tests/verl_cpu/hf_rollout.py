"""Rollout ``hf`` for verl 0.9.1 on a CPU: a Hugging Face copy of the actor behind verl's own
rollout-server interfaces, so that verl's agent loop, load balancer and weight sync run unchanged.

verl's hybrid rollout has three parts (vLLM's are ``ServerAdapter``, ``vLLMReplica`` and
``vLLMHttpServer``); these are their HF counterparts:

* :class:`HFServer`, a Ray actor holding the model: ``generate`` is verl's token-in-token-out
  call (``TokenOutput``: token ids, their log-probs, the stop reason), sampled token by token
  with a generator seeded from the request (verl's ``det-<priority>`` request ids under
  ``rollout.full_determinism``), the prompt and the step, so a run repeats exactly (up to the
  floating-point results of the CPU it runs on);
* :class:`HFReplica`, the ``RolloutReplica`` that launches one server per replica;
* :class:`HFServerAdapter`, the ``BaseRollout`` inside verl's ``ActorRolloutRefWorker``: verl's
  ``update_weights`` hands it the actor's full tensors, which it sends to the server.

For the tests, a server can also *replay* recorded responses (:meth:`HFServer.replay`): a prompt
then gets the recorded responses of that prompt, in order, instead of sampled ones. It records
training and validation (greedy) requests apart, and :meth:`HFServer.reset` starts a new run's
record on the same server (the fit tests' runs share one).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from typing import Any, Optional

import ray
import torch

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

SERVER_NAME = "hf_server_{}"


class HFServer:
    """One rollout server: an HF causal LM in float32 on the CPU."""

    def __init__(self, config, model_config, replica_rank: int):
        from transformers import AutoModelForCausalLM

        self.config = config
        self.replica_rank = replica_rank
        self.model = AutoModelForCausalLM.from_pretrained(model_config.path,  # a local directory
                                                          dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.reset()

    def reset(self) -> None:
        """Forget the previous run: its record, its draws, its replay (a test module's runs
        share this server)."""
        self.global_steps: Optional[int] = None
        self.replayed: Optional[dict[tuple, list]] = None
        self.generated: dict[Optional[int], list] = {}  # by the synced step they ran on
        self.validated: dict[Optional[int], list] = {}  # greedy (validation) requests, likewise
        self.draws: Counter = Counter()  # requests so far per (step, request id, prompt)
        self.weights: dict[Optional[int], dict[str, torch.Tensor]] = {}

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict,
                       **kwargs: Any) -> TokenOutput:
        prompt = tuple(int(t) for t in prompt_ids)
        validation = float(sampling_params["temperature"]) == 0  # verl validates greedily
        output = self._replay(prompt) if self.replayed is not None and not validation else (
            self._generate(request_id, prompt, sampling_params))
        record = self.validated if validation else self.generated
        record.setdefault(self.global_steps, []).append(
            (prompt, tuple(output.token_ids), tuple(output.log_probs or ())))
        return output

    def _generate(self, request_id: str, prompt: tuple, sampling_params: dict) -> TokenOutput:
        limit = min(int(sampling_params.get("max_tokens") or self.config.response_length),
                    self.config.max_model_len - len(prompt) if self.config.max_model_len
                    else self.config.response_length)
        token_ids, log_probs = self._sample(prompt, limit, float(sampling_params["temperature"]),
                                            self._generator(request_id, prompt))
        stop = "completed" if token_ids and token_ids[-1] in self.eos_ids else "length"
        return TokenOutput(token_ids=token_ids,
                           log_probs=log_probs if sampling_params.get("logprobs") else None,
                           stop_reason=stop, num_preempted=0,
                           extra_fields={"global_steps": self.global_steps})

    @torch.no_grad()
    def _sample(self, prompt: tuple, limit: int, temperature: float, generator):
        """Tokens drawn one at a time from softmax(logits / temperature) (greedy at 0), with the
        log-probability of each under that distribution."""
        ids = torch.tensor([prompt])
        past, token_ids, log_probs = None, [], []
        for _ in range(limit):
            out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float()
            if temperature > 0:
                logp = torch.log_softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            else:
                logp = torch.log_softmax(logits, dim=-1)
                token = int(logits.argmax())
            token_ids.append(token)
            log_probs.append(float(logp[token]))
            if token in self.eos_ids:
                break
            ids = torch.tensor([[token]])
        return token_ids, log_probs

    def _generator(self, request_id: str, prompt: tuple) -> torch.Generator:
        """A generator seeded by the request. Under ``rollout.full_determinism`` verl's request
        ids are ``det-<priority>``: legacy numbers the rows of its batch, v1 sets no priority
        (every id is ``det-0``), so the repeats of a (step, id, prompt) are numbered, or the n
        responses of a group would be one response n times."""
        draw = (self.global_steps, request_id, prompt)
        self.draws[draw] += 1
        key = f"{self.config.seed}|{draw}|{self.draws[draw]}".encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1
        return torch.Generator().manual_seed(seed)

    def _replay(self, prompt: tuple) -> TokenOutput:
        queue = self.replayed.get(prompt)
        if not queue:
            raise KeyError(f"HFServer.replay: no recorded response left for prompt {prompt}")
        token_ids, log_probs = queue.pop(0)
        return TokenOutput(token_ids=list(token_ids), log_probs=list(log_probs),
                           stop_reason="completed", num_preempted=0,
                           extra_fields={"global_steps": self.global_steps})

    def replay(self, responses: Optional[dict[tuple, list]]) -> None:
        """Answer each prompt (token ids) with its recorded ``(token_ids, log_probs)`` in order;
        ``None`` goes back to sampling."""
        self.replayed = None if responses is None else {k: list(v) for k, v in responses.items()}

    def update_weights(self, state: dict[str, torch.Tensor], global_steps: Optional[int]) -> None:
        """Load the actor's weights (verl's sync after each update; ``global_steps`` 0 before
        the first) and keep a copy of them per step."""
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"HFServer.update_weights: missing {sorted(set(missing) - tied)}, "
                             f"unexpected {sorted(unexpected)}")
        self.global_steps = global_steps
        self.weights[global_steps] = {k: v.detach().clone()
                                      for k, v in self.model.state_dict().items()}

    def history(self) -> dict:
        """Every training generation ``(prompt ids, response ids, log-probs)`` by the synced
        step."""
        return self.generated

    def validation_history(self) -> dict:
        """The validation generations (greedy), likewise."""
        return self.validated

    def weight_history(self) -> dict:
        return self.weights

    def parameter_count(self) -> int:
        """P of the FLOPs proxy: the model's parameters, a tied embedding counted once."""
        return sum(p.numel() for p in self.model.parameters())

    async def abort_all_requests(self, *args, **kwargs) -> dict:
        return {"aborted_count": 0, "request_ids": []}

    # Memory calls: the model stays in host memory, there is no KV cache to free.
    async def wake_up(self, tags=None):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def resume_generation(self):
        return None

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None


class HFReplica(RolloutReplica):
    """verl's rollout replica for ``rollout.name=hf``: one :class:`HFServer` actor."""

    async def launch_servers(self):
        name = SERVER_NAME.format(self.replica_rank)
        server = ray.remote(HFServer).options(name=name, num_cpus=0.01).remote(
            config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        self._server_address = name

    def rollout_worker_use_gpu(self) -> bool:
        return False


class HFServerAdapter(BaseRollout):
    """The rollout side of verl's ``ActorRolloutRefWorker``: forwards weight syncs to the
    replica's :class:`HFServer` (from rollout rank 0 of the replica)."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        rank = int(os.environ["RANK"])
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.has_server = rank % world == 0
        self.server = None

    def _server(self):
        if self.server is None:
            self.server = ray.get_actor(SERVER_NAME.format(self.replica_rank))
        return self.server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    @torch.no_grad()
    async def update_weights(self, weights, global_steps: int = None,
                             wire_format: str = "named_tensors", **kwargs):
        if wire_format != "named_tensors":
            raise ValueError(f"wire_format: the hf rollout takes 'named_tensors', got {wire_format!r}")
        # Every rank walks the generator: FSDP gathers each full tensor collectively.
        state = {name: tensor.detach().to("cpu").clone() for name, tensor in weights}
        if self.has_server:
            await self._server().update_weights.remote(state, global_steps)
