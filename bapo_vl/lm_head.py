"""The LM head over the response tokens: each token's log-prob under the policy and the policy's entropy there,
chunk by chunk, with the backward written out.

For a response token with hidden state h, target t and sampling temperature T (V words):

    z = (W h + b) / T                  logits, float32 (the product runs in the compute dtype, e.g. bf16)
    log p = log_softmax(z)
    logp = log p[t]                    the token's log-prob
    H = -sum_v p_v log p_v             the entropy of the policy at that position

and, for the upstream gradients g of logp and e of H,

    d logp / dz = onehot(t) - p
    d H / dz    = -p (log p + H)
    dz          = g onehot(t) - p (g + e H + e log p).

Why not autograd over checkpointed chunks: both keep only `rows` x V logits at a time, but autograd runs more passes
over them (the float32 copy's and the division's backward, a zero-filled one-hot for the gather, the log-softmax
backward), recomputes every chunk under a checkpoint's hooks, and under autocast casts the head's weight to bf16
again in every chunk's forward and recomputation. Here the weight is cast once per call, the backward is one
softmax and a few in-place passes per chunk, and a measured entropy costs three element-wise passes over the
forward's log-softmax and nothing in the backward (its gradient is computed only when it enters the loss).
Eager, each of those passes reads and writes a float32 (rows, V) tensor; with `compiled` (the embedded backend's
compile=true) the per-chunk functions run under torch.compile, which fuses them into a few kernels over the logits.
"""
from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable


def token_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, temperature: float,
                   rows: int, dtype: torch.dtype, with_entropy: bool = False, compiled: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n,) log-probs of `targets` (n,) and (n,) entropies (None unless `with_entropy`) from (n, H) hidden states,
    through `head` (a Linear) run in `dtype`, at most `rows` x V logits at a time; float32 (float64 for a float64
    `dtype`). The entropy has a gradient when the caller's loss uses it; detach it where it is only measured.
    `compiled`: each chunk's work under torch.compile, which fuses the element-wise passes over its logits (the same
    functions, so the same results up to the order of float sums)."""
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"the LM head is a {type(head).__name__}, not a torch.nn.Linear")
    return _TokenLogProbs.apply(hidden, head.weight, head.bias, targets, float(temperature), rows, dtype,
                                with_entropy, compiled)


def _logits(h, w, b, temperature: float, out_dtype: torch.dtype) -> torch.Tensor:
    z = torch.nn.functional.linear(h, w, b).to(out_dtype)  # (rows, V)
    if temperature != 1.0:  # x / 1.0 == x: no pass over the logits at the usual temperature
        z.div_(temperature)
    return z


def forward_chunk(h, w, b, targets, temperature: float, out_dtype: torch.dtype, with_entropy: bool):
    """One chunk's log-probs of its targets and, with_entropy, its entropies (else None)."""
    log_p = torch.log_softmax(_logits(h, w, b, temperature, out_dtype), -1)  # (rows, V)
    logp = log_p.gather(1, targets[:, None]).squeeze(1)
    return logp, (log_p.exp().mul_(log_p).sum(-1).neg_() if with_entropy else None)


def backward_chunk(h, w, b, targets, g, e, entropy, temperature: float, out_dtype: torch.dtype) -> torch.Tensor:
    """One chunk's gradient of the loss with respect to its logits (rows, V), in h's dtype, from the upstream
    gradients g (rows, 1) of the log-probs and e (rows, 1) of the entropies (None: the entropy is not in the loss)."""
    z = _logits(h, w, b, temperature, out_dtype)  # (rows, V), recomputed
    if e is None:
        dz = torch.softmax(z, -1).mul_(-g)  # -g p
    else:
        log_p = torch.log_softmax(z, -1)
        p = log_p.exp()
        # -p (g + eH + e log p): one pass for the bracket, one for the product
        dz = p.mul_(torch.addcmul(-(g + e * entropy), e, log_p, value=-1))
    # + g onehot(t), added at the targets in float32 and written into the cast result, so that under torch.compile
    # the cast fuses with the pass above (a scatter into the float32 logits would need them written out first)
    at_target = dz.gather(1, targets[:, None]).add_(g)
    if temperature != 1.0:
        dz.div_(temperature)
        at_target.div_(temperature)
    return dz.to(h.dtype).scatter_(1, targets[:, None], at_target.to(h.dtype))  # the dtype the product's backward takes


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)  # one graph for every chunk's row count


class _TokenLogProbs(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, rows, dtype, with_entropy, compiled):
        h, w = hidden.to(dtype), weight.to(dtype)  # once per call (a no-op where they are in `dtype` already)
        b = None if bias is None else bias.to(dtype)
        out_dtype = torch.promote_types(dtype, torch.float32)
        n = h.shape[0]
        logp = h.new_empty(n, dtype=out_dtype)
        entropy = h.new_empty(n, dtype=out_dtype) if with_entropy else None
        chunk = _compiled(forward_chunk) if compiled else forward_chunk
        for s in range(0, n, rows):
            logp[s:s + rows], ent = chunk(h[s:s + rows], w, b, targets[s:s + rows], temperature, out_dtype,
                                          with_entropy)
            if with_entropy:
                entropy[s:s + rows] = ent
        ctx.save_for_backward(h, w, b, targets, entropy)
        ctx.settings = (temperature, rows, out_dtype, hidden.dtype, weight.dtype, None if bias is None else bias.dtype,
                        compiled)
        ctx.set_materialize_grads(False)  # an unused (or detached) entropy comes back as None: no entropy term below
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp, g_entropy):
        h, w, b, targets, entropy = ctx.saved_tensors
        temperature, rows, out_dtype, hidden_dtype, weight_dtype, bias_dtype, compiled = ctx.settings
        chunk = _compiled(backward_chunk) if compiled else backward_chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n = h.shape[0]
        if g_logp is None:
            g_logp = h.new_zeros(n, dtype=out_dtype)
        grad_h = torch.empty_like(h) if need_h else None
        # the weight's gradient sums over chunks in the weight's own dtype: float32 for float32 weights under
        # autocast (as autograd sums each chunk's bf16 product into a float32 .grad), in the product's otherwise
        grad_w = torch.zeros(w.shape, dtype=weight_dtype, device=w.device) if need_w else None
        grad_b = torch.zeros(b.shape, dtype=bias_dtype, device=b.device) if need_b else None
        for s in range(0, n, rows):
            h_c = h[s:s + rows]
            e, ent = (None, None) if g_entropy is None else (g_entropy[s:s + rows, None], entropy[s:s + rows, None])
            d_logits = chunk(h_c, w, b, targets[s:s + rows], g_logp[s:s + rows, None], e, ent, temperature,
                             out_dtype)  # (c, V)
            if need_h:
                grad_h[s:s + rows] = d_logits @ w
            if need_w:
                if grad_w.dtype == d_logits.dtype:
                    grad_w.addmm_(d_logits.T, h_c)  # the product adds into the sum: no (V, H) temporary
                else:
                    grad_w += d_logits.T @ h_c
            if need_b:
                grad_b += d_logits.sum(0)
        return (None if grad_h is None else grad_h.to(hidden_dtype), grad_w, grad_b, None, None, None, None, None,
                None)
