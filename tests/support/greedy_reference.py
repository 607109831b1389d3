"""vLLM's greedy generations against transformers' float32 model, teacher-forced on vLLM's own tokens: the one
rule of every end-to-end serving test that compares with a dense reference (test_vllm.py, test_moe.py,
test_generic_arch.py)."""

from __future__ import annotations

# float32 serving vs the float32 transformers model: same weights, different summation order.
LOGPROB_ATOL = 1e-3
# Greedy ties: a different token is accepted only if the reference itself can barely tell them apart.
TIE_GAP = 1e-4


def check_greedy(outputs: list[dict], model, max_tokens: int, *, every_logprob: bool = False,
                 label: str = "") -> None:
    """Each of the runner's ``outputs`` (tests/support/vllm_runner.py) generated ``max_tokens`` tokens, each the
    reference's argmax or a near tie, with the chosen token's log-probability (``every_logprob``: each one
    vLLM returned) within ``LOGPROB_ATOL`` of the reference's."""
    import torch

    where = f"{label}: " if label else ""
    for out in outputs:
        prompt, gen = out["prompt_token_ids"], out["token_ids"]
        assert len(gen) == max_tokens
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1: len(prompt) - 1 + len(gen)]
        for step, token in enumerate(gen):
            row = ref[step]
            best = int(row.argmax())
            assert token == best or float(row[best] - row[token]) < TIE_GAP, (
                f"{where}prompt {prompt}: step {step}: vLLM picked {token}, transformers {best}")
            logprobs = out["logprobs"][step]
            for t, lp in (logprobs.items() if every_logprob else [(str(token), logprobs[str(token)])]):
                assert abs(lp - float(row[int(t)])) < LOGPROB_ATOL, (label, step, t, lp, float(row[int(t)]))
