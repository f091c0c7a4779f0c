"""The model and data both training scripts of tests/ports/ share, as a research repository keeps
its model in model.py beside train.py: a small GPT-like decoder over a synthetic token stream.

Written for fnaccel's port tests (nanoGPT's model.py is the kind of file it stands for, not its
source). Porting the training script to fnaccel leaves this file untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 32
    block_size: int = 16
    num_layers: int = 2
    num_heads: int = 2
    dim: int = 32
    dropout: float = 0.0


class Block(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.ln_1 = nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.ln_2 = nn.LayerNorm(config.dim)
        self.fc = nn.Linear(config.dim, 4 * config.dim)
        self.fc_out = nn.Linear(4 * config.dim, config.dim)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, dim = x.shape
        q, k, v = (
            t.view(batch, time, self.num_heads, dim // self.num_heads).transpose(1, 2)
            for t in self.qkv(self.ln_1(x)).split(dim, dim=2)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attended.transpose(1, 2).reshape(batch, time, dim)))
        return x + self.dropout(self.fc_out(F.gelu(self.fc(self.ln_2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.dim)
        self.position_embedding = nn.Embedding(config.block_size, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.token_embedding(idx) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def configure_optimizers(
        self, weight_decay: float, learning_rate: float, betas: tuple[float, float]
    ) -> torch.optim.AdamW:
        """AdamW with weight decay on the matrices and embeddings only: biases and norms are
        another group. The optimizer's parameter order is therefore not the model's."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def token_stream(num_tokens: int, vocab_size: int, seed: int) -> torch.Tensor:
    """A synthetic "text": a random sparse Markov chain over the vocabulary, so there is
    something to learn. Drawn from its own generator: the process's is left alone."""
    generator = torch.Generator().manual_seed(seed)
    transitions = torch.rand(vocab_size, vocab_size, generator=generator) ** 8
    tokens = torch.empty(num_tokens, dtype=torch.long)
    tokens[0] = 0
    for i in range(1, num_tokens):
        tokens[i] = torch.multinomial(transitions[tokens[i - 1]], 1, generator=generator)
    return tokens


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every window of ``block_size`` tokens, with the next tokens as its targets."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return len(self.tokens) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i : i + self.block_size], self.tokens[i + 1 : i + 1 + self.block_size]


def splits(config: GPTConfig, num_tokens: int) -> tuple[Windows, Windows]:
    """The training and validation windows: the stream's first 90% and the rest."""
    tokens = token_stream(num_tokens, config.vocab_size, seed=0)
    cut = int(0.9 * num_tokens)
    return Windows(tokens[:cut], config.block_size), Windows(tokens[cut:], config.block_size)
