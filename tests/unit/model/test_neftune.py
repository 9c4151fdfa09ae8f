"""train.neftune_noise_alpha (finetune.model.adapters.enable_neftune): transformers' NEFTune hook on the input
embeddings, noisy in training forwards only, with transformers' magnitude alpha / sqrt(L * d)."""

from __future__ import annotations

import math

import torch

from finetune.model.adapters import apply_lora, enable_neftune
from finetune.recipe import LoraSection
from tests.tiny import tiny_model

ALPHA = 5.0


def _embeddings(net, ids):
    return net.get_input_embeddings()(ids)


def test_training_forwards_get_noise_within_alpha_over_sqrt_l_d():
    net = tiny_model()
    ids = torch.randint(4, 97, (2, 12))
    clean = _embeddings(net, ids).detach()
    enable_neftune(net, ALPHA)
    net.train()
    noisy = _embeddings(net, ids)
    bound = ALPHA / math.sqrt(12 * net.config.hidden_size)
    noise = (noisy - clean).abs()
    assert noise.max() <= bound + 1e-6 and noise.max() > 0.5 * bound  # uniform in [-bound, bound]
    assert not torch.equal(net(input_ids=ids).logits, net(input_ids=ids).logits)  # fresh noise each time


def test_eval_generation_and_no_grad_forwards_are_clean():
    """Evaluation and generation run in eval mode; the reference's and the sampling policy's log-probs
    (GRPO, preference) run in train mode without gradient: none of them sees noise."""
    net = apply_lora(tiny_model(), LoraSection(enable_lora=True, lora_rank=4), gradient_checkpointing=False)
    ids = torch.randint(4, 97, (1, 8))
    net.eval()
    with torch.no_grad():
        clean = net(input_ids=ids).logits
        greedy = net.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    enable_neftune(net, ALPHA)
    with torch.no_grad():
        assert torch.equal(net(input_ids=ids).logits, clean)
        assert torch.equal(net.generate(input_ids=ids, max_new_tokens=4, do_sample=False), greedy)
        net.train()
        assert torch.equal(net(input_ids=ids).logits, clean)  # train mode, no gradient: clean
    assert not torch.equal(net(input_ids=ids).logits, clean)  # a training forward: noisy


def test_the_noise_is_transformers_hook():
    """Same RNG, same noise as transformers' own neftune_post_forward_hook."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    net = tiny_model().train()
    ids = torch.randint(4, 97, (2, 6))
    embeddings = net.get_input_embeddings()
    clean = embeddings(ids)
    embeddings.neftune_noise_alpha = ALPHA
    torch.manual_seed(9)
    expected = neftune_post_forward_hook(embeddings, (ids,), clean)
    enable_neftune(net, ALPHA)
    torch.manual_seed(9)
    assert torch.equal(embeddings(ids), expected)
