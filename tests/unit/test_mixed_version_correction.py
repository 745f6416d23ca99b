"""Off-policy correction per token on samples that span versions (in-flight weight updates):
a response whose first tokens the old weights sampled and the rest the new ones. Truncated IS,
rejection and decoupled PPO must weigh each token by its own behaviour log-prob: tokens the
proximal weights sampled get weight 1, older tokens their own ratio."""

from __future__ import annotations

import torch

from asyncrl.algorithms.correction_math import (
    decoupled_ppo_token_loss,
    importance_weights,
    rejection_mask,
)
from asyncrl.demo.model_cache import TinyModelSpec
from asyncrl.demo.tiny_model import build_tiny_model, build_tokenizer

PROMPT = [5, 6, 7, 8]
SWITCH, LENGTH = 10, 16  # tokens 0..9 by version 0, 10..15 by version 1


def logprobs_of(model, ids: list[int], start: int) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= start, one full forward."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x).logits[0, start - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, x[0, start:, None])[:, 0]


def mixed_sample():
    """A response sampled by version 0 up to SWITCH and by version 1 after it, with each
    token's behaviour log-prob recorded by the weights that sampled it, and version 1's
    log-probs of all of it (the proximal policy: the learner holds version 1)."""
    tokenizer = build_tokenizer()
    v0 = build_tiny_model(tokenizer, TinyModelSpec(), seed=0).eval()
    v1 = build_tiny_model(tokenizer, TinyModelSpec(), seed=0).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in v1.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    ids, behaviour = list(PROMPT), []
    for t in range(LENGTH):
        model = v0 if t < SWITCH else v1
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        token = int(torch.multinomial(logp.exp(), 1, generator=g))
        ids.append(token)
        behaviour.append(float(logp[token]))
    proximal = logprobs_of(v1, ids, len(PROMPT))
    return torch.tensor([behaviour]), proximal[None], torch.ones(1, LENGTH)


def test_token_level_is_weights_are_one_on_the_new_versions_tokens():
    behaviour, proximal, mask = mixed_sample()
    w = importance_weights(proximal, behaviour, mask, "token")
    torch.testing.assert_close(w[0, SWITCH:], torch.ones(LENGTH - SWITCH), atol=1e-5, rtol=0)
    old = (proximal - behaviour)[0, :SWITCH].exp()
    torch.testing.assert_close(w[0, :SWITCH], old)
    assert (w[0, :SWITCH] - 1).abs().max() > 1e-2  # the old tokens really are off-policy
    # truncation (TIS, any cap >= 1) only touches the old version's tokens
    assert (old > 1).any() and (old < 1).any()  # some are truncated, some not
    capped = importance_weights(proximal, behaviour, mask, "token", cap=1.0)
    torch.testing.assert_close(capped[0, :SWITCH], old.clamp(max=1.0))
    torch.testing.assert_close(capped[0, SWITCH:], w[0, SWITCH:])
    # the sequence weight is the product of both versions' ratios: the old part's alone
    seq = importance_weights(proximal, behaviour, mask, "sequence")
    torch.testing.assert_close(seq[0, 0], old.prod(), rtol=1e-4, atol=0)


def test_rejection_only_drops_the_old_versions_tokens():
    behaviour, proximal, mask = mixed_sample()
    log_r = (proximal - behaviour)[0]
    high = float(log_r[:SWITCH].abs().max().exp()) * 0.999  # the stalest old token is beyond
    keep, stats = rejection_mask(proximal, behaviour, mask, "token", "ratio", 1 / high, high)
    assert keep[0, SWITCH:].eq(1).all()
    assert keep[0, :SWITCH].eq(0).any() and float(stats["rejected_tokens"]) >= 1


def test_decoupled_ppo_weighs_each_tokens_gradient_by_its_own_version():
    """With the policy at the proximal weights (r = 1, nothing clipped), dl/dlogp_t = -A w_t:
    exactly -A on the new version's tokens, -A exp(prox_t - behav_t) on the old ones."""
    behaviour, proximal, mask = mixed_sample()
    logp = proximal.clone().requires_grad_(True)
    advantages = torch.full_like(mask, 0.5)
    loss, stats = decoupled_ppo_token_loss(logp, proximal, behaviour, advantages, mask, 0.2, 0.2)
    loss.sum().backward()
    grad = logp.grad[0]
    torch.testing.assert_close(
        grad[SWITCH:], torch.full((LENGTH - SWITCH,), -0.5), atol=1e-5, rtol=0
    )
    expected = -0.5 * (proximal - behaviour)[0, :SWITCH].exp()
    torch.testing.assert_close(grad[:SWITCH], expected)
    assert float(stats["behaviour_k3_sum"]) > 0  # staleness comes from the old tokens only
