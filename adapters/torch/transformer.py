"""The zoo's transformer LM for PyTorch: a small decoder-only model for next-token prediction.

Token + learned position embeddings, ``n_layers`` pre-LayerNorm blocks of causal
self-attention and an MLP, a final LayerNorm and a head over the vocabulary (tied to
the token embedding when ``tie_weights``). `TransformerLM.block_classes` names the
repeated block, so sharding backends wrap each block as a unit and may recompute
its activations (activation checkpointing); ``embed`` and ``finish`` are what runs before the first
and after the last block, where pipeline parallelism cuts the model into stages.

Parameter names: ``tok_emb.weight`` (vocab, d), ``pos_emb.weight`` (seq_len, d),
``blocks.{i}.{ln1,attn.qkv,attn.proj,ln2,mlp.fc,mlp.out}.{weight,bias}``,
``ln_f.{weight,bias}``, ``head.weight`` (vocab, d; the same tensor as
``tok_emb.weight`` when tied). There are no buffers: the causal mask is built by
``scaled_dot_product_attention``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from polytrain.data.source import DatasetInfo
from polytrain.spec.zoo import TransformerParams


class CausalSelfAttention(nn.Module):
    #: set by tensor parallelism (polytrain.adapters.torch.parallel.tensor): the rows of ``qkv`` are grouped
    #: by head (q, k, v of head 0, then of head 1, ...), so each rank's contiguous slice holds whole heads
    head_major = False

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        qkv = self.qkv(x)
        if self.head_major:  # this rank's heads only (tensor parallel)
            q, k, v = qkv.view(batch, length, -1, 3, self.head_dim).unbind(3)
        else:  # the portable layout: all q rows, then all k, then all v
            q, k, v = qkv.view(batch, length, 3, -1, self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, -1))


class MLPBlock(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.out = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm residual block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLPBlock(d_model, d_ff)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TransformerLM(nn.Module):
    #: The repeated unit: sharding backends wrap (and may checkpoint) each instance.
    block_classes: ClassVar[tuple[type[nn.Module], ...]] = (Block,)

    def __init__(self, vocab: int, seq_len: int, params: TransformerParams) -> None:
        super().__init__()
        d_ff = params.d_ff or 4 * params.d_model
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab, params.d_model)
        self.pos_emb = nn.Embedding(seq_len, params.d_model)
        self.drop = nn.Dropout(params.dropout)
        self.blocks = nn.ModuleList(
            Block(params.d_model, params.n_heads, d_ff, params.dropout) for _ in range(params.n_layers))
        self.ln_f = nn.LayerNorm(params.d_model)
        self.head = nn.Linear(params.d_model, vocab, bias=False)
        self._init_weights()
        if params.tie_weights:
            self.head.weight = self.tok_emb.weight  # one Parameter, two names in the state dict

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """What runs before the first block (a pipeline's first stage): (batch, length) ids → activations."""
        length = tokens.shape[1]
        if length > self.seq_len:
            raise ValueError(f"sequence of {length} tokens is longer than the model's {self.seq_len}")
        positions = torch.arange(length, device=tokens.device)
        return self.drop(self.tok_emb(tokens) + self.pos_emb(positions))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """What runs after the last block (a pipeline's last stage): activations → logits."""
        return self.head(self.ln_f(x))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, length) token ids → (batch, length, vocab) next-token logits."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.finish(x)


def build_transformer(params: TransformerParams, info: DatasetInfo) -> TransformerLM:
    """The LM for ``info`` (token data): vocabulary = ``info.num_outputs``, length = ``info.input_shape[0]``."""
    return TransformerLM(vocab=info.num_outputs, seq_len=info.input_shape[0], params=params)
