"""SASRec+ in plain PyTorch: the reference the foundation model's training step is timed against.

SASRec (Kang & McAuley 2018) trained as SASRec+ (Klenitskiy & Vasilev, RecSys 2023,
antklen/sasrec-bert4rec-recsys23): an item embedding (row 0 padding) plus learned positions, a causal
transformer, and cross-entropy over every item at every position, the item table tied as the output
layer, Adam. The layer-norm placement is the foundation model's (pre-LN blocks, x + attn(ln(x)), then
x + mlp(ln(x)), and a final LN; GELU in the MLP), so both run the same shapes: `num_layers` blocks of
d_model, `num_heads` heads, an MLP of `inner` units, dropout after the embeddings, on the attention
probabilities and on both residual branches.

torch is imported only when a model is built (`build`): this module imports without it, as the benchmark
suite does in a wheel without the TorchRec baseline.
"""

from __future__ import annotations

import dataclasses
import importlib.util


def torch_installed() -> bool:
    """torch importable (found without importing it)."""
    return importlib.util.find_spec("torch") is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SASRecConfig:
    """The reference's shapes: `items` real items (ids 1..items; 0 is padding), histories of `max_len`."""

    items: int
    max_len: int = 200
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    inner: int = 256
    dropout: float = 0.2
    learning_rate: float = 1e-3

    def __post_init__(self):
        for f in ("items", "max_len", "d_model", "num_layers", "num_heads", "inner"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SASRecConfig.{f} must be an integer >= 1, got {v!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"SASRecConfig.num_heads={self.num_heads} must divide d_model={self.d_model}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"SASRecConfig.dropout must be in [0, 1), got {self.dropout!r}")


def build(cfg: SASRecConfig):
    """(model, optimizer): the SASRec+ module and its Adam. Needs torch."""
    import torch

    model = _module(torch)(cfg)
    return model, torch.optim.Adam(model.parameters(), lr=cfg.learning_rate)


def _module(torch):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, cfg: SASRecConfig):
            super().__init__()
            d = cfg.d_model
            self.h, self.p = cfg.num_heads, cfg.dropout
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.proj = nn.Linear(d, cfg.inner), nn.Linear(cfg.inner, d)
            self.drop = nn.Dropout(cfg.dropout)

        def forward(self, x, allowed):
            b, l, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, l, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=self.p if self.training else 0.0)
            x = x + self.drop(self.out(a.transpose(1, 2).reshape(b, l, d)))
            return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))

    class SASRec(nn.Module):
        """`forward(items [B, L] int64, 0 = padding) -> hidden [B, L, d]`; `loss(items, targets)` is the
        cross-entropy of every position's next item over all items (targets 0 = no target)."""

        def __init__(self, cfg: SASRecConfig):
            super().__init__()
            self.cfg = cfg
            self.item_emb = nn.Embedding(cfg.items + 1, cfg.d_model, padding_idx=0)
            self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
            self.ln_f = nn.LayerNorm(cfg.d_model)
            for w in self.parameters():  # as the SASRec implementations SASRec+ builds on: Xavier-normal matrices
                if w.dim() > 1:
                    nn.init.xavier_normal_(w)
            with torch.no_grad():
                self.item_emb.weight[0].zero_()

        def forward(self, items):
            b, l = items.shape
            valid = items > 0
            x = self.item_emb(items) * valid[..., None] + self.pos_emb.weight[:l][None]
            x = self.drop(x)
            causal = torch.ones(l, l, dtype=torch.bool, device=items.device).tril()
            # a position attends to valid positions <= itself, and always to itself (no fully masked row)
            allowed = (causal[None] & valid[:, None, :]) | torch.eye(l, dtype=torch.bool, device=items.device)[None]
            allowed = allowed[:, None]  # [B, 1, L, L]
            for block in self.blocks:
                x = block(x, allowed)
            return self.ln_f(x)

        def loss(self, items, targets):
            """Mean cross-entropy over the positions with a target (targets > 0), all items as candidates."""
            logits = self(items) @ self.item_emb.weight[1:].T  # [B, L, items]: padding is no candidate
            return F.cross_entropy(logits.reshape(-1, self.cfg.items), (targets - 1).reshape(-1), ignore_index=-1)

    return SASRec


def train_step(model, optimizer, items, targets) -> float:
    """One Adam step on a batch; returns the loss (read back, as a training loop logs it)."""
    optimizer.zero_grad(set_to_none=True)
    loss = model.loss(items, targets)
    loss.backward()
    optimizer.step()
    return float(loss.detach())
