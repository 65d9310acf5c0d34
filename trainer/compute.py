"""What a run spends, by kind and purpose: the ledger a selection-method study compares.

Every method saves compute somewhere else: LZE and DAPO in the update, the forward pruner, GRESO
and DOTS in generation, SPEED in generation at the price of screening rounds, HIVE at the price
of a prefill, rollout replay by generating fewer groups. So each rank records, per step, the
tokens of every pass it ran under a ``purpose`` (``train`` rollouts, ``reference`` sets,
``screening``, ``entropy`` prefills, ``old_logprobs``, ``update``), and the trainer reduces them
over ranks into ``compute/<kind>/<purpose>`` metrics and running totals.

The FLOPs proxy of the study (Kaplan et al. 2020, "Scaling Laws for Neural Language Models":
about 2P FLOPs per token of a forward pass and 6P per token of a forward + backward pass, for P
parameters): 2P per prefill and generated token and per token of every extra forward pass
(old log-probs, reference sets, screening, entropy prefill), 6P per update token. An update token
is every token of a trained sequence, prompt included: the update's forward and backward run
through all of them (verl's FLOPs counter likewise counts the actor update over the full sequence
lengths), while the loss covers the response tokens only. Counting only the response tokens would
put the update at about a third of a GRPO step's FLOPs on the study's task, where its measured
wall time is about two thirds. Prefill is counted per rollout (prefix caching aside).

The proxy counts every trained sequence whole although this trainer's update runs each prompt
once per micro-batch for all its responses (:mod:`lze_trainer.actor`): it stays the field's
convention, so runs before and after that change, and runs of other trainers, stay comparable.
"""

from __future__ import annotations

from collections import defaultdict

# Kinds of token and the FLOPs per parameter each costs.
FLOPS_PER_PARAM = {"prefill": 2.0, "generated": 2.0, "forward": 2.0, "update": 6.0}


class ComputeLedger:
    """This rank's token counts of the current step, by (kind, purpose), and of the run so far
    (the totals, once the step's counts have been reduced over ranks)."""

    def __init__(self) -> None:
        self.step: dict[tuple[str, str], float] = defaultdict(float)
        self.totals: dict[str, float] = defaultdict(float)

    def add(self, kind: str, purpose: str, tokens: float) -> None:
        if kind not in FLOPS_PER_PARAM:
            raise ValueError(f"kind: expected one of {sorted(FLOPS_PER_PARAM)}, got {kind!r}")
        self.step[(kind, purpose)] += float(tokens)

    def add_rollouts(self, purpose: str, prompt_tokens: int, generated_tokens: int,
                     rollouts: int, groups: int, zero_variance_groups: int = 0) -> None:
        """One generation call: each rollout prefills its prompt (prefix caching aside);
        ``zero_variance_groups`` of its ``groups`` had all-equal rewards."""
        self.add("prefill", purpose, prompt_tokens)
        self.add("generated", purpose, generated_tokens)
        self.step[("rollouts", purpose)] += rollouts
        self.step[("groups", purpose)] += groups
        self.step[("zero_variance", purpose)] += zero_variance_groups

    def keys(self) -> list[tuple[str, str]]:
        return sorted(self.step)

    def close_step(self, reduced: dict[tuple[str, str], float], parameters: int
                   ) -> dict[str, float]:
        """The step's metrics from counts already summed over ranks (same keys on every rank),
        plus running totals; the step's counts are cleared."""
        metrics: dict[str, float] = {}
        flops = 0.0
        for (kind, purpose), value in sorted(reduced.items()):
            name = f"{kind}/{purpose}"
            metrics[f"compute/{name}"] = value
            self.totals[name] += value
            flops += FLOPS_PER_PARAM.get(kind, 0.0) * parameters * value
        self.totals["flops"] += flops
        metrics["compute/flops"] = flops
        metrics.update({f"total/{name}": value for name, value in self.totals.items()})
        self.step.clear()
        return metrics

    def state_dict(self) -> dict:
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        self.totals = defaultdict(float, state["totals"])
