"""TransformerLayer whose backward switches at run time between exact and MeCeFO covering mode.

Exact mode (`mecefo_policy is None`, the default) runs the stock `TransformerLayer.forward`
unchanged. In covering mode, per the policy fixed at this forward:

* attention (pre-norm, self-attention, residual add) runs without a graph and its backward is the
  residual path only (MeCeFO §3.1): no attention gradients, no attention activations kept;
* the FFN block (pre-norm, MLP, residual add) is recomputed in backward (§3.2) if asked;
* the FFN linears (LowRank*ParallelLinear) produce low-rank weight gradients (§3.3) if asked.

The layer tags its attention parameters (input_layernorm, self_attention, and cross-attention if
any) as `GradGroup.MHA` so the runtime can average them over non-covering ranks only.
"""

from __future__ import annotations

from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_mecefo.approx import Coverable, activate, active_policy, forward_with_residual_grad, recompute
from megatron_mecefo.params import GradGroup, tag_parameters

__all__ = ["MeCeFOTransformerLayer"]


class MeCeFOTransformerLayer(TransformerLayer, Coverable):
    """Drop-in TransformerLayer with a covering-mode backward; same parameters and state dict."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mecefo_policy = None
        for part in (self.input_layernorm, self.self_attention, self.pre_cross_attn_layernorm, self.cross_attention):
            tag_parameters(part, GradGroup.MHA)

    def forward(self, *args, **kwargs):
        policy = self.mecefo_policy
        if policy is None:
            return super().forward(*args, **kwargs)
        with activate(policy):
            return super().forward(*args, **kwargs)

    def _forward_attention(self, hidden_states, *args, **kwargs):
        policy = active_policy()
        if policy is None or not policy.skip_attention:
            return super()._forward_attention(hidden_states, *args, **kwargs)
        # The whole attention sub-block (norm, attention, bias-dropout-add with the residual) runs
        # graph-free; its output then carries an identity gradient back to hidden_states.
        return forward_with_residual_grad(super()._forward_attention, hidden_states, *args, **kwargs)

    def _forward_mlp(self, hidden_states, *args, **kwargs):
        policy = active_policy()
        if policy is None or not policy.recompute_ffn:
            return super()._forward_mlp(hidden_states, *args, **kwargs)
        parent = super()._forward_mlp
        return recompute(lambda h: parent(h, *args, **kwargs), hidden_states, policy=policy)

