"""The memory a micro-batch's activations take in the embedded backend's update, counted on a CPU for a model's
language model: the bytes of the tensors autograd keeps for the backward, per token and layer, in bf16, without and
with `gradient_checkpointing=true` (each block keeps only its input; the backward recomputes one block at a time).

    python scripts/activation_memory.py --config MODEL_DIR_OR_HUB_ID [--tokens N]

It runs the model's own transformers decoder layers (random weights, one and two of them) on random sequences of
two lengths under torch.autograd.graph.saved_tensors_hooks and counts each saved storage once: per token is the
difference between the lengths (the weights that linear layers keep are the same at every length), per layer the
difference between two layers and one. Attention runs as on the GPU (SDPA, which keeps O(tokens)); the LM head is not
counted (the update computes it in chunks). `--tokens N` (a micro-batch's sequences times their padded length) adds
the totals: all layers without checkpointing, and with it every block's input plus one block's activations.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from bapo_vl.backends.embedded import checkpoint_blocks


def saved_bytes(text_config, layers: int, tokens: int, checkpointing: bool) -> int:
    """Bytes of the distinct storages autograd saves in a forward of `layers` decoder layers over `tokens` tokens."""
    from transformers import AutoModelForCausalLM

    config = text_config.__class__.from_dict({**text_config.to_dict(), "num_hidden_layers": layers, "vocab_size": 512,
                                              "layer_types": None})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if checkpointing:
        checkpoint_blocks(model)
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model.model(input_ids=torch.randint(0, 512, (1, tokens)), use_cache=False)
    return sum(storages.values())


def per_token_per_layer(text_config, checkpointing: bool, lengths=(256, 512)) -> float:
    short, long = lengths
    layer = [saved_bytes(text_config, n, t, checkpointing) for n in (1, 2) for t in (short, long)]
    return ((layer[3] - layer[2]) - (layer[1] - layer[0])) / (long - short)


def count(config: str, tokens: int | None) -> dict:
    from transformers import AutoConfig

    full = AutoConfig.from_pretrained(config)
    text = getattr(full, "text_config", None) or full
    plain, kept = per_token_per_layer(text, False), per_token_per_layer(text, True)
    out = dict(config=config, model_type=text.model_type, layers=text.num_hidden_layers, dtype="bfloat16",
               bytes_per_token_per_layer=round(plain), checkpointed_bytes_per_token_per_layer=round(kept))
    if tokens:
        out |= dict(tokens=tokens, activations_GB=round(plain * text.num_hidden_layers * tokens / 1e9, 1),
                    checkpointed_GB=round((kept * (text.num_hidden_layers - 1) + plain) * tokens / 1e9, 1))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a model folder or hub id (its config.json is enough)")
    parser.add_argument("--tokens", type=int, help="tokens in a micro-batch: sequences x padded length")
    args = parser.parse_args(argv)
    print(json.dumps(count(args.config, args.tokens), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
