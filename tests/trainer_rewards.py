"""Rewards for the end-to-end tests: mixed groups from any policy, a random model's included, so
that selection and the update always have work whatever the model learned."""


def even_length(response: str, ground_truth: str, data_source: str, meta: dict) -> float:
    return float(len(response) % 2 == 0)
