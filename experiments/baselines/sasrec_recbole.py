"""SASRec as RecBole 1.2.1 implements it, in PyTorch, trained and scored on jaxscale's leave-one-out split.

The reference sequential recommender of the MovieLens benchmark (docs/movielens.md). The model is a line-by-line
port of `recbole/model/sequential_recommender/sasrec.py` and the `TransformerEncoder` of
`recbole/model/layers.py` (post-LN BERT blocks, GELU by erf, additive -10000 attention mask, item embedding
shared between input and output, position embedding, LayerNorm + dropout on the input), at RecBole's
default SASRec hyperparameters (`recbole/properties/model/SASRec.yaml`): 2 layers, 2 heads, hidden 64,
inner 256, dropout 0.5 (hidden and attention), layer_norm_eps 1e-12, init N(0, 0.02), CE loss over all
items; training as RecBole's trainer runs it: Adam lr 1e-3, no weight decay, every prefix of a user's
training events a training example (its last 50 items), batch 256 (the issue's setting; RecBole's default
is 2048), early stopping on validation NDCG@10 with patience 10 epochs, the best epoch's weights scored on
test (the test metrics are taken when validation improves: the same weights).

Data: the examples come from the same store and the same reader as the foundation model
(`PointInTimeExamples(split_mode='leave_one_out')`), so split, tie order and targets are identical; the
metrics are computed by `jaxscale.training.ranking` (full ranking; the padding and out-of-vocabulary rows are never
candidates, as RecBole never ranks its [PAD] item). Both maskings are scored from the same scores: `valid` /
`test` under the run's choice (`--mask-history`: every item of the user's history removed, as the
foundation model's protocol does; default not masked, RecBole's), `test_other_masking` the other way, and
early stopping reads the chosen one.

`--seen-item-offset` gives SASRec the one mechanism the foundation model has and RecBole's SASRec lacks: one
learned scalar added to the score of every item in the example's history window (the foundation model's
`seen_item_bias`, in training and scoring alike), so a comparison can give both sides the same mechanism;
`--seen-item-offset-scale S` gives it the same parametrisation too (the offset is S times the trained scalar,
the foundation model's `seen_item_bias_scale`).

    python experiments/baselines/sasrec_recbole.py --store S --defs D --sequence ratings --json OUT \
        [--mask-history] [--seen-item-offset [--seen-item-offset-scale S]] [--max-len 50] [--seed N]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time

import numpy as np

from jaxscale.infra import atomic

MAX_LEN = 50
RESERVED = 2  # the vocabulary's PAD (0) and OOV (1) rows


def load_split(store, defs, sequence, split, max_len=MAX_LEN):
    """(history item rows int64 [N, max_len] right-padded with 0, length [N], target rows [N], users [N],
    bool [N, items] every item of the user's whole history before the target: what masking removes)."""
    from jaxscale.sequences.examples import PointInTimeExamples

    src = PointInTimeExamples(
        store,
        sequence,
        defs,
        max_seq_len=max_len,
        num_actions=16,
        num_surfaces=16,
        split=split,
        split_mode="leave_one_out",
    )
    n = len(src)
    hist = np.zeros((n, max_len), np.int64)
    target = np.zeros(n, np.int64)
    users = np.zeros(n, np.int64)
    for i in range(n):
        ex = src[i]
        ids = ex["item_ids"].astype(np.int64)
        hist[i] = np.where(ids >= 0, ids, 0)  # RecBole's padding id is 0, which is also the vocabulary's PAD
        target[i] = int(ex["target_item_ids"])
        users[i] = src.anchor(i)[0]
    length = (hist > 0).sum(1)
    seen = src.seen_mask(np.arange(n), src.reader.vocabulary("item_id").num_indices)
    return hist, length, target, users, seen


def build_model(
    n_items: int, torch, nn, max_len: int = MAX_LEN, seen_item_offset: bool = False, offset_scale: float = 1.0
):
    """RecBole's SASRec (default hyperparameters), optionally with the foundation model's seen-item offset
    (`offset_scale` times one trained scalar, 0 at init)."""
    hidden, inner, heads, layers, p_hidden, p_attn, eps, init = 64, 256, 2, 2, 0.5, 0.5, 1e-12, 0.02

    def gelu(x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))

    class MultiHeadAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.h, self.d = heads, hidden // heads
            self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
            self.attn_dropout = nn.Dropout(p_attn)
            self.dense = nn.Linear(hidden, hidden)
            self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
            self.out_dropout = nn.Dropout(p_hidden)

        def forward(self, x, mask):
            b, l, _ = x.shape
            q = self.query(x).view(b, l, self.h, self.d).permute(0, 2, 1, 3)
            k = self.key(x).view(b, l, self.h, self.d).permute(0, 2, 3, 1)
            v = self.value(x).view(b, l, self.h, self.d).permute(0, 2, 1, 3)
            scores = torch.matmul(q, k) / math.sqrt(self.d) + mask
            probs = self.attn_dropout(torch.softmax(scores, dim=-1))
            ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous().view(b, l, hidden)
            return self.LayerNorm(self.out_dropout(self.dense(ctx)) + x)

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense_1, self.dense_2 = nn.Linear(hidden, inner), nn.Linear(inner, hidden)
            self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
            self.dropout = nn.Dropout(p_hidden)

        def forward(self, x):
            return self.LayerNorm(self.dropout(self.dense_2(gelu(self.dense_1(x)))) + x)

    class TransformerLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.multi_head_attention, self.feed_forward = MultiHeadAttention(), FeedForward()

        def forward(self, x, mask):
            return self.feed_forward(self.multi_head_attention(x, mask))

    class SASRec(nn.Module):
        def __init__(self):
            super().__init__()
            self.item_embedding = nn.Embedding(n_items, hidden, padding_idx=0)
            self.position_embedding = nn.Embedding(max_len, hidden)
            self.seen_offset = nn.Parameter(torch.zeros(())) if seen_item_offset else None
            layer = TransformerLayer()
            self.layer = nn.ModuleList([copy.deepcopy(layer) for _ in range(layers)])
            self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
            self.dropout = nn.Dropout(p_hidden)
            self.apply(self._init_weights)

        @staticmethod
        def _init_weights(m):
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.data.normal_(mean=0.0, std=init)
            elif isinstance(m, nn.LayerNorm):
                m.bias.data.zero_()
                m.weight.data.fill_(1.0)
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.data.zero_()

        def forward(self, seq, length):
            pos = torch.arange(seq.size(1), device=seq.device).unsqueeze(0).expand_as(seq)
            x = self.dropout(self.LayerNorm(self.item_embedding(seq) + self.position_embedding(pos)))
            keep = (seq != 0).unsqueeze(1).unsqueeze(2).expand(-1, -1, seq.size(-1), -1)
            mask = torch.where(torch.tril(keep), 0.0, -10000.0)
            for layer in self.layer:
                x = layer(x, mask)
            idx = (length - 1).view(-1, 1, 1).expand(-1, -1, x.shape[-1])
            return x.gather(dim=1, index=idx).squeeze(1)

        def scores(self, seq, length):
            """[B, items]: the query against every item, plus the offset on the items of the history window."""
            out = self(seq, length) @ self.item_embedding.weight.T
            if self.seen_offset is not None:
                window = torch.zeros_like(out).scatter_(1, seq, 1.0)
                window[:, 0] = 0.0  # the padding row is not an item of the history
                out = out + self.offset() * window
            return out

        def offset(self):
            return offset_scale * self.seen_offset

    return SASRec()


def evaluate(model, data, torch, ks=(10, 20), batch=1024, mask_history=False):
    """Full ranking of every item row except PAD/OOV (`jaxscale.training.ranking`), in eval mode, both ways:
    (metrics and top-K under `mask_history`, the metrics and top-K of the other masking)."""
    from jaxscale.training import ranking

    hist, length, target, _, seen = data
    model.eval()
    tops = {False: [], True: []}
    with torch.no_grad():
        for s in range(0, len(hist), batch):
            scores = model.scores(torch.from_numpy(hist[s : s + batch]), torch.from_numpy(length[s : s + batch]))
            scores = scores.numpy().astype(np.float64)
            scores[:, :RESERVED] = -np.inf
            tops[False].append(ranking.topk_from_scores(scores, max(ks)))
            tops[True].append(ranking.topk_from_scores(scores, max(ks), exclude=seen[s : s + batch]))
    model.train()
    topk, other = np.concatenate(tops[mask_history]), np.concatenate(tops[not mask_history])
    return ranking.ranking_metrics(topk, target, ks), topk, ranking.ranking_metrics(other, target, ks), other


def train(
    store,
    defs,
    sequence,
    *,
    seed=2020,
    batch=256,
    max_epochs=300,
    patience=10,
    threads=None,
    log=print,
    progress=None,
    max_len=MAX_LEN,
    mask_history=False,
    seen_item_offset=False,
    offset_scale=1.0,
):
    """Trains with early stopping on validation NDCG@10; returns (results dict, (test users, test top-K, test top-K
    of the other masking)).
    `progress(results)` is called after every epoch with the results so far (the best epoch's test metrics
    included), so a run cut short still leaves a complete record of what it reached."""
    import torch
    from torch import nn

    from jaxscale.sequences.query import SequenceReader

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tr, va, te = (load_split(store, defs, sequence, s, max_len) for s in ("train", "valid", "test"))
    n_items = SequenceReader(store, sequence).vocabulary("item_id").num_indices  # PAD, OOV and every movie
    model = build_model(n_items, torch, nn, max_len, seen_item_offset, offset_scale)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    hist, length, target, _, _ = tr
    best, bad, curve, seconds, steps = -1.0, 0, [], 0.0, 0
    results, top = None, None
    for epoch in range(max_epochs):
        t0 = time.perf_counter()
        order = rng.permutation(len(hist))
        total = 0.0
        for s in range(0, len(order), batch):
            i = order[s : s + batch]
            loss = loss_fn(
                model.scores(torch.from_numpy(hist[i]), torch.from_numpy(length[i])), torch.from_numpy(target[i])
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(i)
            steps += 1
        metrics, _, _, _ = evaluate(model, va, torch, mask_history=mask_history)
        seconds += time.perf_counter() - t0  # training and the per-epoch validation, as RecBole's loop
        curve.append({"epoch": epoch + 1, "steps": steps, "train_loss": total / len(hist), **metrics})
        log(f"epoch {epoch + 1}: loss {total / len(hist):.4f} valid ndcg@10 {metrics['ndcg@10']:.4f}")
        if metrics["ndcg@10"] > best:
            best, bad = metrics["ndcg@10"], 0
            test, topk, test_other, topk_other = evaluate(model, te, torch, mask_history=mask_history)
            top = (te[3], topk, topk_other)
            results = {"valid": metrics, "test": test, "test_other_masking": test_other, "best_epoch": epoch + 1}
        else:
            bad += 1
        done = bad >= patience
        results.update(
            train_seconds=seconds,
            steps=steps,
            epochs=len(curve),
            curve=curve,
            early_stopped=done,
            threads=torch.get_num_threads(),
            torch=torch.__version__,
            users=int(len(te[3])),
            batch=batch,
            patience=patience,
            seed=seed,
            max_len=max_len,
            mask_history=mask_history,
            seen_item_offset=seen_item_offset,
            seen_offset_scale=offset_scale if seen_item_offset else None,
            seen_offset_value=None if model.seen_offset is None else float(model.offset().detach()),
        )
        if progress is not None:
            progress(results)
        if done:
            break
    return results, top


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--defs", required=True)
    ap.add_argument("--sequence", default="ratings")
    ap.add_argument("--json", required=True)
    ap.add_argument("--max-epochs", type=int, default=300)
    ap.add_argument("--patience", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=2020)
    ap.add_argument("--topk", default=None, help="write the test top-20 (raw ids) to this Parquet file")
    ap.add_argument("--topk-other", default=None, help="the test top-20 of the other masking, to this file")
    ap.add_argument("--max-len", type=int, default=MAX_LEN, help="history length (the protocol's)")
    ap.add_argument("--mask-history", action="store_true", help="rank with every history item removed")
    ap.add_argument("--seen-item-offset", action="store_true", help="a learned score offset for history items")
    ap.add_argument("--seen-item-offset-scale", type=float, default=1.0, help="the offset is this x the scalar")
    args = ap.parse_args(argv)

    def save(results):
        atomic.write_json(args.json, results)

    out, (users, topk, topk_other) = train(
        args.store,
        args.defs,
        args.sequence,
        seed=args.seed,
        max_epochs=args.max_epochs,
        patience=args.patience,
        threads=args.threads,
        progress=save,
        max_len=args.max_len,
        mask_history=args.mask_history,
        seen_item_offset=args.seen_item_offset,
        offset_scale=args.seen_item_offset_scale,
    )
    from jaxscale.sequences.query import SequenceReader
    from jaxscale.training.evaluate import write_topk
    from jaxscale.training.ranking_eval import RankingResult

    decode = SequenceReader(args.store, args.sequence).vocabulary("item_id").decode
    for path, lists in ((args.topk, topk), (args.topk_other, topk_other)):
        if path:
            write_topk(path, RankingResult(users, np.zeros(len(users), np.int64), lists, {}, 0), decode)
    save(out)
    print(json.dumps({k: out[k] for k in ("valid", "test", "train_seconds", "epochs", "best_epoch")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
