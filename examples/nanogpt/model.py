"""A tiny character-level GPT for the nanoGPT examples (written for unison; the architecture is the
usual one: token and position embeddings, pre-norm causal self-attention blocks, a tied head).

>>> model = GPT(GPTConfig(vocab_size=65))
>>> logits, loss = model(idx, targets)      # loss: mean cross-entropy over the targets' tokens
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0


class Block(nn.Module):
    """Pre-norm causal self-attention then an MLP, each added to the residual stream."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.n_embd)
        self.attn = nn.MultiheadAttention(
            config.n_embd, config.n_head, dropout=config.dropout, batch_first=True
        )
        self.norm2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied input and output embeddings
        for emb in (self.tok, self.pos):  # small, as GPT-2 does: the tied head's logits start near 0
            nn.init.normal_(emb.weight, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=idx.device), diagonal=1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, causal)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction, ignore_index=-1)
        return logits, loss


def char_corpus() -> str:
    """The text both scripts train on: the dataset descriptions shipped with scikit-learn (about
    43,000 characters of English prose and tables; nothing downloaded)."""
    from importlib.util import find_spec
    from pathlib import Path

    # Found, not imported: importing scikit-learn would cost each process about 1.7 s of CPU.
    spec = find_spec("sklearn")
    assert spec is not None and spec.submodule_search_locations, "scikit-learn is not installed"
    folder = Path(spec.submodule_search_locations[0]) / "datasets" / "descr"
    return "\n".join(p.read_text() for p in sorted(folder.glob("*.rst")))
