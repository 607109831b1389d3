"""vLLM general plugin entry point (placeholder until the vLLM work lands)."""


def register() -> None:
    pass
