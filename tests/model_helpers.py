"""Helpers shared by the model-family tests: tiny random checkpoints and greedy runs."""

import torch

from deepinfer.protocol import SamplingParams


def save_tiny(tmp_path, config, seed=0):
    """Build a random model from ``config`` and save it like a Hub checkpoint (safetensors).

    Norm weights (1-D) get noise too, so a norm loaded wrongly changes the outputs.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(tmp_path)
    return model


def prompts(vocab, lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def hf_greedy(model, ids, n):
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def engine_greedy(engine, prompt_ids, n, ignore_eos=True):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos)
    out = {str(i): [] for i in range(len(prompt_ids))}
    for i, ids in enumerate(prompt_ids):
        engine.add_request(str(i), ids, sp)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompt_ids))]


def hf_greedy_uncached(model, ids, n):
    """Greedy continuation recomputing the whole sequence with transformers' forward for
    every token (no KV cache). NOTE: for a tiny Gemma 3 with prompts longer than its
    sliding window, ``pipeline`` (with transformers' sliding-window cache) was seen to
    disagree with transformers' own uncached forward; this is the reference by definition."""
    ids = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]
