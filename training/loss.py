"""The training objective: next-token NLL over the loss tokens of a (packed) batch, from the
forward's logits or from the final hidden states in chunks of positions."""

from __future__ import annotations

from training import data as data_lib


def lm_loss(model, batch: dict, loss_chunk: int = 0):
    """Mean next-token NLL over the loss tokens of ``batch`` (and their count).

    ``loss_chunk`` = 0: from the forward's logits (batch x sequence x vocab in float32 at once).
    ``loss_chunk`` = C > 0: the model (prepared by ``keep_hidden_states``) gives its final hidden
    states, and the output head, log-softmax and NLL run on C positions at a time
    (:func:`chunked_nll`): at most batch x C x vocab logits are alive, whatever the sequence, and
    each chunk's gradient is taken as it is computed, so the head runs once forward and once
    backward (no second forward to rematerialise it). The same loss and gradients up to float32
    summation order. The output head's weights are frozen (LoRA never targets it): only the hidden
    states get its gradient.
    """
    import jax
    import jax.numpy as jnp

    from ckptbridge.tunix_model import forward, hidden_states

    tokens, seg, pos, lm = batch["tokens"], batch["segment_ids"], batch["positions"], batch["loss_mask"]
    mask = data_lib.attention_mask(seg, jnp)
    valid = (lm[:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    count = valid.sum()
    targets = tokens[:, 1:]
    denominator = jnp.maximum(count, 1)
    if loss_chunk:
        h = hidden_states(model, tokens, pos, mask)[:, :-1]
        # d(loss)/d(total NLL) is 1 / count: each chunk's gradient is taken with it, as autodiff would
        total, dh = chunked_nll(model, jax.lax.stop_gradient(h), targets, valid, loss_chunk, 1.0 / denominator)
        return _with_gradient(jax.lax.stop_gradient(total) / denominator, h, dh), count
    logits = forward(model, tokens, pos, mask)
    total = jnp.where(valid, _nll(logits[:, :-1], targets), 0.0).sum()
    return total / denominator, count


def _with_gradient(value, h, dh):
    """``value``, whose gradient with respect to ``h`` is ``dh`` (computed already)."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def attach(value, h, dh):
        return value

    def fwd(value, h, dh):
        return value, dh

    def bwd(dh, ct):
        return jnp.zeros_like(ct), (ct * dh).astype(dh.dtype), jnp.zeros_like(dh)

    attach.defvjp(fwd, bwd)
    return attach(value, h, dh)


def _nll(logits, targets):
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def chunked_nll(model, h, targets, valid, chunk: int, cotangent):
    """The sum of the NLL of ``targets`` (B, T) where ``valid``, from final hidden states ``h``
    (B, T, D) through ``model``'s output head, ``chunk`` positions at a time (a scan), and its
    gradient with respect to ``h`` times ``cotangent`` (B, T, D, in ``h``'s dtype), each chunk's
    taken right after its forward. Not differentiated itself: :func:`lm_loss` gives ``h`` that gradient."""
    import jax
    import jax.numpy as jnp

    from ckptbridge.tunix_model import head

    b, t, d = h.shape
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        valid = jnp.pad(valid, ((0, 0), (0, pad)))
    parts = (h.reshape(b, n, chunk, d).swapaxes(0, 1), targets.reshape(b, n, chunk).swapaxes(0, 1),
             valid.reshape(b, n, chunk).swapaxes(0, 1))

    def step(total, part):
        h_c, t_c, v_c = part
        nll, vjp = jax.vjp(lambda x: jnp.where(v_c, _nll(head(model, x), t_c), 0.0).sum(), h_c)
        (dh_c,) = vjp(jnp.asarray(cotangent, nll.dtype))
        return total + nll, dh_c

    total, dh = jax.lax.scan(step, jnp.zeros((), jnp.float32), parts)
    return total, dh.swapaxes(0, 1).reshape(b, n * chunk, d)[:, :t]
