"""A small RETRO decoder (Borgeaud et al. 2021, arXiv 2112.04426).

Shapes: b batch, n sequence tokens, m chunk tokens, c = n/m chunks, k neighbours per chunk,
r = 2m tokens per neighbour (retrieved chunk + its continuation), d model width.

- Decoder: token + learned position embeddings, pre-norm blocks of causal self-attention and
  an MLP; blocks listed in `cca_layers` also carry chunked cross-attention (CCA).
- Neighbour encoder: a bidirectional transformer over each neighbour's r tokens, run once per
  forward pass. Unlike RETRO it does not cross-attend to the decoder's chunk states; it is
  self-attention only, which keeps causality trivially true (the neighbours of chunk u were
  retrieved with chunk u, which is complete at position (u+1)·m - 1).
- CCA (as in lucidrains/RETRO-pytorch): the sequence is shifted left by m - 1 and cut into
  windows of m; window u = positions (u+1)·m - 1 ... (u+2)·m - 2 attends to the encoded
  neighbours of chunk u. Positions 0 ... m - 2 see no neighbours.
- pad_id tokens of a neighbour are never attended to (absent neighbours are all pad).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True)
class RetroConfig:
    vocab_size: int = 30522  # token ids are < vocab_size (30522: the BERT/MiniLM tokenizer)
    sequence_tokens: int = 2048  # n: longest input; sizes the position embedding
    chunk_tokens: int = 64  # m: retrieval chunk; neighbours are 2m tokens
    dim: int = 512  # d: width of decoder and encoder
    depth: int = 8  # decoder blocks
    heads: int = 8  # attention heads (d must divide by it)
    cca_layers: tuple[int, ...] | None = None  # 0-based blocks with CCA; None: every third from block 2
    encoder_depth: int = 2  # neighbour encoder blocks
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio × d
    dropout: float = 0.0  # on attention weights and block outputs
    pad_id: int = 0  # neighbour tokens equal to it are masked out
    retrieval: bool = True  # False: no encoder, no CCA (the no-retrieval ablation)

    def __post_init__(self):
        if self.cca_layers is None:  # RETRO: CCA in every third block, from early on
            self.cca_layers = tuple(range(min(2, self.depth - 1), self.depth, 3))
        self.cca_layers = tuple(sorted(set(int(i) for i in self.cca_layers)))
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not divisible by heads {self.heads}")
        if self.sequence_tokens % self.chunk_tokens:
            raise ValueError(
                f"sequence_tokens {self.sequence_tokens} is not a multiple of chunk_tokens {self.chunk_tokens}"
            )
        if any(not 0 <= i < self.depth for i in self.cca_layers):
            raise ValueError(f"cca_layers {self.cca_layers} must lie in [0, depth={self.depth})")

    @property
    def uses_retrieval(self) -> bool:
        return self.retrieval and bool(self.cca_layers)


class Attention(nn.Module):
    """Multi-head attention: self-attention, or cross-attention to `context`."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.query = nn.Linear(dim, dim)
        self.key_value = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, context=None, *, causal=False, key_mask=None):
        # x [B, T, d]; context [B, S, d] (x when None); key_mask [B, S], True = may be attended
        context = x if context is None else context
        (B, T, d), S, h = x.shape, context.shape[1], self.heads
        q = self.query(x).view(B, T, h, d // h).transpose(1, 2)  # [B, h, T, d/h]
        k, v = self.key_value(context).view(B, S, 2, h, d // h).permute(2, 0, 3, 1, 4)  # 2 × [B, h, S, d/h]
        mask = None
        if key_mask is not None:
            # A row with no key at all (every neighbour absent) would softmax over nothing and
            # give NaN: let it attend anywhere, then zero its output below.
            has_key = key_mask.any(dim=-1)  # [B]
            mask = (key_mask | ~has_key[:, None])[:, None, None, :]  # [B, 1, 1, S]
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout if self.training else 0.0
        )
        y = self.out(y.transpose(1, 2).reshape(B, T, d))  # [B, T, d]
        return y if key_mask is None else y * has_key[:, None, None]


class MLP(nn.Module):
    def __init__(self, config: RetroConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.dim
        self.net = nn.Sequential(
            nn.Linear(config.dim, hidden), nn.GELU(), nn.Linear(hidden, config.dim), nn.Dropout(config.dropout)
        )

    def forward(self, x):
        return self.net(x)


class ChunkedCrossAttention(nn.Module):
    """Each window of m positions, shifted by m - 1, attends to its chunk's neighbours."""

    def __init__(self, config: RetroConfig):
        super().__init__()
        self.chunk_tokens = config.chunk_tokens
        self.attention = Attention(config.dim, config.heads, config.dropout)

    def forward(self, x, neighbours, neighbour_mask):
        # x [b, n, d]; neighbours [b, c, k·r, d]; neighbour_mask [b, c, k·r]
        (b, n, d), m = x.shape, self.chunk_tokens
        c, shift = n // m, m - 1
        # Window u holds positions u·m + shift ... u·m + shift + m - 1; the last window runs past
        # the end and is filled with zeros that are cut off again below.
        windows = F.pad(x[:, shift:], (0, 0, 0, shift)).reshape(b * c, m, d)  # [b·c, m, d]
        y = self.attention(windows, neighbours.flatten(0, 1), key_mask=neighbour_mask.flatten(0, 1))  # [b·c, m, d]
        # Shift back: position p gets window output p - shift; positions < shift get zeros.
        return F.pad(y.reshape(b, n, d), (0, 0, shift, 0))[:, :n]  # [b, n, d]


class EncoderBlock(nn.Module):
    def __init__(self, config: RetroConfig):
        super().__init__()
        self.norm_attention = nn.LayerNorm(config.dim)
        self.attention = Attention(config.dim, config.heads, config.dropout)
        self.norm_mlp = nn.LayerNorm(config.dim)
        self.mlp = MLP(config)

    def forward(self, x, mask):
        # x [N, r, d]; mask [N, r]
        x = x + self.attention(self.norm_attention(x), key_mask=mask)
        return x + self.mlp(self.norm_mlp(x))


class NeighbourEncoder(nn.Module):
    """Bidirectional transformer over each neighbour's r = 2m tokens."""

    def __init__(self, config: RetroConfig):
        super().__init__()
        self.position_embedding = nn.Embedding(2 * config.chunk_tokens, config.dim)
        self.blocks = nn.ModuleList(EncoderBlock(config) for _ in range(config.encoder_depth))
        self.norm = nn.LayerNorm(config.dim)

    def forward(self, embedded, mask):
        # embedded [N, r, d] token embeddings; mask [N, r]
        x = embedded + self.position_embedding(torch.arange(embedded.shape[1], device=embedded.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)


class DecoderBlock(nn.Module):
    def __init__(self, config: RetroConfig, with_cca: bool):
        super().__init__()
        self.norm_attention = nn.LayerNorm(config.dim)
        self.attention = Attention(config.dim, config.heads, config.dropout)
        self.norm_cca = nn.LayerNorm(config.dim) if with_cca else None
        self.cca = ChunkedCrossAttention(config) if with_cca else None
        self.norm_mlp = nn.LayerNorm(config.dim)
        self.mlp = MLP(config)

    def forward(self, x, neighbours=None, neighbour_mask=None):
        x = x + self.attention(self.norm_attention(x), causal=True)
        if self.cca is not None and neighbours is not None:
            x = x + self.cca(self.norm_cca(x), neighbours, neighbour_mask)
        return x + self.mlp(self.norm_mlp(x))


class Retro(nn.Module):
    def __init__(self, config: RetroConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.dim)  # shared with the encoder
        self.position_embedding = nn.Embedding(config.sequence_tokens, config.dim)
        self.encoder = NeighbourEncoder(config) if config.uses_retrieval else None
        assert config.cca_layers is not None  # RetroConfig.__post_init__ resolves None
        self.blocks = nn.ModuleList(
            DecoderBlock(config, with_cca=config.uses_retrieval and i in config.cca_layers) for i in range(config.depth)
        )
        self.norm = nn.LayerNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens, neighbours=None):
        """tokens [b, n] -> logits [b, n, vocab]; neighbours [b, n/m, k, 2m] or None (no retrieval)."""
        (b, n), config = tokens.shape, self.config
        if n > config.sequence_tokens:
            raise ValueError(f"{n} tokens, the model takes at most {config.sequence_tokens}")
        x = self.token_embedding(tokens) + self.position_embedding(torch.arange(n, device=tokens.device))  # [b, n, d]
        encoded = mask = None
        if neighbours is not None and self.encoder is not None:
            _, c, k, r = neighbours.shape
            if n % config.chunk_tokens or c != n // config.chunk_tokens or r != 2 * config.chunk_tokens:
                raise ValueError(
                    f"neighbours {tuple(neighbours.shape)} do not fit {n} tokens in chunks of {config.chunk_tokens}"
                )
            mask = (neighbours != config.pad_id).reshape(b * c * k, r)  # [b·c·k, r]
            encoded = self.encoder(self.token_embedding(neighbours.reshape(b * c * k, r)), mask)
            encoded = encoded.reshape(b, c, k * r, -1)  # [b, c, k·r, d]
            mask = mask.reshape(b, c, k * r)  # [b, c, k·r]
        for block in self.blocks:
            x = block(x, encoded, mask)
        return self.lm_head(self.norm(x))  # [b, n, vocab]
